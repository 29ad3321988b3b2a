"""The memory estimate of DeepSeek-V4 (dstrain/memory/v4.py): its parameters are the model's own count, its
activations what autograd saves (mHC, the blocks of attention rows, compressors, the learning indexer, MTP),
and `dstrain plan` plans the presets and a config.json folder in every layout V4 trains with, the stored base
of its release included. The peak against a measured run: test_measure.py."""

from __future__ import annotations

import json

import pytest
import torch

from dstrain.memory.estimate import STORED, Workload, estimate, rank_layers
from dstrain.model import build_model, family_of, get_config, param_counts
from dstrain.parallel import ParallelDims
from tests.helpers.saved import saved_bytes
from tests.helpers.tiny import tiny_v4_config
from tests.memory.test_planner import plan


def workload(cfg, **kw) -> Workload:  # noqa: ANN001
    base = dict(stage=1, precision="bf16", micro_batch=2, seq_len=128, device="cuda")
    return Workload(cfg, ParallelDims(kw.pop("world", 1), ep=kw.pop("ep", 1)), **{**base, **kw})


@pytest.mark.parametrize("name", ["tiny-v4", "deepseek-v4-flash", "deepseek-v4-pro"])
def test_parameters_are_the_models_own_count(name):
    cfg = get_config(name)
    assert sum(x.params for x in rank_layers(workload(cfg))[0]) == param_counts(cfg)["total"]
    ep = rank_layers(workload(cfg, world=8, ep=8))[0]
    assert sum(x.experts for x in ep) * 8 == sum(x.experts for x in rank_layers(workload(cfg))[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["none", "mhc", "full"])
def test_activations_are_what_autograd_saves(dtype, mode, monkeypatch):
    """Unique storages the forward saves for backward (parameters apart) against the estimate's activations
    on the CPU (blocks of 64 query rows; 128 tokens: 32 CSA entries, a window of 32), the indexer learning:
    within 5%."""
    import dstrain.memory.shapes as shapes_mod
    from dstrain.model.common import kernels

    monkeypatch.setattr(kernels, "CPU_NATIVE_BF16", True)
    monkeypatch.setattr(shapes_mod, "CPU_NATIVE_BF16", True)
    cfg = tiny_v4_config(hidden_size=64, head_dim=32, num_attention_heads=4, hc_mult=4, sliding_window=32,
                         index_topk=8, vocab_size=512)  # fmt: skip
    b, t = 2, 128
    model = build_model(cfg, dtype=dtype, seed=0)
    model.set_activation_checkpointing(mode)
    model.set_sparse_attention("sparse")
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(0))
    saved = saved_bytes(model, ids)
    precision = "fp32" if dtype == torch.float32 else "bf16"
    w = workload(cfg, precision=precision, micro_batch=b, seq_len=t, checkpointing=mode, device="cpu",
                 dsa_stage="sparse")  # fmt: skip
    predicted = sum(x.saved for x in rank_layers(w)[0])
    assert predicted == pytest.approx(saved, rel=0.05)


GPUS = ["--num_gpus", "8", "--gpu_memory_gb", "141", "--seq_len", "4096", "--micro_batch_size", "1"]


@pytest.mark.parametrize(
    "flags",
    [
        ["--config", "zero3", "--activation_checkpointing", "full"],
        ["--config", "zero2", "--ep", "8", "--activation_checkpointing", "mhc"],
        ["--config", "zero1", "--pp", "2", "--ep", "4", "--gradient_accumulation_steps", "4", "--activation_checkpointing"],
        ["--config", "zero1", "--sp", "2", "--ep", "4", "--activation_checkpointing", "full"],
    ],
)  # fmt: skip
def test_v4_flash_lora_plans_its_stored_release_as_a_folder_would(capsys, tmp_path, flags):
    """The deepseek-v4-flash preset under LoRA is planned on its release's stored base (FP8 projections, FP4
    experts), as is a folder of its config.json with the release's quantization keys."""
    cfg = get_config("deepseek-v4-flash")
    family_of(cfg).write_config(cfg, tmp_path, torch.bfloat16, None)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(family_of(cfg).release_quantization["deepseek-v4-flash"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    for model in ("deepseek-v4-flash", str(tmp_path)):
        code, lines, err = plan(capsys, "--model", model, "--lora_r", "16", *GPUS, *flags)
        assert code == 0, err
        text = "\n".join(lines)
        assert "FP4 e2m1 1x32, e8m0 scales (experts)" in text and STORED in text
        assert lines[-1].startswith(("fits: predicted peak", "does not fit: predicted peak"))


def test_checkpointing_and_lora_shrink_a_v4_flash_rank():
    """Full checkpointing keeps one (B, T, hc_mult, D) stream tensor per block; 'mhc' only drops the mHC
    weights' fp32 copies; a stored base holds the routed experts in FP4 bytes, not bf16 parameters."""
    cfg = get_config("deepseek-v4-flash")
    peaks = {m: estimate(workload(cfg, world=8, ep=8, stage=2, seq_len=4096, checkpointing=m)).peak
             for m in ("none", "mhc", "full")}  # fmt: skip
    assert peaks["full"] < peaks["mhc"] < peaks["none"]
    blocks = [
        x for x in rank_layers(workload(cfg, seq_len=4096, checkpointing="full"))[0] if "block" in x.name
    ]
    assert all(x.saved == 4096 * 2 * cfg.hc_mult * cfg.hidden_size * 2 for x in blocks)
