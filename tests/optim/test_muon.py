"""Muon (dstrain/optim): Newton-Schulz, the per-expert and per-head blocks, the step on a ZeRO slice, which
parameter each optimizer steps, and the DeepSpeed file's Muon section read with DeepSpeed's meaning. Every
layout against one process: tests/parallel/test_layouts.py::test_muon_layouts_match_one_process."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dstrain.config.options import parse_options
from dstrain.config.plan import prepare
from dstrain.errors import CheckpointError, ConfigError
from dstrain.optim import ADAMW_STATE, MUON_STATE, state_keys
from dstrain.optim.groups import MuonSettings, classify, param_groups, table_text
from dstrain.optim.muon import MuonAdamW, newton_schulz, orthogonal_update, update_scale
from tests.helpers.muon import ns5
from tests.helpers.tiny import tiny_config
from tests.helpers.trainer import make_options

SETTINGS = MuonSettings(
    lr=0.01, momentum=0.95, nesterov=True, ns_steps=5, scale="rms", per_head=False, adapters=True
)


@pytest.mark.parametrize("shape", [(3, 8, 24), (2, 24, 8), (1, 16, 16)])
def test_newton_schulz_orthogonalises_each_matrix(shape):
    """Every singular value of NS5(G) lands in the quintic's band around 1 (about 0.68-1.13), tall or wide."""
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(newton_schulz(g).double())
    assert float(s.min()) > 0.6 and float(s.max()) < 1.25, s


