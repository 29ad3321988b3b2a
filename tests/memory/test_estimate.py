"""The memory estimate as a pure function (no process group, nothing trained): its parameters are the model's
real counts, its activations are what autograd saves, and each layout changes the terms it should."""

from __future__ import annotations

import pytest
import torch

from dstrain.memory.estimate import ACTS, GATHERED, PARAMS, STATES, Workload, estimate, rank_layers
from dstrain.model import ModelConfig, build_model, get_config, param_counts
from dstrain.parallel import ParallelDims
from tests.helpers.saved import saved_bytes
from tests.helpers.tiny import tiny_config
from tests.model.deepseek_v3.test_config import GLM_5, MOONLIGHT

SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
             num_experts_per_tok=2, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32)  # fmt: skip


DSA_SHAPE = dict(model_type="deepseek_v32", index_topk=16, index_n_heads=4, index_head_dim=16)


def workload(cfg=None, world: int = 1, **kw) -> Workload:  # noqa: ANN001
    dims = ParallelDims(world, **{k: kw.pop(k) for k in ("pp", "tp", "ep") if k in kw})
    base = dict(stage=1, precision="bf16", micro_batch=2, seq_len=128, device="cuda")
    return Workload(cfg or tiny_config(**SMALL), dims, **{**base, **kw})


@pytest.mark.parametrize("name", ["tiny", "small", "deepseek-v2-lite", "deepseek-v3", "moonlight", "glm-5"])
def test_parameters_are_the_models_own_count(name):
    configs = {"moonlight": MOONLIGHT, "glm-5": GLM_5}
    cfg = ModelConfig.from_hf_dict(configs[name]) if name in configs else get_config(name)
    layers = rank_layers(workload(cfg))[0]
    assert sum(x.params for x in layers) == param_counts(cfg)["total"]


def test_expert_and_tensor_parallel_shares_add_up():
    cfg = tiny_config(**SMALL)
    whole = rank_layers(workload(cfg))[0]
    ep = rank_layers(workload(cfg, world=4, ep=4))[0]
    assert sum(x.experts for x in ep) * 4 == sum(x.experts for x in whole)
    tp = rank_layers(workload(cfg, world=2, tp=2))[0]
    assert sum(x.experts for x in tp) == sum(x.experts for x in whole)  # routed experts stay whole
    assert sum(x.dense for x in tp) < sum(x.dense for x in whole)


def test_pipeline_stages_hold_every_layer_once():
    cfg = tiny_config(**SMALL, num_hidden_layers=4)
    stages = rank_layers(workload(cfg, world=2, pp=2))
    assert len(stages) == 2 and all(stages)
    assert sum(x.params for s in stages for x in s) == param_counts(cfg)["total"]
    assert stages[0][0].name == "embedding" and stages[1][-1].name == "MTP 1 loss"
    per_rank = estimate(workload(cfg, world=2, pp=2)).per_rank
    assert per_rank[0] != per_rank[1]


def test_zero3_divides_parameters_and_states_by_data_parallel_size():
    cfg = tiny_config(**SMALL)
    one = estimate(workload(cfg, world=8, stage=1)).terms
    three = estimate(workload(cfg, world=8, stage=3, zero={"stage3_param_persistence_threshold": 0})).terms
    total = param_counts(cfg)["total"]
    assert one[PARAMS] == total * 2  # ZeRO-1: whole bf16 weights on every rank
    assert three[PARAMS] == pytest.approx(total * 2 / 8, rel=1e-6)
    assert three[STATES] == one[STATES] == pytest.approx(total * 12 / 8, rel=1e-6)  # fp32 master + moments
    assert GATHERED in estimate(workload(cfg, world=8, stage=3)).terms


def test_offloading_moves_optimizer_states_to_the_host():
    cfg = tiny_config(**SMALL)
    est = estimate(workload(cfg, world=2, stage=2, zero={"offload_optimizer": {"device": "cpu"}}))
    assert STATES not in est.terms and est.host == pytest.approx(
        param_counts(cfg)["total"] * 12 / 2, rel=1e-6
    )


def test_checkpointing_lowers_activations_and_the_peak():
    cfg = tiny_config(**SMALL, num_hidden_layers=4)

    def saved(mode: str) -> int:
        return sum(x.saved for x in rank_layers(workload(cfg, checkpointing=mode, seq_len=512))[0])

    assert saved("full") < saved("mlp") < saved("none") and saved("full") < saved("attention") < saved("none")
    peaks = [estimate(workload(cfg, checkpointing=m, seq_len=512)).peak for m in ("none", "full")]
    assert peaks[1] < peaks[0]
    assert (
        estimate(workload(cfg, seq_len=1024)).terms[ACTS] > estimate(workload(cfg, seq_len=512)).terms[ACTS]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["none", "full", "attention", "mlp"])
