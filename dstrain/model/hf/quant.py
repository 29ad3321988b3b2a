"""Quantized weights as published checkpoints store them, dequantized to fp32 as they are read: DeepSeek's FP8
blocks (V3: fp32 `weight_scale_inv`; V4: e8m0 `scale`), DeepSeek-V4's packed FP4 experts, compressed-tensors'
packed integers (Kimi-K2.5's INT4 experts). A form is told by the tensors a file holds beside (or instead of)
`X.weight` (QUANTIZED)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

FP8_BLOCK = 128
FP4_BLOCK = 32
FP8_MAX = 448.0  # e4m3's largest finite value
FP4_MAX = 6.0  # e2m1's
_FP8 = getattr(torch, "float8_e4m3fn", None)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
# e2m1 by its 4 bits: the sign is the high bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """DeepSeek's published FP8 weights: one scale per 128x128 block (V3: fp32 `weight_scale_inv`, V4: e8m0
    `scale`, a power of two), the last blocks of a shape not a multiple of 128 cut short. Leading dims (a
    stack of experts) are batch dims."""
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    if tuple(scale_inv.shape[-2:]) != grid:
        raise ValueError(
            f"FP8 weight {rows}x{cols} needs a {grid[0]}x{grid[1]} scale grid, not {tuple(scale_inv.shape)}"
        )
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, -2)[..., :rows, :]
    return weight.float() * scale.repeat_interleave(FP8_BLOCK, -1)[..., :cols]


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's published routed experts: two e2m1 values per int8 byte (the low nibble the even column),
    one e8m0 scale per 32 input columns. -> the fp32 weight, twice as wide as `packed` (exact: a small float
    times a power of two). Leading dims are batch dims."""
    octets = packed.contiguous().view(torch.uint8)
    codes = torch.stack([octets & 15, octets >> 4], -1).flatten(-2)
    rows, cols = codes.shape[-2:]
    if tuple(scale.shape[-2:]) != (rows, -(-cols // FP4_BLOCK)):
        raise ValueError(
            f"FP4 weight {rows}x{cols} needs {rows}x{-(-cols // FP4_BLOCK)} scales, not {tuple(scale.shape)}"
        )
    values = torch.tensor(FP4_VALUES, device=codes.device)[codes.long()]
    return values * scale.float().repeat_interleave(FP4_BLOCK, -1)[..., :cols]


def dequantize_scaled(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's `X.weight` + `X.scale`: FP8 blocks or packed FP4, told apart by the weight's dtype."""
    if weight.dtype == torch.int8:
        return dequantize_fp4(weight, scale)
    if weight.dtype != _FP8:
        raise ValueError(
            f"a weight with a scale is FP8 (float8_e4m3fn) or packed FP4 (int8), not {weight.dtype}"
        )
    return dequantize_fp8(weight, scale)


def dequantize_packed(
    packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, zero_point: torch.Tensor | None = None
) -> torch.Tensor:
    """compressed-tensors' "pack-quantized" weights (Kimi-K2.5's INT4 routed experts): integers of `bits` bits
    packed densely along the input dim into int32 words, low bits first, stored offset by 2**(bits-1); one
    scale per group of input columns (a channel: one group); an asymmetric zero point packed the same way
    along the output dim. -> the exact fp32 weight of `shape`. Leading dims (a stack of experts, `shape` then
    one row per expert) are batch dims."""
    rows, cols = (int(n) for n in shape.reshape(-1, 2)[0])
    words = packed.shape[-1]
    bits = 32 * words // cols
    if bits not in (1, 2, 4, 8) or -(-cols * bits // 32) != words:
        raise ValueError(f"{words} int32 words per row of {cols} integers: dstrain reads 1, 2, 4 or 8 bits")
    group = -(-cols // scale.shape[-1])

    def per_column(t: torch.Tensor) -> torch.Tensor:
        return t.float().repeat_interleave(group, -1)[..., :cols]

    q = _unpack(packed, bits, cols)
    if zero_point is not None:
        q = q - per_column(_unpack(zero_point.transpose(-2, -1), bits, rows).transpose(-2, -1))
    return q * per_column(scale)


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The first `n` integers of each row of int32 words (a word's low bits first: its bytes in order on a
    little-endian host), as fp32 without the storage offset."""
    octets = packed.contiguous().view(torch.uint8)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    q = (octets.unsqueeze(-1) >> shifts) & (2**bits - 1)
    return q.flatten(-2)[..., :n].float() - 2 ** (bits - 1)


class Form(NamedTuple):
    """How a file holds a weight `X.weight` quantized."""

    parts: tuple[str, ...]
    """Its tensors, by the suffix replacing `weight` ("weight": X.weight itself), in `dequantize`'s order."""
    dequantize: Callable[..., torch.Tensor]
    """The dense fp32 weight of the parts."""
    optional: tuple[str, ...] = ()
    """Parts it may have besides (passed after the others)."""


# Quantized weights by the tensor that marks the form: the file holds it beside X.weight or instead of it.
QUANTIZED: dict[str, Form] = {
    # DeepSeek-V3's FP8: X.weight in float8_e4m3fn, one inverse scale per 128x128 block
    "weight_scale_inv": Form(("weight", "weight_scale_inv"), dequantize_fp8),
    # DeepSeek-V4's FP8 (128x128 blocks) and FP4 (routed experts, 1x32 blocks): X.weight beside an e8m0 X.scale
    "scale": Form(("weight", "scale"), dequantize_scaled),
    # compressed-tensors' pack-quantized integers, in place of X.weight
    "weight_packed": Form(
        ("weight_packed", "weight_scale", "weight_shape"), dequantize_packed, ("weight_zero_point",)
    ),
}


def form_of(parts: Iterable[str]) -> Form | None:
    """The form (QUANTIZED) of a weight stored as these parts; None: one dstrain does not read (an unknown
    part, e.g. compressed-tensors' activation-ordered `weight_g_idx`, or a missing one)."""
    parts = set(parts)
    for marker, form in QUANTIZED.items():
        need = set(form.parts) - {"weight"}
        if marker in parts and need <= parts <= need | set(form.optional):
            return form
    return None
