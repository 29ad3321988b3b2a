"""LoRA as a module transform: adapters on exactly the named linears, routed experts and routers, one-line
refusals, exact merge."""

from __future__ import annotations

import pytest
import torch

from dstrain.model import build_model
from dstrain.model.common.lora import (
    EXPERT_ADAPTERS,
    LoRAExperts,
    LoRALinear,
    LoRARouter,
    apply_lora,
    is_lora_key,
    lora_modules,
    lora_state,
    merge_lora,
)
from tests.helpers.tiny import tiny_config

DEFAULT_TARGETS = ["q_b_proj", "kv_b_proj", "o_proj", "shared_experts"]


def randomize_adapters(model, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def expected_default(n_layers: int = 2, moe_from: int = 1) -> set[str]:
    blocks = [f"layers.{i}" for i in range(n_layers)] + ["mtp.0.block"]
    out = {f"{b}.self_attn.{p}" for b in blocks for p in ("q_b_proj", "kv_b_proj", "o_proj")}
    moe = [f"layers.{i}" for i in range(moe_from, n_layers)] + ["mtp.0.block"]
    out |= {f"{b}.mlp.shared_experts.{p}" for b in moe for p in ("gate_proj", "up_proj", "down_proj")}
    return out


def test_adapters_land_exactly_on_the_named_modules():
    model = build_model(tiny_config(), seed=0)
    names = apply_lora(model, 4, 8.0, DEFAULT_TARGETS)
    assert set(names) == expected_default() == set(lora_modules(model))
    assert not any(".experts" in n or n.endswith(".gate") for n in names)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.{p}" for n in names for p in ("lora_A", "lora_B")}
    assert set(lora_state(model)) == trainable
    # base weights keep their names: the state dict only gains the adapters
    plain = set(build_model(tiny_config(), seed=0).state_dict())
    assert set(model.state_dict()) == plain | trainable
    m = model.layers[1].mlp.shared_experts.gate_proj
    assert isinstance(m, LoRALinear) and torch.equal(m.lora_B, torch.zeros_like(m.lora_B))
    assert m.lora_A.shape == (4, 32) and m.lora_B.shape == (16, 4) and m.lora_A.abs().sum() > 0

    dense_and_shared = apply_lora(build_model(tiny_config(), seed=0), 4, 8.0, ["gate_proj"])
    assert set(dense_and_shared) == {
        "layers.0.mlp.gate_proj",
        "layers.1.mlp.shared_experts.gate_proj",
        "mtp.0.block.mlp.shared_experts.gate_proj",
    }


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (["nothing_here"], "matches no module"),
        (
            ["q_proj"],
            "did you mean 'q_b_proj'\\? its targets: down_proj, eh_proj, experts, gate, gate_proj, kv_a_",
        ),
        (["input_layernorm"], "'input_layernorm' \\(RMSNorm\\) cannot take LoRA"),
        (["embed_tokens"], "'embed_tokens' \\(Embedding\\) cannot take LoRA"),
    ],
)
def test_unadaptable_targets_are_one_line_errors(targets, message):
    with pytest.raises(ValueError, match=message) as info:
        apply_lora(build_model(tiny_config(), seed=0), 4, 8.0, targets)
    assert "\n" not in str(info.value)


def test_routed_experts_and_routers_take_per_expert_adapters():
    cfg = tiny_config()
    model = build_model(cfg, seed=0)
    names = apply_lora(model, 4, 8.0, ["experts", "gate"])
    moe = ["layers.1.mlp", "mtp.0.block.mlp"]
    assert names == [f"{m}.{p}" for m in moe for p in ("gate", "experts")]
    e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    experts, router = model.layers[1].mlp.experts, model.layers[1].mlp.gate
    assert isinstance(experts, LoRAExperts) and isinstance(router, LoRARouter)
    shapes = {n: tuple(p.shape) for n, p in experts.named_parameters() if is_lora_key(n)}
    assert shapes == {
        "gate_lora_A": (e, 4, d), "gate_lora_B": (e, i, 4), "up_lora_A": (e, 4, d),
        "up_lora_B": (e, i, 4), "down_lora_A": (e, 4, i), "down_lora_B": (e, d, 4),
    }  # fmt: skip
    assert (router.lora_A.shape, router.lora_B.shape) == ((4, d), (e, 4))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    want = {f"{m}.gate.lora_{ab}" for m in moe for ab in "AB"}
    assert trainable == want | {f"{m}.experts.{a}" for m in moe for a in EXPERT_ADAPTERS}
    # B zero: the adapted model starts as the base; A as nn.Linear would initialise each expert's (r, in)
    assert not experts.down_lora_B.any() and not router.lora_B.any()
    a = experts.down_lora_A
    assert 0.7 / i**0.5 < a.abs().max() <= 1 / i**0.5 and not torch.equal(a[0], a[1])
    assert router.e_score_correction_bias is model.layers[1].mlp.gate.e_score_correction_bias
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, build_model(cfg, seed=0)(ids).logits)


def test_merge_equals_base_plus_scaled_BA():
    model = build_model(tiny_config(), seed=0).eval()
    names = apply_lora(model, 4, 6.0, DEFAULT_TARGETS)
    randomize_adapters(model)
    before = {
        n: (m.weight.detach().clone(), m.lora_A.detach().clone(), m.lora_B.detach().clone())
        for n, m in lora_modules(model).items()
    }
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        want = model(ids).logits
    assert merge_lora(model) == names
    assert not lora_modules(model) and set(model.state_dict()) == set(build_model(tiny_config()).state_dict())
    for n, (w, a, b) in before.items():
        assert torch.allclose(model.get_submodule(n).weight, w + 1.5 * b @ a, atol=1e-6), n
    with torch.no_grad():
        assert (model(ids).logits - want).abs().max() <= 1e-5


def test_merge_of_expert_and_router_adapters_is_exact_per_expert():
    """merged = base + scale * B_e @ A_e for every expert's gate, up and down, and the router; the merged
    model's logits equal the adapted model's."""
    model = build_model(tiny_config(), seed=0).eval()
    names = apply_lora(model, 4, 6.0, ["experts", "gate", "o_proj"])
    randomize_adapters(model)
    experts = model.layers[1].mlp.experts
    ad = {n: getattr(experts, n).detach().clone() for n in EXPERT_ADAPTERS}
    gate_up, down = experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()
    router = model.layers[1].mlp.gate
    r_w, r_a, r_b = (t.detach().clone() for t in (router.weight, router.lora_A, router.lora_B))
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        want = model(ids).logits
    assert merge_lora(model) == names and not lora_modules(model)
    assert set(model.state_dict()) == set(build_model(tiny_config()).state_dict())
    i = gate_up.shape[1] // 2
    merged = model.layers[1].mlp.experts
    for e in range(gate_up.shape[0]):
        gate = gate_up[e, :i] + 1.5 * ad["gate_lora_B"][e] @ ad["gate_lora_A"][e]
        up = gate_up[e, i:] + 1.5 * ad["up_lora_B"][e] @ ad["up_lora_A"][e]
        assert torch.allclose(merged.gate_up_proj[e], torch.cat([gate, up]), atol=1e-6)
        dn = down[e] + 1.5 * ad["down_lora_B"][e] @ ad["down_lora_A"][e]
        assert torch.allclose(merged.down_proj[e], dn, atol=1e-6)
    assert torch.allclose(model.layers[1].mlp.gate.weight, r_w + 1.5 * r_b @ r_a, atol=1e-6)
    with torch.no_grad():
        assert (model(ids).logits - want).abs().max() <= 1e-5
