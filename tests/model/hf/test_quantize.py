"""The quantizers (dstrain/model/hf/quantize.py), the inverses of quant.py's dequantizers, on hand-made blocks:
round to nearest even at ties, saturation, power-of-two e8m0 scales, compressed-tensors' own packing, and the
source's scales kept where the weights did not move (an untrained weight comes back byte for byte)."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors import PackedQuantizationCompressor as Packed
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams

from dstrain.model.hf.files import E8M0
from dstrain.model.hf.quant import dequantize_fp4, dequantize_fp8, dequantize_packed
from dstrain.model.hf.quantize import (
    fp4_codes,
    fp8_codes,
    int_codes,
    quantize_fp4,
    quantize_fp8,
    quantize_packed,
)

F32, BF16 = torch.float32, torch.bfloat16


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(x.dtype == y.dtype and torch.equal(_bytes(x), _bytes(y)) for x, y in zip(a, b, strict=True))


def test_fp8_rounds_to_nearest_even_and_saturates():
    one = torch.ones(1, 1)
    # e4m3 in [1, 2) steps by 1/8: 1.0625 ties to 1.0 (even), 1.1875 to 1.25; past 448 saturates
    x = torch.tensor([[1.0625, 1.1875, -1.0625, 448.0, 470.0, -1e6, 2.0**-9, 2.0**-10]])
    got = fp8_codes(x, one).float()
    assert got.tolist() == [[1.0, 1.25, -1.0, 448.0, 448.0, -448.0, 2.0**-9, 0.0]]
    # V3's fp32 scale is amax / 448: the largest value of each block is +-448 exactly
    w = torch.randn(200, 130, generator=torch.Generator().manual_seed(0))
    w[150:, 128:] *= 1000
    q, s = quantize_fp8(w, F32)
    assert s.dtype == F32 and s.shape == (2, 2)
    blocks = [q[:128, :128], q[:128, 128:], q[128:, :128], q[128:, 128:]]
    assert all(b.float().abs().max() == 448 for b in blocks)
    assert torch.equal(s.reshape(-1), torch.stack([b.abs().max() for b in (
        w[:128, :128], w[:128, 128:], w[128:, :128], w[128:, 128:])]) / 448)  # fmt: skip


def test_e8m0_scales_are_the_power_of_two_at_or_above_amax_over_the_max():
    w = torch.zeros(2, 64)
    w[0, :32], w[0, 32:] = 6.0, 6.0001  # exactly 6 * 2**0: scale 1; a hair above: 2
    w[1, :32], w[1, 32:] = 0.75, 0.0  # 0.75 / 6 = 2**-3; an all-zero block: scale 1
    packed, s = quantize_fp4(w)
    assert s.dtype == E8M0 and s.float().tolist() == [[1.0, 2.0], [0.125, 1.0]]
    assert torch.equal(dequantize_fp4(packed, s)[:, :32], w[:, :32])
    q, s = quantize_fp8(torch.full((3, 3), 448.0 * 2**-20), E8M0)
    assert s.float().item() == 2.0**-20 and q.float().max() == 448
    q, s = quantize_fp8(torch.full((3, 3), 449.0), E8M0)  # never saturates: the next power of two
    assert s.float().item() == 2.0 and q.float().max() == 224


def test_fp4_rounds_to_nearest_even_and_saturates():
    # midpoints between e2m1 neighbours go to the even code (mantissa 0): 0, 1, 1, 2, 2, 4, 4
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, 0.26, 4.9, -0.25, -5.0, -0.0])
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    codes = fp4_codes(x).long()
    got = torch.where(codes >= 8, -1.0, 1.0) * values[codes % 8]
    assert got.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 0.5, 4.0, -0.0, -4.0, -0.0]
    assert codes[-3].item() == 8 and codes[-1].item() == 8  # the sign kept on -0
    # packing: the even column in the low nibble
    packed, _ = quantize_fp4(torch.tensor([[1.0, -6.0] + [0.0] * 30]) * 1.0)
    assert packed.view(torch.uint8)[0, 0].item() == (2 | (15 << 4))


@pytest.mark.parametrize(
    ("bits", "group"),
    [(4, 32), (8, None), (2, 16), (1, 32)],  # K2.5's INT4 first
)
def test_packed_integers_are_compressed_tensors_own(bits, group):
    """Scales and int32 words bit for bit as the package computes and packs them from a bf16 weight."""
    args = QuantizationArgs(
        num_bits=bits, group_size=group, strategy="group" if group else "channel", symmetric=True
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    w = (torch.randn(24, 96, generator=torch.Generator().manual_seed(bits)) * 0.02).to(BF16)
    w[0, :8] = 0  # a zero run: packing of the offset zero
    g = w.unflatten(-1, (-1, group or 96))
    scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), args)
    theirs = Packed.compress({"weight": w, "weight_scale": scale.to(BF16)}, scheme)
    packed, ours = quantize_packed(w.float(), bits, 96 // (group or 96), BF16)
    assert _same((packed, ours), (theirs["weight_packed"], theirs["weight_scale"]))
    # ties to even: 2.5 -> 2, 3.5 -> 4, -2.5 -> -2; past the range, clamped
    if bits == 4:
        x = torch.tensor([[2.5, 3.5, -2.5, 9.0, -9.0, 0.5, 1.5]])
        q = int_codes(x, torch.ones(1, 1, dtype=BF16), 4).float()
        assert q.tolist() == [[2.0, 4.0, -2.0, 7.0, -8.0, 0.0, 2.0]]


def test_source_scales_are_kept_where_the_weights_did_not_move():
    """Dequantized weights (held in fp32 or rounded to bf16) re-quantize to the very bytes with the source's
    scales; re-derived, many scales differ (FP4: a block whose largest value rounded down; INT4: amax / 7.5 of
    a grid value; V3: an fp32 scale times 448 does not survive bf16). A moved block gets the derived scale."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=g) * 0.02
    cases = {
        "fp8 v3": (lambda x, k=None: quantize_fp8(x, F32, k), dequantize_fp8),
        "fp8 v4": (lambda x, k=None: quantize_fp8(x, E8M0, k), dequantize_fp8),
        "fp4": (quantize_fp4, dequantize_fp4),
        "int4": (
            lambda x, k=None: quantize_packed(x, 4, 12, BF16, k),
            lambda p, s: dequantize_packed(p, s, torch.tensor(w.shape)),
        ),
    }
    rederived = {}
    for name, (quantize, dequantize) in cases.items():
        src = quantize(w)
        dense = dequantize(*src)
        for held in (F32, BF16):
            x = dense.to(held).float()
            assert _same(quantize(x, src[1]), src), (name, held)
        rederived[name] = float(
            (quantize(dense.to(BF16).float())[1].float() != src[1].float()).float().mean()
        )
        moved = dense.clone()
        moved[:1, :8] += 1e-3  # one block (V3/V4 FP8: the first of 6; FP4 and INT4: of one row)
        q, s = quantize(moved, src[1])
        fresh = quantize(moved)[1]
        assert torch.equal(s.float()[0, 0], fresh.float()[0, 0]) and torch.equal(
            _bytes(s)[1:], _bytes(src[1])[1:]
        )
    assert rederived["fp4"] > 0.1 and rederived["int4"] > 0.9 and rederived["fp8 v3"] == 1.0, rederived
