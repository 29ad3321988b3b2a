"""The checkpoint store: DeepSpeed's engine state plus dstrain's own per-rank state (JSON, no pickle), the
layout-free weights (weights.py), the model's config.json and LoRA settings; completion, discovery, pruning.

Layout: OUTPUT_DIR/checkpoints/step_00000100/ holds DeepSpeed's files, dstrain_state/rank_00000.json ...,
weights/, config.json and, once every rank has finished writing, a COMPLETE marker (JSON: step, world size,
every file and its size) written by rank 0 after a barrier; only then does rank 0 point `latest` at it. A
folder without a valid marker is never resumed from or exported, so a crash mid-save leaves the previous
checkpoint in charge. `find` is the one way to locate a checkpoint from a path a user gives.

Trust: dstrain's own state is JSON (never unpickled). DeepSpeed's files are read through `SafeCheckpointEngine`:
torch's weights-only unpickler, admitting tensors, containers and primitives plus three plain DeepSpeed state
classes, so a tampered checkpoint cannot run code. dstrain loads none without a COMPLETE marker whose file
sizes all match.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import re
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dstrain import dist
from dstrain.atomic import write_atomic, write_json
from dstrain.errors import CheckpointError
from dstrain.model import ModelConfig
from dstrain.model.registry import config_from_hf_dict
from dstrain.parallel import ParallelDims

from .lora import load_lora_settings, save_lora_settings
from .weights import save_weights

MARKER = "COMPLETE"
LATEST = "latest"
STATE_DIR = "dstrain_state"
MODEL_CONFIG = "config.json"
TAG_RE = re.compile(r"^step_(\d+)$")
KILL_ENV = "DSTRAIN_TEST_KILL_DURING_SAVE"


def checkpoint_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


# ------------------------------------------------------------------ RNG state as JSON
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _b64(torch.cuda.get_rng_state())  # this rank's device only
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        torch.cuda.set_rng_state(_unb64(cuda if isinstance(cuda, str) else cuda[torch.cuda.current_device()]))


# ------------------------------------------------------------------ finding checkpoints
def _files(path: Path) -> dict[str, int]:
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_file() and p.name != MARKER and not p.name.endswith(".tmp"):
            out[str(p.relative_to(path))] = p.stat().st_size
    return out


def read_marker(path: Path) -> dict[str, Any]:
    """The marker of a complete checkpoint, after checking every file it lists is there, whole."""
    marker = path / MARKER
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: no such folder")
    if not marker.is_file():
        raise CheckpointError(
            f"checkpoint {path} is incomplete (no {MARKER} marker: its save did not finish)"
        )
    try:
        info = json.loads(marker.read_text())
        files = info["files"]
        int(info["step"]), int(info["world_size"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path}: corrupt {MARKER} marker ({exc})") from None
    for rel, size in files.items():
        p = path / rel
        if not p.is_file():
            raise CheckpointError(f"checkpoint {path} is corrupt: {rel} is missing")
        if p.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {rel} has {p.stat().st_size} bytes, expected {size}"
            )
    return info


def complete_checkpoints(root: Path) -> list[tuple[float, int, Path]]:
    """(completion time, step, folder) of every valid checkpoint under root, oldest first."""
    found = []
    if root.is_dir():
        for p in root.iterdir():
            if TAG_RE.match(p.name) and (p / MARKER).is_file():
                try:
                    info = read_marker(p)
                except CheckpointError:
                    continue
                found.append((float(info.get("saved_at", 0.0)), int(info["step"]), p))
    return sorted(found)


def newest_complete(root: Path) -> Path | None:
    # The most recently completed one, not the highest step: after resuming an older checkpoint into the
    # same folder, the newer steps of the abandoned run must not win the next `--resume auto`.
    found = complete_checkpoints(root)
    return found[-1][2] if found else None


def is_checkpoint_folder(path: Path) -> bool:
    """A folder that is (or was meant to be) one checkpoint, complete or not."""
    return (path / MARKER).exists() or bool(TAG_RE.match(path.name)) or (path / STATE_DIR).is_dir()


def find(path: str | os.PathLike, label: str | None = None) -> Path:
    """The complete checkpoint a user's path names: the checkpoint folder itself (an error if incomplete or
    corrupt), or the newest complete one in a run folder (its checkpoints/) or a folder of checkpoints.
    `label` starts the error messages (default: the path)."""
    path = Path(path)
    label = label or str(path)
    if not path.exists():
        raise CheckpointError(f"{label}: no such file or folder")
    if is_checkpoint_folder(path):
        read_marker(path)
        return path
    for root in (path / "checkpoints", path):
        found = newest_complete(root)
        if found is not None:
            return found
    raise CheckpointError(
        f"{label}: no complete checkpoint in this folder (not a dstrain checkpoint, nor a run folder holding one)"
    )


def resolve_resume(resume: str | None, output_dir: str) -> Path | None:
    """The checkpoint folder to continue, None for a fresh start; CheckpointError for an unusable path."""
    if resume is None:
        return None
    if resume == "auto":
        return newest_complete(checkpoint_root(output_dir))
    return find(resume, label=f"--resume {resume}")


def read_state(path: Path, rank: int = 0) -> dict[str, Any]:
    """dstrain's own state of one rank (step, tokens, loader, RNG, the --model the run started from)."""
    state_file = path / STATE_DIR / f"rank_{rank:05d}.json"
    try:
        return json.loads(state_file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read {state_file.name} ({exc})") from None


def read_model_config(path: Path) -> ModelConfig:
    """The model config the checkpoint describes itself with (its config.json)."""
    try:
        return config_from_hf_dict(json.loads((path / MODEL_CONFIG).read_text()))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read its {MODEL_CONFIG} ({exc})") from None


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint as readers of its files (export, verify) need it, each file read once."""

    path: Path
    config: ModelConfig
    """Its config.json."""
    lora: dict[str, Any] | None
    """Its LoRA settings (lora.json), None for a full fine-tune."""
    source: str | None
    """The --model the run started from (a preset name or an HF folder), None where unrecorded."""
    tokenizer: str | None = None
    """The run's --tokenizer (None: the folder's own, else the bundled one)."""
    base: dict[str, Any] | None = None
    """A stored frozen base (--base_precision stored): the folder holding the weights the checkpoint does not
    copy, and its identity (`check_base`); None where the checkpoint holds every weight."""


def check_base(base: dict[str, Any], what: str) -> None:
    """The folder of a stored base is still the one the run trained on (files' sizes, headers' hash): else a
    CheckpointError naming `what` needs it."""
    from dstrain.model.hf import folder_identity

    folder = base["folder"]
    try:
        now = folder_identity(folder)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{what} reads its frozen base from {folder}, which cannot be read ({exc})"
        ) from None
    if now != base["identity"]:
        raise CheckpointError(
            f"{what} reads its frozen base from {folder}, whose files changed since the run started (sizes or "
            "headers differ): restore that folder"
        )


def checkpoint_weights(opened: Checkpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the checkpoint's model, full fp32, one at a time: the checkpoint's own, then those a
    stored base left in its folder (dequantized as a dense load reads them)."""
    from .weights import iter_weights

    seen = set()
    for key, t in iter_weights(opened.path):
        seen.add(key)
        yield key, t
    if opened.base is None:
        return
    from dstrain.model.sources import Weights, model_shapes

    check_base(opened.base, f"checkpoint {opened.path}")
    with Weights(opened.config, 0, folder=opened.base["folder"]) as weights:
        for key in model_shapes(opened.config):
            if key not in seen and key not in weights.missing:
                yield key, weights.read(key).float()


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """The complete checkpoint `path` names (see `find`)."""
    ckpt = find(path)
    try:
        state = read_state(ckpt)
    except CheckpointError:
        state = {}
    config = read_model_config(ckpt)
    return Checkpoint(
        ckpt, config, load_lora_settings(ckpt), state.get("model"), state.get("tokenizer"), state.get("base")
    )