def test_expert_tensor_update_is_newton_schulz_per_expert_and_half():
    """One step of a fused expert tensor (E, 2I, D) from zero momentum: each expert's gate rows and up rows
    get NS5 of their own slice (the test's per-matrix reference), scaled by 0.2 sqrt(max(I, D)); down_proj
    (E, D, I) per expert."""
    g = torch.Generator().manual_seed(1)
    for name, shape, split in (
        ("gate_up_proj", (3, 16, 12), "experts_gate_up"),
        ("down_proj", (3, 12, 8), "experts"),
    ):
        w = torch.randn(*shape, generator=g)
        p = torch.nn.Parameter(w.clone())
        p.grad = torch.randn(*shape, generator=g)
        group = {"params": [p], "param": name, "muon": split, "shape": list(shape), "lr": 0.1,
                 "weight_decay": 0.0, "momentum": 0.9, "nesterov": False, "ns_steps": 5, "scale": "rms"}  # fmt: skip
        MuonAdamW([group], lr=0.1).step()
        for e in range(shape[0]):
            halves = (
                [(0, shape[1] // 2), (shape[1] // 2, shape[1])]
                if split == "experts_gate_up"
                else [(0, shape[1])]
            )
            for a, b in halves:
                d = p.grad[e, a:b]
                want = w[e, a:b] - 0.1 * 0.2 * math.sqrt(max(d.shape)) * ns5(d)
                torch.testing.assert_close(p.data[e, a:b], want, rtol=0, atol=2e-6)


def test_per_head_blocks_and_the_two_scales():
    """`heads:H` orthogonalises each head's rows alone; the update of a whole matrix is not per-head."""
    u = torch.randn(4 * 6, 10, generator=torch.Generator().manual_seed(2))
    per_head = orthogonal_update(u, "heads:4", 5, "rms")
    for h in range(4):
        rows = u[h * 6 : (h + 1) * 6]
        torch.testing.assert_close(
            per_head[h * 6 : (h + 1) * 6], 0.2 * math.sqrt(10) * ns5(rows), rtol=0, atol=2e-6
        )
    assert not torch.allclose(per_head, orthogonal_update(u, "matrix", 5, "rms"), atol=1e-3)
    assert update_scale(24, 10, "rms") == pytest.approx(0.2 * math.sqrt(24))
    assert update_scale(24, 10, "spectral") == pytest.approx(math.sqrt(2.4))
    assert update_scale(10, 24, "spectral") == 1.0


def test_a_zero_slice_steps_like_the_whole_matrix():
    """What ZeRO hands the step, a flat slice padded past the tensor's end (one rank: the whole flat tensor),
    gets the whole matrix's update, and its padding stays 0."""
    g = torch.Generator().manual_seed(3)
    w, grad = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    whole = torch.nn.Parameter(w.clone())
    flat = torch.nn.Parameter(torch.cat([w.flatten(), torch.zeros(2)]))
    whole.grad, flat.grad = grad.clone(), torch.cat([grad.flatten(), torch.zeros(2)])
    base = {"param": "x", "muon": "matrix", "shape": [6, 5], "lr": 0.05, "weight_decay": 0.1, "momentum": 0.95,
            "nesterov": True, "ns_steps": 5, "scale": "rms"}  # fmt: skip
    a, b = MuonAdamW([{**base, "params": [whole]}], lr=0.05), MuonAdamW([{**base, "params": [flat]}], lr=0.05)
    for _ in range(3):
        a.step(), b.step()
    torch.testing.assert_close(flat.data[:30].view(6, 5), whole.data, rtol=0, atol=1e-7)
    assert flat.data[30:].abs().max() == 0
    assert set(b.state[flat]) == {"momentum_buffer", "step"} and float(b.state[flat]["step"]) == 3


def _tiny_model(lora: bool = False):
    from dstrain.model import build_model
    from dstrain.training.finetune import apply_finetune_options

    model = build_model(tiny_config())
    if lora:
        opts = make_options(["--lora_r", "2", "--lora_targets", "q_b_proj,experts,gate"])
        apply_finetune_options(model, opts.lora, 0)
    return model


def test_which_optimizer_steps_each_parameter():
    """Embedding and head (MTP shares it): AdamW; vectors: AdamW without decay; hidden matrices, the router and
    MTP's eh_proj: Muon; fused experts per expert (gate_up by halves); with per_head, MLA's up-projections by
    head; LoRA factors Muon's unless adapters=False. Each parameter is tagged with the state it will have."""
    model = _tiny_model()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    got = {a.name: (a.optimizer, a.split, a.decay) for a in classify(named, tiny_config(), SETTINGS)}
    assert got["embed_tokens.weight"] == ("adamw", None, True) and got["lm_head.weight"] == (
        "adamw",
        None,
        True,
    )
    assert got["norm.weight"] == ("adamw", None, False)
    assert got["layers.1.mlp.gate.weight"] == ("muon", "matrix", True)
    assert got["mtp.0.eh_proj.weight"] == ("muon", "matrix", True)
    assert got["layers.1.mlp.experts.gate_up_proj"][1] == "experts_gate_up"
    assert got["layers.1.mlp.experts.down_proj"][1] == "experts"
    per_head = MuonSettings(**{**SETTINGS.__dict__, "per_head": True})
    heads = {a.name: a.split for a in classify(named, tiny_config(), per_head)}
    assert (
        heads["layers.0.self_attn.q_b_proj.weight"]
        == "heads:2"
        == heads["layers.0.self_attn.kv_b_proj.weight"]
    )
    assert heads["layers.0.self_attn.o_proj.weight"] == "matrix"
    assert {a.optimizer for a in classify(named, tiny_config(), None)} == {"adamw"}
    groups, table = param_groups(named, tiny_config(), 0.1, SETTINGS)
    assert sum(len(g["params"]) for g in groups) == len(named)
    assert all(len(g["params"]) == 1 for g in groups if g.get("muon"))
    params = dict(named)
    assert state_keys(params["layers.1.mlp.experts.down_proj"]) == MUON_STATE
    assert state_keys(params["norm.weight"]) == ADAMW_STATE
    text = table_text(table)
    assert "layers.*.mlp.experts.gate_up_proj" in text and "muon, per expert, gate | up" in text
    lora = [(n, p) for n, p in _tiny_model(lora=True).named_parameters() if p.requires_grad]
    on = {a.name: a.split for a in classify(lora, tiny_config(), SETTINGS)}
    assert on["layers.1.mlp.experts.gate_lora_A"] == "experts" and on["layers.1.mlp.gate.lora_B"] == "matrix"
    off = MuonSettings(**{**SETTINGS.__dict__, "adapters": False})
    assert {a.optimizer for a in classify(lora, tiny_config(), off)} == {"adamw"}


def test_deepseek_v4_parameters():
    """DeepSeek-V4: the grouped output projection by its o_groups blocks (block-diagonal), the indexer's
    queries by index head under per_head, the compressors' position biases and the mHC vectors on AdamW, the
    mHC projections on Muon; the hash table is a buffer, in no group."""
    from dstrain.model import build_model
    from tests.helpers.tiny import tiny_v4_config

    cfg = tiny_v4_config()
    model = build_model(cfg)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    per_head = MuonSettings(**{**SETTINGS.__dict__, "per_head": True})
    got = {a.name: (a.optimizer, a.split) for a in classify(named, cfg, per_head)}
    assert got["layers.0.self_attn.o_a_proj.weight"] == ("muon", f"heads:{cfg.o_groups}")
    assert got["layers.0.self_attn.compressor.indexer.q_b_proj.weight"] == ("muon", "heads:8")
    assert got["layers.0.self_attn.compressor.position_bias"] == ("adamw", None)
    assert got["layers.0.attn_hc.fn"] == ("muon", "matrix") and got["layers.0.attn_hc.base"] == (
        "adamw",
        None,
    )
    assert got["hc_head.hc_scale"] == ("adamw", None)
    assert not any("tid2eid" in name for name in got)


def _plan(flags: str, tmp_path=None, config: dict | None = None, world: int = 2):  # noqa: ANN001, ANN202
    extra = []
    if config is not None:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(config))
        extra = ["--config", str(path)]
    return prepare(parse_options([*extra, *flags.split()]), world, model=tiny_config())


def test_the_resolved_file_records_muon_in_deepspeeds_terms(tmp_path):
    """--optimizer muon: the resolved section is DeepSpeed's Muon (given back as --config, it runs the same),
    AdamW's own "auto" keys of a shared file dropped; a client optimizer under ZeRO is allowed."""
    plan = _plan("--optimizer muon --lr 1e-3 --muon_lr 2e-2 --muon_momentum 0.9 --muon_per_head")
    opt = plan.ds["optimizer"]
    assert opt["type"] == "Muon" and plan.ds["zero_allow_untested_optimizer"] is True
    p = opt["params"]
    assert (p["lr"], p["adam_lr"], p["muon_lr"], p["momentum"], p["per_head_muon"]) == (
        1e-3,
        1e-3,
        2e-2,
        0.9,
        True,
    )
    assert "torch_adam" not in p
    again = _plan("", tmp_path, {"optimizer": opt})
    t = again.opts.optimizer
    assert (t.optimizer, t.muon_lr, t.muon_momentum, t.muon_per_head, again.opts.schedule.lr) == (
        "muon", 2e-2, 0.9, True, 1e-3)  # fmt: skip


def test_a_deepspeed_muon_file_is_read_with_deepspeeds_meaning(tmp_path):
    """type Muon: Keller Jordan's / DeepSpeed's update scale; lr is both halves' unless adam_lr / muon_lr."""
    plan = _plan(
        "",
        tmp_path,
        {"optimizer": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 3e-4, "momentum": 0.9}}},
    )
    t = plan.opts.optimizer
    assert (t.optimizer, t.muon_scale, t.muon_lr, t.muon_momentum) == ("muon", "spectral", 0.02, 0.9)
    assert plan.opts.schedule.lr == 3e-4
    shared = _plan("", tmp_path, {"optimizer": {"type": "Muon", "params": {"lr": 0.02}}})
    assert (shared.opts.schedule.lr, shared.opts.optimizer.muon_lr) == (0.02, 0.02)
    assert (
        _plan("--muon_scale rms", tmp_path, {"optimizer": {"type": "Muon"}}).opts.optimizer.muon_scale
        == "rms"
    )


