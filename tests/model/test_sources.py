"""A fresh model's values: the kinds `init_weights` gives each tensor, and that every part a layout asks for
(a slice, a range of experts, a ZeRO-3 flat range) equals the same part of one process's whole model, drawn
without drawing the rest."""

from __future__ import annotations

import math

import pytest
import torch

from dstrain.model import build_model
from dstrain.model.sources import FreshWeights, copy_into, init_weights, local_tensors
from tests.helpers.tiny import tiny_config

SEED = 3


@pytest.fixture(scope="module")
def whole():
    model = build_model(tiny_config(model_type="deepseek_v32", index_topk=4), seed=SEED)
    return model, {n: t.detach() for n, t in local_tensors(model)}


def test_kinds_of_start(whole):
    """Matrices Normal(0, initializer_range), each its own draw; norms ones; biases and the expert bias zero."""
    model, tensors = whole
    std = model.config.initializer_range
    drawn = []
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t)), name
        elif name.endswith((".bias", "e_score_correction_bias")):
            assert not t.any(), name
        else:
            assert abs(float(t.std()) - std) < 0.2 * std and abs(float(t.mean())) < 0.2 * std, name
            drawn.append(t.flatten()[:8])
    assert len({tuple(d.tolist()) for d in drawn}) == len(drawn)  # no two tensors share a stream
    experts = tensors["layers.1.mlp.experts.gate_up_proj"]
    assert not torch.equal(experts[0], experts[1])


def test_whole_tensors_equal_build_model(whole):
    model, tensors = whole
    fresh = FreshWeights(model.config, SEED)
    for name, t in tensors.items():
        assert torch.equal(fresh.read(name), t), name


@pytest.mark.parametrize(
    ("name", "dim"),
    [
        ("embed_tokens.weight", 0),
        ("layers.0.self_attn.q_b_proj.weight", 1),
        ("layers.1.mlp.experts.gate_up_proj", 0),
        ("layers.1.mlp.experts.down_proj", 2),
        ("layers.1.self_attn.indexer.k_norm.bias", 0),
    ],
)
def test_a_slice_equals_the_slice_of_the_whole(whole, name, dim):
    model, tensors = whole
    want = tensors[name]
    size = want.shape[dim] // 2
    fresh = FreshWeights(model.config, SEED)
    assert torch.equal(fresh.read(name, dim, size, 2 * size), want.narrow(dim, size, size))
    # the same through copy_into, as a tensor- or expert-parallel rank holds it
    part = torch.full_like(want.narrow(dim, 0, size), float("nan"))
    part.tp_shard = (dim, 1, want.shape[dim] // size)
    copy_into(part, fresh, name)
    assert torch.equal(part, want.narrow(dim, size, size))


def test_an_expert_parallel_rank_draws_only_its_experts(whole):
    model, tensors = whole
    fresh = FreshWeights(model.config, SEED)
    name = "layers.1.mlp.experts.gate_up_proj"
    fresh.read(name, 0, 2, 4)
    assert fresh.bytes_drawn == 2 * math.prod(tensors[name].shape[1:]) * 4


@pytest.mark.parametrize("name", ["layers.1.mlp.experts.down_proj", "lm_head.weight", "norm.weight"])
def test_a_flat_range_equals_the_flat_range_of_the_whole(whole, name):
    """A ZeRO-3 partition, the last one padded with zeros past the tensor's end."""
    model, tensors = whole
    flat = tensors[name].flatten()
    fresh = FreshWeights(model.config, SEED)
    n = flat.numel()
    part = -(-n // 3) + 1
    got = torch.cat([fresh.read_flat(name, r * part, (r + 1) * part) for r in range(3)])
    assert torch.equal(got[:n], flat) and not got[n:].any() and got.numel() == 3 * part


def test_a_held_part_of_a_model_gets_its_values_and_the_rest_stays_on_meta(whole):
    """A pipeline stage: the layers it does not hold stay on meta and cost nothing."""
    from dstrain.model.build import materialize
    from dstrain.model.deepseek_v3.model import DeepSeekLM

    model, tensors = whole
    with torch.device("meta"):
        stage = DeepSeekLM(model.config)
    materialize(stage.layers[1], "cpu")
    fresh = init_weights(stage, SEED)
    held = {n: t for n, t in local_tensors(stage) if not t.is_meta}
    assert held and all(n.startswith("layers.1.") for n in held)
    assert all(torch.equal(t, tensors[n]) for n, t in held.items())
    assert fresh.bytes_drawn <= sum(t.numel() * 4 for t in held.values())


def test_seed_none_follows_torchs_global_generator():
    torch.manual_seed(11)
    a = build_model(tiny_config())
    b = build_model(tiny_config())
    torch.manual_seed(11)
    c = build_model(tiny_config())
    assert torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)
    assert not torch.equal(a.embed_tokens.weight, b.embed_tokens.weight)
