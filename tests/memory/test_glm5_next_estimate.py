"""The memory estimate of GLM-5.3-Flash (dstrain/memory/glm5_next.py): its parameters are the model's own count,
its activations what autograd saves (mHC, KDA with the bounded gate, the DSA layers' NoPE MLA, selected keys
and learning k-pool indexer, the clamped SwiGLUs, MTP), and `dstrain plan` plans the presets in every layout
GLM-5.3-Flash trains with. The peak against a measured run: test_measure.py."""

from __future__ import annotations

import json

import pytest
import torch

from dstrain.memory.estimate import ACTS, Workload, estimate, rank_layers, shapes_of
from dstrain.model import build_model, get_config, param_counts
from dstrain.parallel import ParallelDims
from tests.helpers.saved import saved_bytes
from tests.memory.test_planner import plan


def workload(cfg, **kw) -> Workload:  # noqa: ANN001
    base = dict(stage=1, precision="bf16", micro_batch=2, seq_len=128, device="cuda")
    dims = ParallelDims(kw.pop("world", 1), tp=kw.pop("tp", 1), ep=kw.pop("ep", 1))
    return Workload(cfg, dims, **{**base, **kw})


@pytest.mark.parametrize("name", ["tiny-glm5-next", "glm-5.3-flash"])
def test_parameters_are_the_models_own_count(name):
    cfg = get_config(name)
    assert sum(x.params for x in rank_layers(workload(cfg))[0]) == param_counts(cfg)["total"]
    ep = rank_layers(workload(cfg, world=8, ep=8))[0]
    assert sum(x.experts for x in ep) * 8 == sum(x.experts for x in rank_layers(workload(cfg))[0])


def test_tensor_parallelism_splits_the_kda_and_mla_heads():
    """A rank's KDA and MLA tensors under --tp 2 are the model's own, split as parallel/tp.py splits them: whole
    heads, the low-rank gate inputs, the gated norm and the query / key-value latents replicated."""
    cfg = get_config("tiny-glm5-next")
    model = build_model(cfg.replace(vocab_size=256), dtype=torch.float32, seed=0)
    tp = shapes_of(workload(cfg, world=2, tp=2))
    kept = {
        "f_a_proj",
        "g_a_proj",
        "o_norm",
        "q_a_proj",
        "q_a_layernorm",
        "kv_a_proj_with_mqa",
        "kv_a_layernorm",
    }
    for layer, own in ((0, tp.kda_tensors()[0]), (1, tp.attention_tensors())):
        attn = model.layers[layer].self_attn
        split = [p.numel() // (1 if name.split(".")[0] in kept else 2) for name, p in attn.named_parameters()
                 if not name.startswith("indexer.")]  # fmt: skip
        assert sorted(own) == sorted(split)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["none", "full"])
def test_activations_are_what_autograd_saves(dtype, mode, monkeypatch):
    """Unique storages the forward saves for backward (parameters apart) against the estimate's activations on
    the CPU (tiny-glm5-next: KDA + dense, DSA full + MoE, DSA shared + MoE, KDA + MoE, MTP; 2 x 128 tokens, 35
    of 128 keys selected), the indexer learning sparsely: within 5% (0.0-0.3% when written). The parameters as
    DeepSpeed's bf16 engine casts them (KDA's convolutions in bf16, not the fp32 build_model keeps)."""
    import dstrain.memory.shapes as shapes_mod
    from dstrain.model.common import kernels

    monkeypatch.setattr(kernels, "CPU_NATIVE_BF16", True)
    monkeypatch.setattr(shapes_mod, "CPU_NATIVE_BF16", True)
    cfg = get_config("tiny-glm5-next").replace(vocab_size=512)
    b, t = 2, 128
    model = build_model(cfg, dtype=dtype, seed=0).to(dtype)
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
        ["--config", "zero0", "--precision", "fp32"],
        ["--config", "zero1", "--ep", "8", "--activation_checkpointing", "full"],
        ["--config", "zero2", "--tp", "2", "--ep", "4"],
        ["--config", "zero3", "--activation_checkpointing", "full"],
        ["--config", "zero3", "--lora_r", "16"],
    ],
)
@pytest.mark.parametrize("model", ["glm-5.3-flash", "tiny-glm5-next"])
def test_plan_plans_glm5_next_in_every_layout(capsys, tmp_path, model, flags):
    if flags[1] == "zero0":  # no shipped config: a file of ZeRO stage 0
        flags = [flags[0], str(tmp_path / "zero0.json"), *flags[2:]]
        (tmp_path / "zero0.json").write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    code, lines, err = plan(capsys, "--model", model, *GPUS, *flags)
    assert code == 0, err
    assert lines[-1].startswith(("fits: predicted peak", "does not fit: predicted peak"))


def test_checkpointing_keeps_a_blocks_streams():
    """Full checkpointing keeps one (B, T, hc_mult, D) stream tensor per block: a rank's activations shrink
    ~80x (without it every KDA layer keeps its chunked rule's fp32 pairwise decays)."""
    cfg = get_config("glm-5.3-flash")
    acts = {}
    for mode in ("none", "full"):
        w = workload(cfg, world=8, stage=3, seq_len=4096, micro_batch=1, checkpointing=mode)
        acts[mode] = estimate(w).terms[ACTS]
        blocks = [x for x in rank_layers(w)[0] if x.name.startswith("block")]
        assert mode == "none" or all(x.saved == 4096 * cfg.hc_mult * cfg.hidden_size * 2 for x in blocks)
    assert acts["full"] < acts["none"] / 50