# ------------------------------------------------------------------ save / load
def _deepspeed_state_classes() -> list[type]:
    """The non-tensor objects DeepSpeed 0.19 puts in its ZeRO 1/2/3 (fp32, bf16) checkpoints."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def install_safe_loading(engine: Any) -> None:
    """Replace DeepSpeed's default checkpoint engine (a full unpickler: it can run code) by one that
    loads weights-only. Saving is unchanged."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class SafeCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):  # noqa: ANN001, ANN202 - DeepSpeed's signature
            with torch.serialization.safe_globals(_deepspeed_state_classes()):
                return torch.load(path, map_location=map_location, weights_only=True)

    if type(engine.checkpoint_engine) is TorchCheckpointEngine:
        safe = SafeCheckpointEngine.__new__(SafeCheckpointEngine)
        safe.__dict__.update(engine.checkpoint_engine.__dict__)
        engine.checkpoint_engine = safe


def save(
    engine: Any,
    output_dir: str,
    step: int,
    state: dict[str, Any],
    keep_last: int,
    model_config: ModelConfig,
    *,
    model: Any,
    groups: Any = None,
    moments: bool = True,
) -> Path:
    """Collective: every rank calls it. Returns the checkpoint folder (complete on return). The model's HF
    config.json is written beside the weights so a checkpoint describes itself. `moments`: also AdamW's
    moments layout-free (what resuming on another layout needs)."""
    root = checkpoint_root(output_dir)
    tag = tag_for(step)
    path = root / tag
    rank, world = state["rank"], state["world_size"]
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if path.exists():  # a partial leftover of a crashed save, or an older run's: never mix files
            (path / MARKER).unlink(missing_ok=True)
            shutil.rmtree(path)
    dist.barrier()
    with _plain_module_files(engine):
        engine.save_checkpoint(str(root), tag=tag, client_state={"dstrain_step": step}, save_latest=False)
    stepped = state.get("progress", {}).get("adam_step", 0) > 0  # AdamW has moments after its first update
    optimizer = engine.optimizer if stepped and moments else None
    save_weights(model, path, rank=rank, groups=groups, optimizer=optimizer)
    save_lora_settings(model, path, rank)
    (path / STATE_DIR).mkdir(parents=True, exist_ok=True)
    write_json(path / STATE_DIR / f"rank_{rank:05d}.json", state)
    if rank == 0:
        write_json(path / MODEL_CONFIG, model_config.to_hf_dict())
    if os.environ.get(KILL_ENV) == str(step) and rank == min(1, world - 1):
        os.kill(os.getpid(), signal.SIGKILL)  # test hook: die after writing, before the marker
    dist.barrier()
    if rank == 0:
        marker = {"step": step, "world_size": world, "saved_at": time.time(), "files": _files(path)}
        write_json(path / MARKER, marker)
        write_atomic(root / LATEST, tag)
        _prune(root, keep_last, keep=path)
    dist.barrier()
    return path


