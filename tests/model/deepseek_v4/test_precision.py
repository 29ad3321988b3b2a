"""DeepSeek-V4 under bf16: the tensors DeepSeek keeps in fp32 (mHC weights, attention sinks, compressor position
biases) compute in fp32 whatever dtype they reach the forward in (DeepSpeed's bf16 engine casts every
parameter), and a model built in bf16 holds them in fp32."""

from __future__ import annotations

import copy

import torch

from dstrain.model import build_model, get_config
from dstrain.model.common.mhc import HyperConnection, HyperHead, expand
from dstrain.model.deepseek_v4.attention import Compressor, attend
from dstrain.model.deepseek_v4.state_dict import keeps_fp32

BF16 = torch.bfloat16
B, T, N, D = 2, 12, 4, 32


def _random(shape: tuple, seed: int, std: float = 1.0) -> torch.Tensor:
    """fp32 values that bf16 holds exactly."""
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std).to(BF16).float()


def _twins(module: torch.nn.Module, low: set[str]) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the module with its parameters named in `low` in bf16, the same values all in fp32)."""
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.copy_(_random(p.shape, 100 + i, 0.1 if p.ndim == 2 else 1.0))
    half = copy.deepcopy(module)
    for name, p in half.named_parameters():
        if name in low:
            p.data = p.data.to(BF16)
    return half, module


def test_mhc_in_bf16_equals_its_fp32_reference() -> None:
    """A sublayer's mHC (weights, Sinkhorn, collapse, expand) and the final head with bf16 parameters on bf16
    inputs, against the same modules with the same values in fp32 on the same inputs upcast: every output
    equals the reference's rounded to bf16 exactly, and so does every parameter's gradient and the sublayer
    output's; the streams' gradients are sums of bf16 gradients (expand, collapse, the weights' norm) where
    the reference sums in fp32: within 2^-7 of their largest element."""
    hc, hc_ref = _twins(HyperConnection(D, N, 20, 1e-6, 1e-6), {"fn", "base", "scale"})
    head, head_ref = _twins(HyperHead(D, N, 1e-6, 1e-6), {"hc_fn", "hc_base", "hc_scale"})
    shapes = [(B, T, N, D), (B, T, D), (B, T, N, D), (B, T, D), (B, T, N, D), (B, T, D)]
    streams, out, last, d_x, d_new, d_final = (_random(shape, i) for i, shape in enumerate(shapes))

    def run(hc, head, dtype):  # noqa: ANN001, ANN202
        s, o, h = (z.to(dtype).requires_grad_() for z in (streams, out, last))
        post, comb, x = hc(s)
        new = expand(post, comb, o, s)
        final = head(h)
        loss = sum((y.float() * d).sum() for y, d in ((x, d_x), (new, d_new), (final, d_final)))
        loss.backward()
        params = {**dict(hc.named_parameters()), **dict(head.named_parameters())}
        return [x, new, final, o.grad, *(p.grad for p in params.values())], [s.grad, h.grad]

    exact, summed = run(hc, head, BF16)
    exact_ref, summed_ref = run(hc_ref, head_ref, torch.float32)
    for y, r in zip(exact, exact_ref, strict=True):
        assert y.dtype == BF16 and torch.equal(y, r.to(BF16))
    for g, r in zip(summed, summed_ref, strict=True):
        assert (g.float() - r).abs().max() <= 2**-7 * r.abs().max()


def test_compressor_position_bias_and_sinks_in_bf16_equal_their_fp32_reference() -> None:
    """A CSA compressor whose position bias arrives in bf16 equals (and trains as) the same compressor with the
    bias in fp32 (the projections bf16 in both); the attention with bf16 sinks equals it with fp32 sinks."""
    comp, comp_ref = _twins(
        Compressor(D, 16, 4, True, 1e-6),
        {"kv_proj.weight", "gate_proj.weight", "kv_norm.weight", "position_bias"},
    )
    for name, p in comp_ref.named_parameters():
        if name != "position_bias":
            p.data = p.data.to(BF16)
    x = _random((B, T, D), 1).to(BF16)
    got, want = comp.entries(x), comp_ref.entries(x)
    assert torch.equal(got, want)
    d = _random(got.shape, 2)
    (got.float() * d).sum().backward()
    (want.float() * d).sum().backward()
    for (name, p), r in zip(comp.named_parameters(), comp_ref.parameters(), strict=True):
        assert torch.equal(p.grad, r.grad.to(p.grad.dtype)), name

    q, kv, sinks = _random((B, T, 4, 16), 3).to(BF16), _random((B, T, 16), 4).to(BF16), _random((4,), 5)
    half = sinks.to(BF16).requires_grad_()
    full = sinks.clone().requires_grad_()
    o_half, o_full = attend(q, kv, None, None, half, 6, None)[0], attend(q, kv, None, None, full, 6, None)[0]
    assert torch.equal(o_half, o_full)
    o_half.float().sum().backward()
    o_full.float().sum().backward()
    assert torch.equal(half.grad, full.grad.to(BF16))


def test_a_model_built_in_bf16_holds_deepseeks_fp32_tensors_in_fp32() -> None:
    cfg = get_config("tiny-v4").replace(vocab_size=64)
    half, full = build_model(cfg, seed=0, dtype=BF16), build_model(cfg, seed=0, dtype=torch.float32)
    ref = full.state_dict()
    kept = [k for k in ref if keeps_fp32(k)]
    assert any(".attn_hc." in k for k in kept) and any(k.endswith(".sinks") for k in kept)
    assert any(k.endswith(".position_bias") for k in kept) and any(k.startswith("hc_head.") for k in kept)
    for key, t in half.state_dict().items():
        if key in kept:
            assert t.dtype == torch.float32 and torch.equal(t, ref[key]), key
        elif t.is_floating_point():
            assert t.dtype == BF16, key