@pytest.mark.parametrize("shape", [{}, {"q_lora_rank": None, "n_shared_experts": 2}, DSA_SHAPE])
def test_activations_are_what_autograd_saves(dtype, mode, shape, monkeypatch):
    """Every tensor the model's forward saves for backward (unique storages, parameters apart), counted by a
    saved-tensors hook, against the estimate's activations on the CPU: within 2% (sparse attention: the
    sparse stage, rows longer than the top-k). bf16 on the native kernel path, forced on any CPU: the one the
    estimate models (GPUs, bf16 CPUs; the emulated path's fp32 copies are not modelled, see estimate.py)."""
    import dstrain.memory.shapes as shapes_mod
    from dstrain.model.common import kernels

    monkeypatch.setattr(kernels, "CPU_NATIVE_BF16", True)
    monkeypatch.setattr(shapes_mod, "CPU_NATIVE_BF16", True)
    cfg = tiny_config(**{**SMALL, **shape, "num_hidden_layers": 3, "vocab_size": 1024})
    b, t = 2, 64
    model = build_model(cfg, dtype=dtype, seed=0)
    model.set_activation_checkpointing(mode)
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(0))
    saved = saved_bytes(model, ids)
    precision = "fp32" if dtype == torch.float32 else "bf16"
    w = workload(cfg, precision=precision, micro_batch=b, seq_len=t, checkpointing=mode, device="cpu")
    predicted = sum(x.saved for x in rank_layers(w)[0])
    assert predicted == pytest.approx(saved, rel=0.02)


def test_train_warns_in_one_line_when_the_peak_exceeds_the_device():
    from dstrain.config.options import parse_options
    from dstrain.config.plan import prepare
    from dstrain.memory.estimate import device_warning

    plan = prepare(parse_options(["--seq_len", "64"]), 1)  # the tiny preset, as `dstrain train` runs it
    assert device_warning(plan, torch.device("cpu"), 1) is None
    line = device_warning(plan, torch.device("cpu"), 10**7)  # this machine's memory shared by 10M ranks
    assert line.startswith("dstrain: warning: predicted peak memory") and "\n" not in line
    assert "dstrain plan" in line


def test_accumulation_keeps_the_earlier_micro_batches_gradients():
    cfg = tiny_config(**SMALL)
    for stage in (1, 2):
        one, four = (estimate(workload(cfg, world=2, stage=stage, grad_accum=ga)) for ga in (1, 4))
        assert four.peak > one.peak, stage


@pytest.mark.parametrize(
    "flags", [["--lora_r", "8"], ["--lora_r", "8", "--lora_targets", "experts,o_proj", "--train_mtp"]]
)
def test_lora_trains_only_its_share(flags):
    """A LoRA run's gradients and optimizer states are those of what trains (the share finetune marks
    trainable on a real model), not the full fine-tune's; the frozen weights are held all the same."""
    from dstrain.config.options import parse_options
    from dstrain.config.plan import prepare
    from dstrain.training.finetune import apply_finetune_options

    opts = parse_options(["--config", "zero2", *flags])
    plan = prepare(opts, 1, device_type="cuda", model=tiny_config(**SMALL))
    model = build_model(plan.model, seed=0)
    apply_finetune_options(model, opts.lora, seed=0)
    share = sum(p.numel() for p in model.parameters() if p.requires_grad) / sum(
        p.numel() for p in model.parameters()
    )
    lora = Workload.of(plan)
    assert lora.trainable == pytest.approx(share, rel=1e-12) and 0 < share < 0.5
    full, tuned = estimate(lora.replace(trainable=1.0)), estimate(lora)
    assert tuned.terms[PARAMS] == full.terms[PARAMS]
    assert tuned.terms[STATES] == pytest.approx(full.terms[STATES] * share, abs=1)  # terms are whole bytes
    assert tuned.peak < full.peak


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_a_64k_row_of_a_v32_layer_grows_linearly_and_fits_one_gpu(stage):
    """DeepSeek-V3.2's sparse attention on a GPU (the Triton kernels: no (T, T) tensor, blocks of at most
    SCORE_ELEMENTS scores): one layer's saved activations and its forward's temporaries double with the row,
    and a 64K-token row of one layer (bf16, its 128 heads on one GPU) fits 80 GB with room for the rest."""

    def layer(t: int) -> int:
        w = workload(get_config("deepseek-v3.2"), micro_batch=1, seq_len=t, dsa_stage=stage)
        block = next(x for x in rank_layers(w)[0] if x.name == "block 0")
        return block.saved + block.forward

    a16, a32, a64 = (layer(t) for t in (16384, 32768, 65536))
    assert 1.95 <= a64 / a32 <= 2.05 and 1.95 <= a32 / a16 <= 2.05
    assert a64 < 50 * 2**30
