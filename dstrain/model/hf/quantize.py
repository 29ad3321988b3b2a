"""The inverses of quant.py's dequantizers: a dense weight -> the parts a published checkpoint stores, rounded
to nearest (ties to even) onto the format's grid, with scales chosen as the releases choose them:
- FP8 e4m3 in 128x128 blocks: DeepSeek-V3's fp32 `weight_scale_inv` = amax / 448 (their `weight_quant`);
  V4's e8m0 `scale` = the power of two at or above amax / 448 (`scale_fmt: ue8m0`), so nothing saturates.
- FP4 e2m1 in 1x32 blocks with e8m0 scales (V4's routed experts): the power of two at or above amax / 6.
- compressed-tensors' symmetric integers (Kimi-K2.5's INT4 experts): scale = amax / ((2**bits - 1) / 2) in the
  scale's dtype (bf16 for K2.5: the package computes in the weight's dtype), codes round(w / scale) clamped
  to [-2**(bits-1), 2**(bits-1) - 1], packed as `quant.dequantize_packed` unpacks them.

A scale derived from dequantized weights does not always reproduce the stored one (an FP4 block whose largest
value rounded down to 3 re-derives half the scale; an fp32 scale times 448 rounds), so each quantizer takes the
source's scales (`keep`) and keeps a block's where the weights are still on its grid: re-quantizing them with it
gives back the weights exactly, as they were held (bf16 weights: compared in bf16, the one rounding the
dequantized fp32 value went through). An untrained weight then comes back byte for byte in any held dtype;
a trained block gets the derived scale.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from .files import E8M0, FP8, SAFE_DTYPES, SafetensorsFile, checkpoint_files
from .quant import (
    FP4_BLOCK,
    FP4_MAX,
    FP8_BLOCK,
    FP8_MAX,
    QUANTIZED,
    dequantize_fp4,
    dequantize_fp8,
    dequantize_packed,
    form_of,
)


def as_held(back: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`back` (fp32) rounded as `w` was held before it reached fp32: to bf16 where `w` is a bf16 value (a bf16
    weight, or an fp32 one still where a bf16 load left it), else as it is."""
    back, w = back.float(), w.float()
    return torch.where(w.to(torch.bfloat16).float() == w, back.to(torch.bfloat16).float(), back)


def blocks_max(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """max |w| over each rows x cols block (the last ones cut short), fp32."""
    r, c = w.shape
    pad = torch.nn.functional.pad(w.float().abs(), (0, -c % cols, 0, -r % rows))
    return pad.unflatten(1, (-1, cols)).unflatten(0, (-1, rows)).amax((1, 3))


def pow2_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x (exactly, from the fp32 bits: no log2 rounding), fp32; 1 where x is 0."""
    mantissa, exponent = torch.frexp(x.float())
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent).clamp(-127, 127)  # e8m0's range
    return torch.where(x > 0, torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent), 1.0)


def to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Powers of two (fp32) as e8m0: the biased exponent alone."""
    exponent = torch.frexp(scale.float())[1] - 1
    return (exponent + 127).to(torch.uint8).view(E8M0)


def _per_element(scale: torch.Tensor, rows: int, cols: int, shape: torch.Size) -> torch.Tensor:
    return scale.float().repeat_interleave(rows, 0)[: shape[0]].repeat_interleave(cols, 1)[:, : shape[1]]


def _kept(w: torch.Tensor, back: torch.Tensor, rows: int, cols: int, grid: torch.Size) -> torch.Tensor:
    """Per block: whether `back` (the weights re-quantized with the source's scale, dequantized) equals `w`
    as it was held."""
    same = (as_held(back, w) == w.float()) | (back.isnan() & w.isnan())
    bad = torch.nn.functional.pad((~same).float(), (0, -w.shape[1] % cols, 0, -w.shape[0] % rows))
    return bad.unflatten(1, (-1, cols)).unflatten(0, (-1, rows)).amax((1, 3)).reshape(grid) == 0


# ------------------------------------------------------------------ FP8 e4m3, 128x128 blocks
def fp8_codes(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w / scale (per 128x128 block) rounded to nearest even e4m3, saturating at +-448."""
    x = w.float() / _per_element(scale, FP8_BLOCK, FP8_BLOCK, w.shape)
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_fp8(
    w: torch.Tensor, scale_dtype: torch.dtype, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (e4m3 weight, scales in `scale_dtype`: float32 for V3's `weight_scale_inv` (amax / 448; bf16 or fp16:
    that rounded, where a block's largest value may then saturate), e8m0 for V4's `scale`); `keep`: the
    source's scales, kept per block where the weights are still on their grid."""
    amax = blocks_max(w, FP8_BLOCK, FP8_BLOCK)
    if scale_dtype == E8M0:
        scale = pow2_at_least(amax / FP8_MAX)
    elif scale_dtype in (torch.float32, torch.bfloat16, torch.float16):
        # in the scale's own dtype (the releases': fp32); an all-zero block: any scale, 1
        scale = torch.where(amax > 0, amax / FP8_MAX, 1.0).to(scale_dtype).float()
    else:
        raise ValueError(f"FP8 block scales are float32, bfloat16, float16 or e8m0, not {scale_dtype}")
    if keep is not None:
        old = keep.float()
        back = dequantize_fp8(fp8_codes(w, old), old)
        scale = torch.where(_kept(w, back, FP8_BLOCK, FP8_BLOCK, old.shape), old, scale)
    return fp8_codes(w, scale), to_e8m0(scale) if scale_dtype == E8M0 else scale.to(scale_dtype)


# ------------------------------------------------------------------ FP4 e2m1, 1x32 blocks, e8m0 scales
def fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """x rounded to nearest e2m1 (ties to the even code), saturating at +-6: 4-bit codes, the sign the high
    bit (-0 kept). e2m1's grid steps by 1/2 below 2, by 1 to 4, by 2 to 6, and in each stretch the even
    multiples of the step are the even codes: torch.round (ties to even) on the scaled value rounds to them."""
    a = x.abs().clamp(max=FP4_MAX)
    v = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), 2 * torch.round(a / 2)))
    code = torch.where(v <= 2, v * 2, torch.where(v <= 4, v + 2, 7.0)).to(
        torch.uint8
    )  # 3 -> 5, 4 -> 6, 6 -> 7
    return code | (x.signbit().to(torch.uint8) << 3)