def _prune(root: Path, keep_last: int, keep: Path) -> None:
    if keep_last <= 0:
        return
    older = [p for _, _, p in complete_checkpoints(root) if p != keep]
    for p in older[: max(0, len(older) - (keep_last - 1))]:
        (p / MARKER).unlink(missing_ok=True)  # first, so a half-deleted folder never looks complete
        shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def _plain_module_files(engine: Any) -> Iterator[None]:
    """dstrain's expert-parallel experts are DeepSpeed MoE modules in type only (so ZeRO reduces them over the
    expert-data-parallel group); DeepSpeed's MoE checkpoint code expects its own expert naming. Save and load
    the module like any other: every rank's experts are restored from its own ZeRO partition of the fp32
    master weights, and `weights/` holds them all for export."""
    had = getattr(engine, "has_moe_layers", False)
    engine.has_moe_layers = False
    try:
        yield
    finally:
        engine.has_moe_layers = had


def layout_record(dims: ParallelDims, stage: int, precision: str) -> dict[str, Any]:
    """What DeepSpeed's per-rank checkpoint files and the ranks' data streams depend on, as a checkpoint
    records it: resuming in another one re-shards (`load`)."""
    d = dims
    return {"world": d.world, "pp": d.pp, "tp": d.tp, "ep": d.ep, "sp": d.sp, "dp": d.dp,
            "stage": stage, "precision": precision}  # fmt: skip


def describe_layout(layout: dict[str, Any]) -> str:
    """`2 ranks (dp 2, ZeRO-1, fp32)`; a record without the layout (an older dstrain): its rank count."""
    if "dp" not in layout:
        return f"{layout['world']} ranks"
    dims = ParallelDims(layout["world"], **{k: layout.get(k, 1) for k in ("pp", "tp", "ep", "sp")})
    return f"{layout['world']} rank(s) ({dims.describe()}, ZeRO-{layout['stage']}, {layout['precision']})"


def load(engine: Any, path: Path, rank: int, layout: dict[str, Any], model: Any) -> dict[str, Any]:
    """Restore `engine` from a complete checkpoint and return dstrain's state for this rank. `layout` (world
    size, parallel degrees, ZeRO stage, precision) decides how: the same as the checkpoint's, DeepSpeed's own
    files (bit-exact); another, the layout-free weights and moments (reshard.py), and the state comes back
    with `resharded` set, its `loaders` holding every saved rank's loader state."""
    info = read_marker(path)
    saved_world = int(info["world_size"])
    first = read_state(path, 0)
    if first.get("layout", {"world": saved_world}) == layout or (
        "layout" not in first and saved_world == layout["world"]
    ):
        state = read_state(path, rank)
        with _plain_module_files(engine):
            load_path, _ = engine.load_checkpoint(
                str(path.parent), tag=path.name, load_optimizer_states=True, load_lr_scheduler_states=True
            )
        if load_path is None:
            raise CheckpointError(f"checkpoint {path}: DeepSpeed could not load it")
        return state
    if "progress" not in first:
        raise CheckpointError(
            f"checkpoint {path} was written by {saved_world} ranks in another layout, by a dstrain that did not "
            f"save what resuming in another layout needs: resume it with {saved_world} ranks in its own layout"
        )
    from .reshard import load_resharded

    load_resharded(engine, model, path, first["progress"], int(first["step"]))
    states = [first] + [read_state(path, r) for r in range(1, saved_world)]
    state = dict(states[rank]) if rank < saved_world else {k: v for k, v in first.items() if k != "rng"}
    state["resharded"] = first.get("layout", {"world": saved_world})
    state["loaders"] = [s.get("loader") for s in states]
    return state
