"""Triton kernels that dequantize a stored base's weights (stored.py) straight into the layer's dtype, in one
pass: hf/quant.py's forms, whose torch code stays the CPU kernel and the oracle the tests hold these to, bit
for bit (tests/model/common/test_dequant_kernels.py, run by Triton's interpreter).

The torch path builds fp32 temporaries (the codes as fp32, the scales repeated to full size, their product)
and casts the product to the layer's dtype: three full-size fp32 temporaries besides the output. These read the codes and scales once and write the output once: each code decoded to its exact fp32 value
from its bits (integer ops only, the same on every GPU and in the interpreter: no fp8 conversion
instruction needed), times its fp32 scale (one rounding, the torch path's), rounded once to the output dtype
(round to nearest even, as torch's cast). So the output is the torch path's, bit for bit.

- `dequantize_fp8`: DeepSeek's FP8 blocks (e4m3 codes (..., R, C), a scale per 128 x 128 block: V3's fp32
  `weight_scale_inv`, V4's e8m0 `scale`): one program per (matrix, 128 x 128 block), one scale each.
- `dequantize_fp4`: DeepSeek-V4's packed FP4 (two e2m1 codes per int8 byte, the low nibble the even column;
  an e8m0 scale per 1 x 32).
- `dequantize_packed`: compressed-tensors' packed 1/2/4/8-bit integers (int32 words along the input dim, low
  bits first, offset by 2**(bits-1); a scale per group of columns; an optional zero point packed along the
  output dim).
Leading dims (a stack of experts) are batch dims; offsets within a matrix are int32 (a matrix < 2^31
elements), a matrix's start int64.

Imported only where kernels.triton_kernels holds (see dsa_kernels.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .quant import _E8M0, _FP8, FP4_BLOCK, FP8_BLOCK

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP4_ROWS, FP4_COLS = 32, 128  # an FP4 program's tile (rows x output columns)
INT_ROWS, INT_COLS = 32, 128  # a packed-integer program's


@triton.jit
def _store(OUT, offs, x, mask, BF16: tl.constexpr):
    """fp32 `x` stored in OUT's dtype; bf16 (OUT then the output's uint16 bits) rounded to nearest even by
    integer ops, torch's rounding (c10's round_to_nearest_even: NaN -> 0x7FC0), the GPU's cvt.rn too (the
    interpreter's own fp32 -> bf16 cast truncates); fp16 by the cast (round to nearest even everywhere)."""
    if BF16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        tl.store(OUT + offs, tl.where(x != x, 0x7FC0, u).to(tl.uint16), mask=mask)
    else:
        tl.store(OUT + offs, x.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _e8m0(bits):
    """e8m0 bits (int32, 0..255) -> 2^(bits - 127) in fp32, exact: bits 0 is 2^-127 (an fp32 subnormal, whose
    products are subnormal too: the same as torch's where the GPU keeps subnormals, Triton's default), 255 NaN
    (torch's float8_e8m0fnu)."""
    word = tl.where(bits == 0, 0x00400000, bits << 23)
    word = tl.where(bits == 255, 0x7FC00000, word)
    return word.to(tl.float32, bitcast=True)


@triton.jit
def _scale(S, offs, mask, E8M0: tl.constexpr):
    """Scales at `offs` as fp32: e8m0 (their uint8 bits) decoded, any float converted (exact)."""
    if E8M0:
        return _e8m0(tl.load(S + offs, mask=mask, other=127).to(tl.int32))
    return tl.load(S + offs, mask=mask, other=1.0).to(tl.float32)


@triton.jit
def _e4m3(byte):
    """float8_e4m3fn bits (int32, 0..255) -> their exact fp32 value (subnormals m * 2^-9, 0x7F/0xFF NaN)."""
    e = (byte >> 3) & 15
    m = byte & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    mag = tl.where((byte & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((byte & 0x80) != 0, -mag, mag)


@triton.jit
def _fp8_kernel(W, S, OUT, R, C, RB, CB, E8M0: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr):
    """One (matrix, BLOCK x BLOCK block) per program: its codes times its one scale."""
    pid = tl.program_id(0)
    mat = pid // RB
    rb = pid % RB
    cb = tl.program_id(1)
    rows = rb * BLOCK + tl.arange(0, BLOCK)
    cols = cb * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    base = mat.to(tl.int64) * R * C
    offs = rows[:, None] * C + cols[None, :]
    codes = _e4m3(tl.load(W + base + offs, mask=mask, other=0).to(tl.int32))
    scale = _scale(S + mat.to(tl.int64) * RB * CB, rb * CB + cb, rb < RB, E8M0)  # one scale: a scalar
    _store(OUT + base, offs, codes * scale, mask, BF16)


@triton.jit
def _fp4_kernel(P, S, OUT, R, C, G, RT, E8M0: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                GROUP: tl.constexpr, BF16: tl.constexpr):  # fmt: skip
    """One (matrix, BR x BC tile) per program: column c's code is byte c // 2's nibble (low: even c), its scale
    column c // GROUP's."""
    pid = tl.program_id(0)
    mat = pid // RT
    rows = (pid % RT) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    m64 = mat.to(tl.int64)
    byte = tl.load(
        P + m64 * R * (C // 2) + rows[:, None] * (C // 2) + (cols // 2)[None, :], mask=mask, other=0
    )
    code = (byte.to(tl.int32) >> ((cols & 1) * 4)[None, :]) & 15
    e = (code >> 1) & 3
    m = code & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    value = tl.where((code & 8) != 0, -mag, mag)
    scale = _scale(S + m64 * R * G, rows[:, None] * G + (cols // GROUP)[None, :], mask, E8M0)
    _store(OUT + m64 * R * C, rows[:, None] * C + cols[None, :], value * scale, mask, BF16)


@triton.jit
def _int_kernel(P, S, Z, OUT, R, C, WORDS, G, GROUP, ZW, RT, BITS: tl.constexpr, HAS_ZERO: tl.constexpr,
                BR: tl.constexpr, BC: tl.constexpr, BF16: tl.constexpr):  # fmt: skip
    """One (matrix, BR x BC tile) per program: column c's integer at bit (c * BITS) % 32 of word c * BITS // 32
    of its row, less 2**(BITS-1); less the zero point of (row, group) (packed the same way down the rows);
    times the scale of (row, group)."""
    pid = tl.program_id(0)
    mat = pid // RT
    rows = (pid % RT) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    m64 = mat.to(tl.int64)
    bit = cols * BITS
    word = tl.load(P + m64 * R * WORDS + rows[:, None] * WORDS + (bit // 32)[None, :], mask=mask, other=0)
    q = ((word >> (bit % 32)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
    group = (cols // GROUP)[None, :]
    if HAS_ZERO:
        zbit = rows * BITS
        zoffs = (zbit // 32)[:, None] * G + group
        z = tl.load(Z + m64 * ZW * G + zoffs, mask=mask, other=0)
        q = q - ((z >> (zbit % 32)[:, None]) & ((1 << BITS) - 1)).to(tl.float32)
    else:
        q = q - (1 << (BITS - 1))
    scale = tl.load(S + m64 * R * G + rows[:, None] * G + group, mask=mask, other=1.0).to(tl.float32)
    _store(OUT + m64 * R * C, rows[:, None] * C + cols[None, :], q * scale, mask, BF16)


def _out(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if dtype not in OUT_DTYPES:
        raise ValueError(f"the dequantization kernels write {', '.join(map(str, OUT_DTYPES))}, not {dtype}")
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def _out_arg(out: torch.Tensor) -> dict:
    """The output as the kernels write it: bf16 as its uint16 bits (rounded in the kernel, `_store`)."""
    bf16 = out.dtype == torch.bfloat16
    return dict(OUT=out.view(torch.uint16) if bf16 else out, BF16=bf16)


def _scale_arg(scale: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The scale as the kernels read it: e8m0 as its uint8 bits (decoded in the kernel), else as it is."""
    scale = scale.contiguous()
    if _E8M0 is not None and scale.dtype == _E8M0:
        return scale.view(torch.uint8), True
    return scale, False


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """hf/quant.py's dequantize_fp8(weight, scale).to(dtype), bit for bit, in one pass."""
    rows, cols = weight.shape[-2:]
    grid = (triton.cdiv(rows, FP8_BLOCK), triton.cdiv(cols, FP8_BLOCK))
    if tuple(scale.shape[-2:]) != grid:
        raise ValueError(
            f"FP8 weight {rows}x{cols} needs a {grid[0]}x{grid[1]} scale grid, not {tuple(scale.shape)}"
        )
    lead = torch.broadcast_shapes(weight.shape[:-2], scale.shape[:-2])
    out = _out((*lead, rows, cols), dtype, weight.device)
    if out.numel() == 0:
        return out
    codes = weight.expand(*lead, rows, cols).contiguous().view(torch.uint8)
    s, e8m0 = _scale_arg(scale.expand(*lead, *grid))
    mats = out.numel() // (rows * cols)
    _fp8_kernel[(mats * grid[0], grid[1])](
        codes, s, R=rows, C=cols, RB=grid[0], CB=grid[1], E8M0=e8m0, BLOCK=FP8_BLOCK, **_out_arg(out)
    )
    return out


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """hf/quant.py's dequantize_fp4(packed, scale).to(dtype), bit for bit, in one pass."""
    rows, cols = packed.shape[-2], 2 * packed.shape[-1]
    groups = triton.cdiv(cols, FP4_BLOCK)
    if tuple(scale.shape[-2:]) != (rows, groups):
        raise ValueError(f"FP4 weight {rows}x{cols} needs {rows}x{groups} scales, not {tuple(scale.shape)}")
    lead = torch.broadcast_shapes(packed.shape[:-2], scale.shape[:-2])
    out = _out((*lead, rows, cols), dtype, packed.device)
    if out.numel() == 0:
        return out
    octets = packed.expand(*lead, rows, cols // 2).contiguous().view(torch.uint8)
    s, e8m0 = _scale_arg(scale.expand(*lead, rows, groups))
    mats, tiles = out.numel() // (rows * cols), triton.cdiv(rows, FP4_ROWS)
    _fp4_kernel[(mats * tiles, triton.cdiv(cols, FP4_COLS))](
        octets,
        s,
        R=rows,
        C=cols,
        G=groups,
        RT=tiles,
        E8M0=e8m0,
        BR=FP4_ROWS,
        BC=FP4_COLS,
        GROUP=FP4_BLOCK,
        **_out_arg(out),
    )
    return out


def dequantize_scaled(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """DeepSeek-V4's `X.weight` + `X.scale`: FP8 blocks or packed FP4, told apart by the weight's dtype."""
    if weight.dtype == torch.int8:
        return dequantize_fp4(weight, scale, dtype)
    if weight.dtype != _FP8:
        raise ValueError(
            f"a weight with a scale is FP8 (float8_e4m3fn) or packed FP4 (int8), not {weight.dtype}"
        )
    return dequantize_fp8(weight, scale, dtype)


def dequantize_packed(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shape: tuple[int, int],
    zero_point: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """hf/quant.py's dequantize_packed(...).to(dtype), bit for bit, in one pass; `shape` the matrix's (rows,
    cols) as host integers (the `weight_shape` part is on the device: reading it would wait for the GPU)."""
    rows, cols = (int(n) for n in shape)
    words = packed.shape[-1]
    bits = 32 * words // cols
    if bits not in (1, 2, 4, 8) or -(-cols * bits // 32) != words:
        raise ValueError(f"{words} int32 words per row of {cols} integers: dstrain reads 1, 2, 4 or 8 bits")
    groups = scale.shape[-1]
    group = -(-cols // groups)
    parts = [packed, scale] + ([zero_point] if zero_point is not None else [])
    lead = torch.broadcast_shapes(*(t.shape[:-2] for t in parts))
    out = _out((*lead, rows, cols), dtype, packed.device)
    if out.numel() == 0:
        return out
    p = packed.expand(*lead, rows, words).contiguous()
    s = scale.expand(*lead, rows, groups).contiguous()
    if zero_point is not None:
        zw = zero_point.shape[-2]
        z = zero_point.expand(*lead, zw, groups).contiguous()
    else:
        zw, z = 0, p
    mats, tiles = out.numel() // (rows * cols), triton.cdiv(rows, INT_ROWS)
    _int_kernel[(mats * tiles, triton.cdiv(cols, INT_COLS))](
        p, s, z, R=rows, C=cols, WORDS=words, G=groups, GROUP=group, ZW=zw, RT=tiles, BITS=bits,
        HAS_ZERO=zero_point is not None, BR=INT_ROWS, BC=INT_COLS, **_out_arg(out),
    )  # fmt: skip
    return out


def dequantize(
    form: str, parts: Sequence[torch.Tensor], dtype: torch.dtype, shape: tuple[int, int]
) -> torch.Tensor:
    """The dense weight in `dtype` of a stored weight of form `form` (a key of hf/quant.py's QUANTIZED) from
    its parts in the form's order (`Form.parts`, then the optional ones it has): the torch path's
    `QUANTIZED[form].dequantize(*parts).to(dtype)`, bit for bit. `shape`: the matrix's (rows, cols)."""
    if form == "weight_scale_inv":
        return dequantize_fp8(*parts, dtype)
    if form == "scale":
        return dequantize_scaled(*parts, dtype)
    if form == "weight_packed":
        packed, scale, _, *zero = parts
        return dequantize_packed(packed, scale, shape, zero[0] if zero else None, dtype)
    raise ValueError(f"no dequantization kernel for the stored form {form!r}")