@pytest.mark.parametrize(
    ("flags", "config", "message"),
    [
        ("--optimizer muon --tp 2", None, r"^--optimizer muon with --tp 2: Newton-Schulz needs each whole matrix"),
        ("--optimizer muon", {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
         r"^--optimizer muon with zero_optimization.offload_optimizer"),
        ("--optimizer muon", {"optimizer": {"type": "AdamW"}}, r"^ds_config optimizer.type=AdamW conflicts with --optimizer muon$"),
        ("--optimizer muon", {"optimizer": {"type": "Muon", "params": {"nesterov": True}}}, r"optimizer.params.nesterov: unknown key"),
        ("--optimizer muon --lr 1e-3", {"optimizer": {"type": "Muon", "params": {"lr": 0.02}}},
         r"optimizer.params.lr=0.02 conflicts with --lr 0.001"),
        ("", {"optimizer": {"type": "Lion"}}, r"optimizer.type=Lion: dstrain trains with AdamW or Muon"),
        ("--optimizer muon --muon_momentum 1", None, r"--muon_momentum 1.0: must be in \[0, 1\)"),
    ],
)  # fmt: skip
def test_what_muon_cannot_run_is_refused_in_one_line(flags, config, message, tmp_path):
    with pytest.raises(ConfigError, match=message) as info:
        _plan(flags, tmp_path, config)
    assert "\n" not in str(info.value)


def test_resuming_with_another_optimizer_is_refused(tmp_path):
    from dstrain.checkpoint.store import STATE_DIR
    from dstrain.training.optimizer import check_resume

    state = tmp_path / STATE_DIR
    state.mkdir()
    (state / "rank_00000.json").write_text(json.dumps({"step": 3}))  # written before Muon existed: AdamW
    check_resume(tmp_path, "adamw")
    with pytest.raises(
        CheckpointError, match="trained with --optimizer adamw, this run has --optimizer muon"
    ):
        check_resume(tmp_path, "muon")


def test_plan_counts_one_muon_buffer_instead_of_two_moments():
    """The estimate's optimizer states: 4 bytes less per element Muon steps (measured equal per rank in
    test_layouts.py::test_muon_state_bytes_are_the_estimate)."""
    from dstrain.memory.estimate import STATES, Workload, estimate

    adamw = estimate(Workload.of(_plan("--config zero1"))).terms[STATES]
    muon = estimate(Workload.of(_plan("--config zero1 --optimizer muon"))).terms[STATES]
    assert muon < adamw
    assert adamw - muon == 4 * 32_256 // 2  # Muon's elements of the tiny model (its table), over 2 ranks


def test_plan_searches_only_the_layouts_muon_runs():
    """`dstrain plan`'s layout search under Muon: no tensor parallelism, no offloading (both refused)."""
    from dstrain.memory.estimate import Workload
    from dstrain.memory.planner import layouts

    w = Workload.of(_plan("--config zero1 --optimizer muon", world=4))
    found = list(layouts(w, 4, offload=False))
    assert found and all(dims.tp == 1 for _, dims, _ in found)
    assert any(dims.tp > 1 for _, dims, _ in layouts(w.replace(optimizer="adamw"), 4, offload=False))
    assert list(layouts(w, 4, offload=True)) == []
