"""Full-precision model weights and optimizer moments in every checkpoint, in any layout, readable without
DeepSpeed.

`save_weights` (collective) writes CHECKPOINT/weights/: safetensors files of fp32 master weights in dstrain's
state-dict naming plus one index per writing rank, and the same for AdamW's moments of every trained
parameter in CHECKPOINT/optimizer/exp_avg/ and .../exp_avg_sq/ (Muon's momentum in .../momentum_buffer/,
dstrain.optim.state_keys). Each tensor (or slice) is written once: a
pipeline stage writes its own layers; a tensor-parallel or expert-parallel shard is written by its owner with
where it sits in the full tensor; replicated tensors by one rank. `iter_weights` puts the pieces back together
one tensor at a time (export streams from it; memory stays at one tensor plus one file's buffer);
`local_slice` cuts the part a rank of another layout holds (resuming elsewhere, reshard.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from dstrain.model.sources import local_tensors, shard_of
from dstrain.optim import state_keys

WEIGHTS_DIR = "weights"
INDEX_RE = re.compile(r"^index-rank(\d+)\.json$")


def moments_dir(key: str) -> str:
    return f"optimizer/{key}"


def link_moments(optimizer: Any) -> None:
    """Point every parameter's fragment at the moments of its group. DeepSpeed 0.19's ZeRO-1/2 and bf16
    optimizers link them once, after stepping the first group, so the other groups' (the norms') stay
    unlinked and `safe_get/set_full_optimizer_state` fail on them."""
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def _full_fp32(
    param: torch.Tensor, keep: bool, optimizer: Any = None, key: str | None = None
) -> torch.Tensor | None:
    """The fp32 master value (or optimizer moment `key`) of a parameter as this rank sees it whole (its TP/EP
    slice): DeepSpeed's optimizer copy under ZeRO/bf16. A collective over the parameter's data-parallel group,
    so every rank calls it; only a rank that `keep`s the value copies it to the host (None elsewhere)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if key is not None:
        value = safe_get_full_optimizer_state(param, key)
        if value is None:
            value = optimizer.state[param][key]  # no ZeRO: torch's AdamW holds the moment itself
        return value.detach().float().cpu() if keep else None
    value = safe_get_full_fp32_param(param)
    if value is None and hasattr(param, "ds_id"):  # frozen under ZeRO-3: no master copy, gather the weight
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            return param.detach().float().cpu().clone() if keep else None
    if not keep:
        return None
    return (value if value is not None else param.detach()).float().cpu()


class _Writers:
    """Which rank writes each tensor: one rank of the group that holds the same copy (data-parallel; for an
    expert-parallel slice, the ranks holding the same experts; a TP-replicated tensor: TP rank 0's group),
    chosen by bytes so far, fewest first. Every member of a group walks the same tensors in the same order, so
    they agree without talking, and the writes (weights and moments: 3 x the fp32 model) spread over the
    group instead of landing on one rank."""

    def __init__(self, groups: Any, rank: int, world: int) -> None:
        self.groups, self.rank, self.world = groups, rank, world
        self.bytes: dict[str, list[int]] = {}

    def writes(self, tensor: torch.Tensor) -> bool:
        g = self.groups
        if g is None:
            kind, me, size = "dp", self.rank, self.world
        elif g.tp_rank != 0 and not hasattr(tensor, "tp_shard"):
            return False
        elif hasattr(tensor, "ep_shard"):
            kind, me, size = "edp", g.edp_rank, g.dims.dp // g.dims.ep
        else:
            kind, me, size = "dp", g.dp_rank, g.dims.dp
        load = self.bytes.setdefault(kind, [0] * size)
        owner = min(range(size), key=load.__getitem__)
        load[owner] += getattr(tensor, "ds_numel", tensor.numel())  # ZeRO-3: the whole tensor's
        return me == owner


class _Folder:
    """One folder of safetensors files plus this rank's index, written in shards of `max_bytes`."""

    def __init__(self, path: Path, rank: int, max_bytes: int) -> None:
        self.out, self.rank, self.max_bytes = path, rank, max_bytes
        self.out.mkdir(parents=True, exist_ok=True)
        self.index: dict[str, Any] = {}
        self.buf: dict[str, torch.Tensor] = {}
        self.size = self.files = 0

    def add(self, name: str, value: torch.Tensor, shard: tuple[int, int, int] | None) -> None:
        full = list(value.shape)
        if shard is not None:
            full[shard[0]] *= shard[2]
        self.index[name] = {
            "shape": list(value.shape),
            "full_shape": full,
            "shard": list(shard) if shard else None,
        }
        self.buf[name] = value.contiguous()
        self.size += value.numel() * 4
        if self.size >= self.max_bytes:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if self.buf:
            name = f"rank{self.rank:05d}-{self.files:05d}.safetensors"
            save_file(self.buf, str(self.out / name))
            for key in self.buf:
                self.index[key]["file"] = name
            self.buf, self.size, self.files = {}, 0, self.files + 1

    def close(self) -> None:
        self.flush()
        (self.out / f"index-rank{self.rank:05d}.json").write_text(
            json.dumps({"format": "dstrain-weights-1", "tensors": self.index})
        )


