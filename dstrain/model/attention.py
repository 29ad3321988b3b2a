"""Rotary embedding (with YaRN) and the attention kernel, including document isolation for packed rows."""

from __future__ import annotations

import importlib.util
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .kernels import compute_dtype

log = logging.getLogger(__name__)

# Packed rows on CUDA run a varlen flash kernel: flash-attn's when installed, else torch's own (2.13+).
try:
    from flash_attn import flash_attn_varlen_func
except ImportError as exc:  # pragma: no cover - not installed on CPU machines
    flash_attn_varlen_func = None
    if importlib.util.find_spec("flash_attn") is not None:  # installed but broken (a build for another torch)
        log.warning(
            "flash_attn is installed but does not import (%s): packed rows use torch's varlen kernel", exc
        )
try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - torch < 2.10
    varlen_attn = None


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_params(cfg: ModelConfig) -> dict | None:
    rs = cfg.rope_scaling
    if not rs or rs.get("rope_type", rs.get("type")) != "yarn":
        return None
    return rs


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (fp32, qk_rope_head_dim/2) and the cos/sin multiplier, as HF computes them."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    yarn = _yarn_params(cfg)
    if yarn is None:
        return 1.0 / pos_freqs, 1.0
    orig = yarn.get("original_max_position_embeddings", cfg.max_position_embeddings)
    factor = yarn.get("factor") or cfg.max_position_embeddings / orig
    mscale, mscale_all_dim = yarn.get("mscale"), yarn.get("mscale_all_dim")
    attention_factor = yarn.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = yarn.get("beta_fast") or 32, yarn.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if yarn.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(d), times YaRN's mscale(factor, mscale_all_dim)^2 correction when configured."""
    scale = cfg.qk_head_dim**-0.5
    yarn = _yarn_params(cfg)
    if yarn is not None and yarn.get("mscale_all_dim"):
        scale *= _yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2
    return scale


def rope_cos_sin(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, r/2) fp32 cos and sin; rotation is always computed in fp32."""
    freqs = position_ids[..., None].float() * inv_freq
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x: (B, T, heads, r). Interleaved pairs are (0,1),(2,3)...; the output lists rotated first elements, then
    rotated second elements: a fixed permutation applied to both q and k, which leaves q·k unchanged."""
    dtype = x.dtype
    x = x.float()
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)


def varlen_kernel(device: torch.device, dtype: torch.dtype) -> str | None:
    """The varlen flash kernel packed rows of this device and dtype run with, or None (SDPA with a mask)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    if flash_attn_varlen_func is not None:
        return "flash-attn varlen"
    return "torch varlen_attn" if varlen_attn is not None else None


@dataclass
class AttentionLayout:
    """How tokens of a batch may attend: plain causal rows, or several documents packed per row, given as the
    (B, 1, T, T) mask SDPA takes, or as cumulative document lengths for a varlen kernel (only what the
    kernel of this device and dtype uses is built, once per forward, before the first block)."""

    causal_only: bool
    mask: torch.Tensor | None = None  # (B, 1, T, T) bool, True = may attend
    cu_seqlens: torch.Tensor | None = None  # int32 document boundaries over the flattened batch
    max_seqlen: int = 0


_logged: set[str] = set()


def attention_layout(
    position_ids: torch.Tensor | None, batch: int, seq: int, device: torch.device, dtype: torch.dtype
) -> AttentionLayout:
    """A document starts wherever position_ids restart at 0 (and at every row start). Host syncs here (one
    check for plain rows; a varlen kernel's lengths) happen once per forward, never inside a block."""
    if position_ids is None:
        return AttentionLayout(causal_only=True)
    arange = torch.arange(seq, device=device)
    if bool((position_ids == arange).all()):
        return AttentionLayout(causal_only=True)
    starts = position_ids == 0
    starts[:, 0] = True
    kernel = varlen_kernel(device, dtype)
    path = kernel or "SDPA with a (B, 1, T, T) document mask"
    if path not in _logged:
        _logged.add(path)
        log.info("packed rows on %s/%s: %s", device.type, str(dtype).removeprefix("torch."), path)
    if kernel is None:
        doc = starts.cumsum(dim=1)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
        return AttentionLayout(
            causal_only=False, mask=((doc[:, :, None] == doc[:, None, :]) & causal).unsqueeze(1)
        )
    flat = starts.flatten().nonzero().flatten()
    cu = torch.cat([flat, flat.new_tensor([batch * seq])]).to(torch.int32)
    return AttentionLayout(causal_only=False, cu_seqlens=cu, max_seqlen=int((cu[1:] - cu[:-1]).max()))


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, layout: AttentionLayout
) -> torch.Tensor:
    """q, k: (B, T, H, Dqk); v: (B, T, H, Dv) -> (B, T, H, Dv)."""
    b, t, h, dv = v.shape
    if layout.cu_seqlens is not None:
        dqk = q.shape[-1]
        cu, longest = layout.cu_seqlens, layout.max_seqlen
        # The varlen kernels want one head dim for q, k and v: pad v and cut the padding off the output.
        v_pad = F.pad(v, (0, dqk - dv)) if dv < dqk else v
        qkv = [x.reshape(b * t, h, dqk) for x in (q, k, v_pad)]
        if flash_attn_varlen_func is not None:
            out = flash_attn_varlen_func(*qkv, cu, cu, longest, longest, softmax_scale=scale, causal=True)
        else:
            out = varlen_attn(*qkv, cu, cu, longest, longest, scale=scale, window_size=(-1, 0))
        return out[..., :dv].reshape(b, t, h, dv)
    dtype = q.dtype
    if q.device.type == "cpu":
        cdtype = compute_dtype(q)
        q, k, v = q.to(cdtype), k.to(cdtype), v.to(cdtype)
        if dv < q.shape[-1]:  # the CPU flash kernel needs one head dim; its math fallback is ~1.7x slower
            v = F.pad(v, (0, q.shape[-1] - dv))
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if layout.causal_only:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask, scale=scale)
    return out[..., :dv].transpose(1, 2).to(dtype)
