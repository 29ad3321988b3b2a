"""The memory estimate of Kimi Linear (dstrain/memory/kimi_linear.py): its parameters are the model's own count,
a KDA layer's activations what autograd saves (the chunked delta rule's pairwise decays and broadcast products,
its per-chunk states, the convolutions, the gates and the gated norm), and `dstrain plan` plans the presets in
every layout Kimi Linear trains with. The peak against a measured run: test_measure.py."""

from __future__ import annotations

import json

import pytest
import torch

from dstrain.memory.estimate import Workload, estimate, rank_layers, shapes_of
from dstrain.model import build_model, get_config, param_counts
from dstrain.parallel import ParallelDims
from tests.helpers.saved import saved_bytes
from tests.memory.test_planner import plan


def workload(cfg, **kw) -> Workload:  # noqa: ANN001
    base = dict(stage=1, precision="bf16", micro_batch=2, seq_len=128, device="cuda")
    dims = ParallelDims(kw.pop("world", 1), tp=kw.pop("tp", 1), ep=kw.pop("ep", 1), sp=kw.pop("sp", 1))
    return Workload(cfg, dims, **{**base, **kw})


@pytest.mark.parametrize("name", ["tiny-kimi-linear", "kimi-linear-48b-a3b"])
def test_parameters_are_the_models_own_count(name):
    cfg = get_config(name)
    assert sum(x.params for x in rank_layers(workload(cfg))[0]) == param_counts(cfg)["total"]
    ep = rank_layers(workload(cfg, world=8, ep=8))[0]
    assert sum(x.experts for x in ep) * 8 == sum(x.experts for x in rank_layers(workload(cfg))[0])


def test_tensor_parallelism_keeps_whole_kda_heads():
    """A rank's KDA tensors under --tp 2 are the model's own, split as parallel/tp.py splits them."""
    cfg = get_config("tiny-kimi-linear")
    model = build_model(cfg.replace(vocab_size=256), dtype=torch.float32, seed=0)
    kda = model.layers[0].self_attn
    tp = shapes_of(workload(cfg, world=2, tp=2))
    kept = {"f_a_proj", "g_a_proj", "o_norm"}  # replicated
    own = [p.numel() // (1 if name.split(".")[0] in kept else 2) for name, p in kda.named_parameters()]
    assert sorted(tp.kda_tensors()[0]) == sorted(own)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["none", "full"])
def test_activations_are_what_autograd_saves(dtype, mode, monkeypatch):
    """Unique storages the forward saves for backward (parameters apart) against the estimate's activations on
    the CPU (tiny-kimi-linear with 3 KDA heads of 32 and hidden 80; 2 x 128 tokens: 8 chunks of 16): within
    5% (0.1-0.4% when written)."""
    import dstrain.memory.shapes as shapes_mod
    from dstrain.model.common import kernels

    monkeypatch.setattr(kernels, "CPU_NATIVE_BF16", True)
    monkeypatch.setattr(shapes_mod, "CPU_NATIVE_BF16", True)
    cfg = get_config("tiny-kimi-linear").replace(
        vocab_size=512, hidden_size=80, linear_head_dim=32, linear_num_heads=3
    )
    b, t = 2, 128
    model = build_model(cfg, dtype=dtype, seed=0)
    model.set_activation_checkpointing(mode)
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(0))
    saved = saved_bytes(model, ids)
    precision = "fp32" if dtype == torch.float32 else "bf16"
    w = workload(cfg, precision=precision, micro_batch=b, seq_len=t, checkpointing=mode, device="cpu")
    predicted = sum(x.saved for x in rank_layers(w)[0])
    assert predicted == pytest.approx(saved, rel=0.05)


def test_sequence_and_tensor_parallelism_divide_the_kda_core():
    """Ulysses runs the chunked rule over whole rows for heads / sp, tensor parallelism on heads / tp: a KDA
    block's activations per rank halve either way (to the convolutions' K - 1 extra steps and the replicated
    low-rank gate inputs); full checkpointing keeps a block's input."""
    cfg = get_config("kimi-linear-48b-a3b")
    kda = [i for i in range(cfg.num_hidden_layers) if cfg.is_kda_layer(i) and cfg.is_moe_layer(i)][0]

    def saved(**kw) -> int:  # noqa: ANN003
        return rank_layers(workload(cfg, seq_len=4096, **kw))[0][1 + kda].saved

    one = saved()
    assert saved(world=2, sp=2) == pytest.approx(one / 2, rel=0.01)
    assert saved(world=2, tp=2) == pytest.approx(one / 2, rel=0.1)
    assert saved(checkpointing="full") == 2 * 4096 * cfg.hidden_size * 2


GPUS = ["--num_gpus", "8", "--gpu_memory_gb", "80", "--seq_len", "4096", "--micro_batch_size", "1"]


@pytest.mark.parametrize(
    "flags",
    [
        ["--config", "zero0", "--precision", "fp32"],
        ["--config", "zero1", "--ep", "8", "--activation_checkpointing", "full"],
        ["--config", "zero2", "--tp", "2", "--ep", "4"],
        ["--config", "zero3", "--activation_checkpointing", "full"],
        ["--config", "zero1", "--pp", "2", "--ep", "4", "--gradient_accumulation_steps", "4"],
        ["--config", "zero2", "--sp", "2", "--ep", "4", "--activation_checkpointing", "full"],
        ["--config", "zero3", "--lora_r", "16"],
    ],
)
@pytest.mark.parametrize("model", ["kimi-linear-48b-a3b", "tiny-kimi-linear"])
def test_plan_plans_kimi_linear_in_every_layout(capsys, tmp_path, model, flags):
    if flags[1] == "zero0":  # no shipped config: a file of ZeRO stage 0
        flags = [flags[0], str(tmp_path / "zero0.json"), *flags[2:]]
        (tmp_path / "zero0.json").write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    code, lines, err = plan(capsys, "--model", model, *GPUS, *flags)
    assert code == 0, err
    assert lines[-1].startswith(("fits: predicted peak", "does not fit: predicted peak"))


def test_checkpointing_shrinks_a_48b_rank():
    """Without checkpointing every KDA layer keeps 3 x CHUNK x q's fp32 size (the pairwise decays and the
    einsums' products): full checkpointing keeps one (B, T, D) input per block."""
    cfg = get_config("kimi-linear-48b-a3b")
    peaks = {m: estimate(workload(cfg, world=8, stage=3, seq_len=4096, micro_batch=1, checkpointing=m)).peak
             for m in ("none", "full")}  # fmt: skip
    assert peaks["full"] < peaks["none"] / 1.5