# fp32 elements that one batched gather assembles (128 MiB); a larger tensor goes alone
BUCKET_ELEMENTS = 2**25


def _batched(tensor: torch.Tensor) -> bool:
    """A parameter whose fp32 values DeepSpeed's ZeRO-1/2 or bf16 optimizer holds in fragments over its
    data-parallel group (`_hp_mapping`, set on every rank, None where the rank holds none of it)."""
    return (
        isinstance(tensor, nn.Parameter) and hasattr(tensor, "_hp_mapping") and not hasattr(tensor, "ds_id")
    )


def _gather_fragments(requests: list[tuple[torch.Tensor, str | None]]) -> list[torch.Tensor]:
    """The full fp32 master weight (key None) or optimizer state `key` of each (parameter, key), all of one
    data-parallel group: what DeepSpeed's get_full_hp_param gives for one, with one all_reduce for them all
    (each rank's fragments in a zero buffer; every element has one owner, so the sum is exact) instead of one
    per tensor and state, which made a small model's save a few hundred collectives."""
    sizes = [param.numel() for param, _ in requests]
    buffer = torch.zeros(sum(sizes), dtype=torch.float32, device=requests[0][0].device)
    views = buffer.split(sizes)
    for (param, key), view in zip(requests, views):
        mapping = param._hp_mapping
        if mapping is not None:
            at = mapping.lp_fragment_address
            view.narrow(0, at.start, at.numel).copy_(mapping.get_hp_fragment(key).data)
    tdist.all_reduce(buffer, group=requests[0][0]._dp_group)
    return [view.view(param.shape) for (param, _), view in zip(requests, views)]


def save_weights(
    model: nn.Module,
    path: Path,
    *,
    rank: int,
    groups: Any = None,
    optimizer: Any = None,
    max_shard_bytes: int = 2**31,
) -> None:
    """Collective: every rank calls it, with the same parameter order within each data-parallel group.
    `optimizer` (DeepSpeed's, once it has stepped): also write the moments of the trained parameters. The
    fragments of consecutive ZeRO-1/2 parameters of one group are assembled together (`_gather_fragments`,
    buckets cut at the same tensors on every member: they hold the same parameters)."""
    path = Path(path)
    writers = _Writers(groups, rank, tdist.get_world_size() if tdist.is_initialized() else 1)
    weights = _Folder(path / WEIGHTS_DIR, rank, max_shard_bytes)
    moments: dict[str, _Folder] = {}  # by state key, opened at its first tensor
    base = getattr(optimizer, "optimizer", optimizer)  # torch's AdamW under DeepSpeed's wrapper
    if optimizer is not None:
        link_moments(optimizer)

    def keys_of(tensor: torch.Tensor) -> tuple[str, ...]:
        trained = isinstance(tensor, nn.Parameter) and tensor.requires_grad
        return tuple(state_keys(tensor)) if trained and optimizer is not None else ()

    def add(name: str, tensor: torch.Tensor, value: torch.Tensor, held: dict[str, torch.Tensor]) -> None:
        for key, moment in held.items():
            if key not in moments:
                moments[key] = _Folder(path / moments_dir(key), rank, max_shard_bytes)
            moments[key].add(name, moment, shard_of(tensor))
        weights.add(name, value, shard_of(tensor))

    bucket: list[tuple[str, torch.Tensor, tuple[str, ...]]] = []  # (name, parameter, its state keys)

    def flush() -> None:
        requests = [(t, key) for _, t, keys in bucket for key in (None, *keys)]
        values = iter(_gather_fragments(requests) if requests else ())
        for name, tensor, keys in bucket:
            value, held = next(values), {key: next(values) for key in keys}
            if writers.writes(tensor):
                add(name, tensor, value.cpu(), {key: v.cpu() for key, v in held.items()})
        bucket.clear()

    for name, tensor in local_tensors(model, adapters=True):
        if tensor.device.type == "meta":  # another pipeline stage's layer
            continue
        if _batched(tensor):
            keys = keys_of(tensor)
            elements = sum(t.numel() * (1 + len(k)) for _, t, k in bucket)
            if bucket and (
                bucket[0][1]._dp_group is not tensor._dp_group
                or elements + tensor.numel() * (1 + len(keys)) > BUCKET_ELEMENTS
            ):
                flush()
            bucket.append((name, tensor, keys))
            continue
        flush()  # in order: writers.writes sees the tensors as every rank walks them
        writes = writers.writes(tensor)
        if isinstance(tensor, nn.Parameter):  # ZeRO-3 (a collective on every rank), no ZeRO, or frozen
            value = _full_fp32(tensor, keep=writes)
            held = {key: _full_fp32(tensor, writes, base, key) for key in keys_of(tensor)}
        else:
            value, held = (tensor.detach().float().cpu() if writes else None), {}
        if writes:
            add(name, tensor, value, held)
    flush()
    for folder in (weights, *moments.values()):
        folder.close()


