"""Training runs several test modules read (LoRA training, export): a transformers-written HF folder and
single-process dstrain runs on it, made once per session; `train`, a `dstrain train` run in the session's
1-rank pool of ranks."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from dstrain.checkpoint.store import read_model_config
from dstrain.checkpoint.weights import iter_weights
from dstrain.config.plan import model_config
from dstrain.model import DeepSeekLM
from dstrain.training.finetune import apply_finetune_options
from tests.helpers.hf import official_folder
from tests.helpers.tiny import byte_tokenizer
from tests.helpers.trainer import make_options

LORA_ARGS = ["--lora_r", "4", "--lora_alpha", "8", "--no-train_router", "--no-train_mtp"]
LORA_ARGS += ["--moe_bias_update_speed", "0", "--lr", "1e-2"]


def read_weights(ckpt):
    """A checkpoint's full weights (any layout), as a generator of (key, tensor)."""
    return iter_weights(Path(ckpt))


def hf_source(path: Path, cfg=None) -> Path:  # noqa: ANN001 - a transformers config
    """A transformers-written tiny V3 folder (or `cfg`'s model, tests/helpers/hf.py) extended with an MTP layer
    (bf16, 2 shards) and a byte tokenizer (so dstrain's data pipeline fits its 320-token vocabulary)."""
    path.mkdir(parents=True)
    official_folder(path, cfg=cfg)
    byte_tokenizer().save_pretrained(path)
    return path


def train(pools, args: list[str], timeout: int = 300) -> SimpleNamespace:  # noqa: ANN001
    """`dstrain train ARGS` as one process runs it (no launcher; short rows, no MFU measurement), in the session's
    1-rank pool (`pools`: the rank_pools fixture) instead of a process of its own -> .stdout, .returncode."""
    common = ["--seq_len", "32", "--micro_batch_size", "2", "--peak_tflops", "1", "--warmup_steps", "1"]
    res = pools.run(1, "tests.training.worker:cli_out", [*common, *args], timeout=timeout)[0]
    assert res["rc"] == 0, res["stdout"][-2000:] + res["stderr"][-2000:]
    return SimpleNamespace(stdout=res["stdout"], returncode=res["rc"])


def check_lora_json(ckpt: Path, args: list[str]) -> None:
    """checkpoint.save wrote lora.json (through save_lora_settings), equal to a fresh derivation."""
    opts = make_options(args)
    with torch.device("meta"):
        model = DeepSeekLM(model_config(opts, read_model_config(ckpt)))
    apply_finetune_options(model, opts.lora, opts.run.seed)
    assert json.loads((ckpt / "lora.json").read_text()) == json.loads(json.dumps(model.lora_settings))


def lora_runs(pools, root: Path) -> dict[str, Path]:  # noqa: ANN001
    """hf: the source folder; full: --max_steps 0 on it; lora0/lora3: a LoRA run's step 0 and step 3 (the
    session fixture `trained` in tests/conftest.py)."""
    hf = hf_source(root / "hf")
    train(pools, ["--model", str(hf), "--max_steps", "0", "--output_dir", str(root / "full")])
    lora = ["--model", str(hf), "--output_dir", str(root / "lora"), *LORA_ARGS]
    train(pools, [*lora, "--max_steps", "0"])
    train(pools, [*lora, "--max_steps", "3", "--resume", "auto"])
    ckpts = root / "lora" / "checkpoints"
    for step in ("step_00000000", "step_00000003"):
        check_lora_json(ckpts / step, LORA_ARGS)
    return {
        "hf": hf,
        "full": root / "full" / "checkpoints" / "step_00000000",
        "lora0": ckpts / "step_00000000",
        "lora3": ckpts / "step_00000003",
    }