def fp4_pack(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per int8 byte, the even column in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)


def quantize_fp4(w: torch.Tensor, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (packed e2m1 int8 (rows, cols / 2), e8m0 scales (rows, ceil(cols / 32))); `keep`: the source's
    scales, kept per block where the weights are still on their grid."""
    if w.shape[1] % 2:
        raise ValueError(f"packed FP4 holds two values per byte: {w.shape[1]} columns is odd")
    scale = pow2_at_least(blocks_max(w, 1, FP4_BLOCK) / FP4_MAX)

    def packed(s: torch.Tensor) -> torch.Tensor:
        return fp4_pack(fp4_codes(w.float() / _per_element(s, 1, FP4_BLOCK, w.shape)))

    if keep is not None:
        old = keep.float()
        back = dequantize_fp4(packed(old), old)
        scale = torch.where(_kept(w, back, 1, FP4_BLOCK, old.shape), old, scale)
    return packed(scale), to_e8m0(scale)


# ------------------------------------------------------------------ compressed-tensors' packed integers
def int_scale(w: torch.Tensor, bits: int, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' symmetric scale per group of columns: amax / ((2**bits - 1) / 2) rounded to `dtype`,
    a zero one replaced by `dtype`'s eps (as it guards the division)."""
    group = -(-w.shape[1] // groups)
    amax = blocks_max(w, 1, group)
    scale = (amax / ((2**bits - 1) / 2)).to(dtype)
    return torch.where(scale == 0, torch.finfo(dtype).eps, scale)


def int_codes(w: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """round(w / scale) (ties to even), clamped to the signed `bits`-bit range, int8. The quotient is taken in
    the scale's dtype, as compressed-tensors divides a weight held in it."""
    group = -(-w.shape[1] // scale.shape[1])
    per = scale.repeat_interleave(group, 1)[:, : w.shape[1]]
    x = (w.to(scale.dtype) / per).float()
    return torch.round(x).clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1).to(torch.int8)


def pack_int32(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed `bits`-bit integers -> int32 words along each row, offset by 2**(bits-1), low bits first, the
    last word zero-padded (compressed-tensors' `pack_to_int32` for 1, 2, 4 or 8 bits)."""
    per_byte = 8 // bits
    u = (q.to(torch.int32) + 2 ** (bits - 1)).to(torch.uint8)
    u = torch.nn.functional.pad(u, (0, -u.shape[1] % (32 // bits)))
    u = u.unflatten(1, (-1, per_byte)) << (torch.arange(per_byte, dtype=torch.uint8) * bits)
    octets = u.sum(-1, dtype=torch.uint8)
    return octets.contiguous().view(torch.int32)


def quantize_packed(
    w: torch.Tensor,
    bits: int,
    groups: int,
    scale_dtype: torch.dtype,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' symmetric "pack-quantized" form of `w`, one scale per `groups` column groups (1:
    per channel) -> (int32 words, scales in `scale_dtype`). `keep`: the source's scales, kept per group where
    the weights are still on their grid."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"packed integers of {bits} bits: dstrain writes 1, 2, 4 or 8")
    scale = int_scale(w, bits, groups, scale_dtype)
    if keep is not None:
        old = keep.to(scale_dtype)
        shape = torch.tensor(w.shape)
        back = dequantize_packed(pack_int32(int_codes(w, old, bits), bits), old, shape)
        group = -(-w.shape[1] // groups)
        scale = torch.where(_kept(w, back, 1, group, old.shape), old, scale)
    return pack_int32(int_codes(w, scale, bits), bits), scale


# ------------------------------------------------------------------ a source folder's forms, for an export
class SourceForms:
    """The quantized forms of a source folder's weights (from its headers), and each one's scales read back as
    an export writes that weight again: `quantize(hf_key, w)` -> the parts the source stored `hf_key` as, in
    its names and dtypes; `errors` the relative RMS error each quantization introduced."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = str(folder)
        self.files = checkpoint_files(self.folder)
        self.parts: dict[str, dict[str, str]] = {}  # X.weight -> {part: file key}
        for key in self.files:
            base, _, leaf = key.rpartition(".")
            if leaf.startswith("weight_") or (leaf == "scale" and f"{base}.weight" in self.files):
                self.parts.setdefault(f"{base}.weight", {})[leaf] = key
        for weight, parts in self.parts.items():
            if form_of(parts) is None:
                raise ValueError(
                    f"{self.folder}: {weight} is stored in a quantized form dstrain does not write"
                )
        self.errors: dict[str, float] = {}
        self._handles: dict[str, SafetensorsFile] = {}

    def __contains__(self, hf_key: str) -> bool:
        return hf_key in self.parts

    def __enter__(self) -> SourceForms:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

    def _entry(self, key: str) -> tuple[SafetensorsFile, torch.dtype]:
        file = self.files[key]
        if file not in self._handles:
            self._handles[file] = SafetensorsFile(file)
        handle = self._handles[file]
        return handle, SAFE_DTYPES[handle.entries[key]["dtype"]]

    def dtype(self, key: str) -> torch.dtype:
        return self._entry(key)[1]

    def _read(self, key: str) -> torch.Tensor:
        handle, dtype = self._entry(key)
        return handle.read(key, dtype)

    def quantize(self, hf_key: str, w: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """`w` (the dense weight, any float dtype) in the form the source stored `hf_key` in."""
        parts = {**self.parts[hf_key], "weight": hf_key}
        w = w.float()
        if "weight_packed" in parts:
            if "weight_zero_point" in parts:
                raise ValueError(
                    f"{hf_key}: asymmetric packed integers (a zero point) are not written yet; "
                    "export with --dtype bfloat16"
                )
            old = self._read(parts["weight_scale"])
            shape = self._read(parts["weight_shape"])
            words = self._entry(parts["weight_packed"])[0].entries[parts["weight_packed"]]["shape"][-1]
            if tuple(int(n) for n in shape) != tuple(w.shape):
                raise ValueError(
                    f"{hf_key}: weight {tuple(w.shape)} where the source's weight_shape is {shape}"
                )
            bits = 32 * words // w.shape[1]
            packed, scale = quantize_packed(w, bits, old.shape[1], old.dtype, keep=old)
            out = {"weight_packed": packed, "weight_scale": scale, "weight_shape": shape}
        else:
            marker = "weight_scale_inv" if "weight_scale_inv" in parts else "scale"
            old = self._read(parts[marker])
            if self.dtype(parts["weight"]) == torch.int8:
                q, scale = quantize_fp4(w, keep=old)
            else:
                q, scale = quantize_fp8(w, old.dtype, keep=old)
            out = {"weight": q, marker: scale}
        form = form_of(self.parts[hf_key])
        back = form.dequantize(*(out[p] for p in form.parts))
        # as held: a bf16 weight exported unchanged comes back as itself (it was q * scale rounded to bf16)
        miss = float((as_held(back, w) - w).norm())
        self.errors[hf_key] = miss / max(float(w.norm()), torch.finfo(torch.float32).tiny)
        return [(parts[p], t.to(self.dtype(parts[p]))) for p, t in out.items()]


# ------------------------------------------------------------------ the export's round trip, for QAT
def round_trip(
    form: str, scale_dtype: torch.dtype, fp4: bool = False, bits: int = 0
) -> Callable[..., torch.Tensor]:
    """(w fp32, keep: the source's scales) -> dequantize(quantize(w)), fp32: what an export of `w` in the form
    (a QUANTIZED marker; FP8 or, with `fp4`, packed FP4; packed integers of `bits`) reads back as, the same
    functions `SourceForms.quantize` writes it with."""
    form_ = QUANTIZED[form]

    def fp8(w: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return form_.dequantize(*quantize_fp8(w, scale_dtype, keep=keep))

    def fp4_(w: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return form_.dequantize(*quantize_fp4(w, keep=keep))

    def packed(w: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        parts = quantize_packed(w, bits, keep.shape[-1], scale_dtype, keep=keep)
        return form_.dequantize(*parts, torch.tensor(w.shape))

    return packed if form == "weight_packed" else fp4_ if fp4 else fp8
