"""LoRA as a module transform: adapters on exactly the named linears, one-line refusals, exact merge."""

from __future__ import annotations

import pytest
import torch

from dstrain.model import build_model
from dstrain.model.lora import LoRALinear, apply_lora, lora_modules, lora_state, merge_lora
from tests.conftest import tiny_config

DEFAULT_TARGETS = ["q_b_proj", "kv_b_proj", "o_proj", "shared_experts"]


def randomize_adapters(model, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.copy_(0.2 * torch.randn(m.lora_B.shape, generator=g))


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
        (["experts"], "routed experts: fused 3-D parameters, not nn.Linear"),
        (["o_proj", "gate"], "is the MoE router, not an nn.Linear"),
        (["nothing_here"], "matches no module"),
        (["input_layernorm"], "is not an nn.Linear"),
    ],
)
def test_unadaptable_targets_are_one_line_errors(targets, message):
    with pytest.raises(ValueError, match=message) as info:
        apply_lora(build_model(tiny_config(), seed=0), 4, 8.0, targets)
    assert "\n" not in str(info.value)


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