def weights_index(checkpoint_dir: Path, folder: str = WEIGHTS_DIR) -> dict[str, dict[str, Any]]:
    """name -> {"full_shape", "pieces": [{"file", "shard"}...]} over every rank's index."""
    root = Path(checkpoint_dir) / folder
    merged: dict[str, dict[str, Any]] = {}
    files = sorted(p for p in root.glob("index-rank*.json") if INDEX_RE.match(p.name))
    if not files:
        raise FileNotFoundError(f"{checkpoint_dir}: no {folder}/index-rank*.json (not a dstrain checkpoint?)")
    for f in files:
        for name, entry in json.loads(f.read_text())["tensors"].items():
            item = merged.setdefault(name, {"full_shape": entry["full_shape"], "pieces": []})
            item["pieces"].append({"file": entry["file"], "shard": entry["shard"]})
    for name, item in merged.items():
        shards = [p["shard"] for p in item["pieces"]]
        if shards[0] is None:
            item["pieces"] = item["pieces"][:1]
        else:
            item["pieces"].sort(key=lambda p: p["shard"][1])
            if [p["shard"][1] for p in item["pieces"]] != list(range(shards[0][2])):
                raise ValueError(
                    f"{checkpoint_dir}: {name} has shards {sorted(s[1] for s in shards)} of {shards[0][2]}"
                )
    return merged


def iter_weights(
    checkpoint_dir: Path, names: list[str] | None = None, folder: str = WEIGHTS_DIR
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full fp32 tensor), one at a time, in index order (or the order of `names`)."""
    from safetensors import safe_open

    root = Path(checkpoint_dir) / folder
    index = weights_index(checkpoint_dir, folder)
    for name in names if names is not None else list(index):
        item = index[name]
        parts = []
        for piece in item["pieces"]:
            with safe_open(str(root / piece["file"]), framework="pt") as f:
                parts.append(f.get_tensor(name))
        dim = item["pieces"][0]["shard"][0] if item["pieces"][0]["shard"] else 0
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
        assert list(tensor.shape) == item["full_shape"], (name, tensor.shape, item["full_shape"])
        yield name, tensor


def local_slice(full: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """The part of a whole saved tensor that `tensor` (a TP/EP shard of this layout, or whole) holds."""
    shard = shard_of(tensor)
    return full if shard is None else full.chunk(shard[2], dim=shard[0])[shard[1]]


@torch.no_grad()
def load_local_weights(model: nn.Module, checkpoint_dir: Path) -> None:
    """Copy this rank's slice of every saved tensor into `model` (its own layers, TP/EP shards). After
    DeepSpeed's own load, so that module weights agree with the optimizer's restored fp32 master copy in
    layouts whose module files DeepSpeed writes from one rank only (expert parallelism)."""
    from safetensors import safe_open

    root = Path(checkpoint_dir) / WEIGHTS_DIR
    index = weights_index(checkpoint_dir)
    for name, tensor in local_tensors(model, adapters=True):
        if tensor.device.type == "meta":
            continue
        if name not in index:
            raise KeyError(f"{checkpoint_dir}: weights/ has no {name}")
        shard = shard_of(tensor)
        pieces = index[name]["pieces"]
        piece = pieces[shard[1]] if shard is not None else pieces[0]
        with safe_open(str(root / piece["file"]), framework="pt") as f:
            value = f.get_tensor(name)
        tensor.copy_(value.to(tensor.dtype))
