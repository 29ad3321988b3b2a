"""Rotary embedding (with YaRN) and the attention kernel, including document isolation for packed rows.

On the CPU attention runs as GEMMs over blocks of CPU_BLOCK_ROWS query rows (`_cpu_attention`), each against
only the keys up to its own last row (causal: about half the score FLOPs), as FlashAttention-2 does it: the
scores and d P in fp32 GEMMs (upcast q, k, v), P and d S rounded to the compute dtype for the other four
GEMMs; forward keeps the log-sum-exp, backward recomputes each block's scores. Nothing (T, T)-sized is
kept, nor built: packed documents are isolated by comparing per-row document ids within each block.
Against torch's CPU flash kernel (which also needs v padded to the q/k head dim), one layer's forward and
backward (8 x 512 tokens, 8 heads, head dims 96/64, 2 threads with AVX512-BF16) took 96 vs 127 ms in fp32
and 85 vs 107 ms in bf16, with errors against float64 no larger (tests/model/common/test_attention.py).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from dstrain.batch import PAD_POSITION, host_copy, host_to_device

from .kernels import compute_dtype, cuda_capability, gpu_kernels, triton_kernels

log = logging.getLogger(__name__)


@functools.cache
def varlen_kernels() -> tuple[Callable | None, Callable | None]:
    """(flash-attn's varlen function, torch's varlen_attn (2.13+)), None where missing: packed rows on CUDA run
    the first there is. Imported on first need: torch's module imports the compiler stack (1.2 s on a 2-core CPU),
    which commands that build no model (`dstrain plan`, `dstrain data`) never need."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as exc:  # pragma: no cover - not installed on CPU machines
        flash_attn_varlen_func = None
        if (
            importlib.util.find_spec("flash_attn") is not None
        ):  # installed but broken (a build for another torch)
            log.warning(
                "flash_attn is installed but does not import (%s): packed rows use torch's varlen kernel", exc
            )
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # pragma: no cover - torch < 2.10
        varlen_attn = None
    return flash_attn_varlen_func, varlen_attn


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(
    dim: int, base: float, yarn: dict | None, max_positions: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (fp32, dim/2) of `dim` rotary dims and the cos/sin multiplier; `yarn` None or
    YaRN's parameters (transformers' `_compute_yarn_parameters`)."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if yarn is None:
        return 1.0 / pos_freqs, 1.0
    orig = yarn.get("original_max_position_embeddings", max_positions)
    factor = yarn.get("factor") or max_positions / orig
    mscale, mscale_all_dim = yarn.get("mscale"), yarn.get("mscale_all_dim")
    attention_factor = yarn.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
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


def _varlen_reference(
    q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale=None, scale=None, causal=True, window_size=(-1, 0)
):  # noqa: ANN001, ANN202
    """The varlen kernels' signature on any device: each document of the flattened rows by causal SDPA (the
    CPU stand-in that lets the CUDA branch of `attend` run under DSTRAIN_KERNEL_POLICY=cuda)."""
    bounds = cu_q.tolist()
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    for s, e in zip(bounds[:-1], bounds[1:]):
        qd, kd, vd = (x[s:e].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=softmax_scale or scale)
        out[s:e] = o.squeeze(0).transpose(0, 1)
    return out


def varlen_kernel(device: torch.device, dtype: torch.dtype) -> str | None:
    """The varlen flash kernel packed rows of this device and dtype run with, or None (SDPA with a mask):
    bf16 / fp16 on a GPU with FlashAttention's (sm80 or newer)."""
    if (
        not gpu_kernels(device)
        or dtype not in (torch.bfloat16, torch.float16)
        or cuda_capability(device) < (8, 0)
    ):
        return None
    if device.type != "cuda":
        return "CPU reference of the varlen kernels (DSTRAIN_KERNEL_POLICY=cuda)"
    flash, torch_varlen = varlen_kernels()
    if flash is not None:
        return "flash-attn varlen"
    return "torch varlen_attn" if torch_varlen is not None else None


def attention_path(device: torch.device, dtype: torch.dtype, packed: bool) -> str:
    """What `attend` runs for rows of this device and dtype (packed: several documents per row)."""
    if not gpu_kernels(device):
        return "block attention" + (" with document ids" if packed else "") + " (dstrain's CPU kernel)"
    if not packed:
        return "causal SDPA"
    return varlen_kernel(device, dtype) or "SDPA with a (B, 1, T, T) document mask"


@dataclass
class AttentionLayout:
    """How tokens of a batch may attend: plain causal rows, or several documents packed per row, given as the
    (B, 1, T, T) mask SDPA takes, or as cumulative document lengths for a varlen kernel (only what the
    kernel of this device and dtype uses is built, once per forward, before the first block), and the
    document id of every position. One per forward: sparse attention keeps each layer's key selection here
    (GLM-5's shared layers read an earlier layer's) and its indexer's figures (a recomputed layer writes the
    same ones again)."""

    causal_only: bool
    mask: torch.Tensor | None = None  # (B, 1, T, T) bool, True = may attend: built where SDPA first needs it
    doc: torch.Tensor | None = None  # (B, T) document id of every position
    cu_seqlens: torch.Tensor | None = None  # int32 document boundaries over the flattened batch (GPU kernels)
    max_seqlen: int = 0  # the row length: a bound the varlen kernels take, the same for every batch
    selections: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (B, T, k) chosen keys
    stats: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> its indexer's figures
    real: torch.Tensor | None = None  # (B, T_local) bool: positions holding a token; None = all (batch.py)
    real_rows: torch.Tensor | None = None  # (B, T) bool: `real` of the whole rows (every SP rank's)


_logged: set[str] = set()


def attention_layout(
    position_ids: torch.Tensor | None, batch: int, seq: int, device: torch.device
) -> AttentionLayout:
    """A document starts wherever position_ids restart at 0 (and at every row start). What each kernel needs
    is built once per forward, before the first block, with its host reads (one check for plain rows; the
    document starts for the GPU kernels) from the batch's CPU copy where the trainer kept one
    (batch.host_copy; else host syncs): the document ids (the CPU kernel, sparse attention, and a mask
    built on first need), and on GPUs the varlen kernels' boundaries. Which kernel runs is decided in
    `attend`, from the activations' dtype, so that a pipeline stage without the embedding decides alike."""
    if position_ids is None:
        return AttentionLayout(causal_only=True)
    host = host_copy(position_ids)  # the batch's CPU copy (the trainer's): decided there, no device read
    if host is not None and (host.numpy() == np.arange(seq)).all():
        return AttentionLayout(causal_only=True)
    if host is None and bool((position_ids == torch.arange(seq, device=device)).all()):
        return AttentionLayout(causal_only=True)
    starts = position_ids == 0
    starts[:, 0] = True
    doc = starts.cumsum(dim=1)
    real = position_ids != PAD_POSITION
    if not gpu_kernels(device):
        return AttentionLayout(causal_only=False, doc=doc, real_rows=real)
    if host is not None:
        at = host.numpy() == 0
        at[:, 0] = True
        cu = torch.from_numpy(np.append(np.flatnonzero(at), batch * seq).astype(np.int32))
        cu = host_to_device(cu, device)
    else:
        flat = starts.flatten().nonzero().flatten()
        cu = torch.cat([flat, flat.new_tensor([batch * seq])]).to(torch.int32)
    torch._dynamo.maybe_mark_dynamic(cu, 0)  # the document count changes every batch: no recompile per count
    # max_seqlen: the row length bounds every document; a constant keeps torch.compile from recompiling per
    # batch (a new value each time), and needs no host read of the lengths
    return AttentionLayout(causal_only=False, doc=doc, cu_seqlens=cu, max_seqlen=seq, real_rows=real)


def _causal_mask(seq: int, device: torch.device, doc: torch.Tensor | None) -> torch.Tensor:
    """(B or 1, 1, T, T) bool: causal, within each document."""
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    if doc is None:
        return causal[None, None]
    return ((doc[:, :, None] == doc[:, None, :]) & causal).unsqueeze(1)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    layout: AttentionLayout,
    selection: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k: (B, T, H, Dqk); v: (B, T, H, Dv) -> (B, T, H, Dv). `selection` (B, T, k): the only keys each
    query may attend (sparse attention; besides the causal and document masks)."""
    b, t, h, dv = v.shape
    if selection is not None and selection.shape[-1] >= t:
        selection = None  # every key is chosen: dense
    path = attention_path(q.device, q.dtype, not layout.causal_only)
    # Said once per path, in eager code only: traced, the set is state Dynamo breaks the graph on (the log call)
    # and guards on (a second compile once it changes); a run's kernel line names the path anyway
    if not torch.compiler.is_compiling() and path not in _logged:
        _logged.add(path)
        log.info("attention on %s/%s: %s", q.device.type, str(q.dtype).removeprefix("torch."), path)
    kernel = varlen_kernel(q.device, q.dtype) if layout.cu_seqlens is not None and selection is None else None
    if kernel is not None:
        dqk = q.shape[-1]
        cu, longest = layout.cu_seqlens, layout.max_seqlen
        # The varlen kernels want one head dim for q, k and v: pad v and cut the padding off the output.
        v_pad = F.pad(v, (0, dqk - dv)) if dv < dqk else v
        qkv = [x.reshape(b * t, h, dqk) for x in (q, k, v_pad)]
        flash, torch_varlen = varlen_kernels() if q.device.type == "cuda" else (None, None)
        if q.device.type != "cuda":
            out = _varlen_reference(*qkv, cu, cu, longest, longest, softmax_scale=scale, causal=True)
        elif flash is not None:
            out = flash(*qkv, cu, cu, longest, longest, softmax_scale=scale, causal=True)
        else:
            out = torch_varlen(*qkv, cu, cu, longest, longest, scale=scale, window_size=(-1, 0))
        return out[..., :dv].reshape(b, t, h, dv)
    if not gpu_kernels(q.device):
        # (B, T, H, d) -> (B * H, T, d) rows in the compute dtype (see kernels.compute_dtype)
        cdtype = compute_dtype(q)
        rows = [x.to(cdtype).transpose(1, 2).reshape(b * h, t, -1) for x in (q, k, v)]
        out = _cpu_attention(*rows, scale, layout.doc, selection)[0]
        return out.view(b, h, t, dv).transpose(1, 2).to(q.dtype)
    if selection is not None and triton_kernels(q.device, q.dtype):
        from .dsa_kernels import sparse_attend  # imports Triton: only where it runs

        return sparse_attend(q, k, v, scale, selection, layout.doc)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if layout.causal_only and selection is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(1, 2)
    if layout.mask is None:  # built once per forward, by the first layer that needs it
        layout.mask = _causal_mask(t, q.device, layout.doc)
    mask = layout.mask
    if selection is not None:  # no Triton: SDPA over a (B, 1, T, T) mask of the chosen keys
        chosen = torch.zeros(b, t, t, dtype=torch.bool, device=q.device).scatter_(-1, selection, True)
        mask = mask & chosen.unsqueeze(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)


CPU_BLOCK_ROWS = 64  # query rows per block: 64 ran faster than 128 or 256 at T 512 (fp32 and bf16)
# Sparse attention: a block whose rows' chosen keys together cover more than this share of its causal keys
# runs against all of them, masked (launch/bench_dsa.py).
UNION_DENSE = 0.6


def _blocks(t: int) -> list[tuple[int, int]]:
    return [(s, min(s + CPU_BLOCK_ROWS, t)) for s in range(0, t, CPU_BLOCK_ROWS)]


def _block_scores(
    qf: torch.Tensor,
    kf: torch.Tensor,
    s: int,
    e: int,
    scale: float,
    doc: torch.Tensor | None,
    sel: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 scaled scores (N, e - s, keys) of query rows s:e, -inf where a row may not attend: later keys
    (within the block's own diagonal square), with `doc` (B, T) other documents, with `sel` (B, T, k) the
    keys not chosen. -> (scores, the key indices scored: None for all of :e, else the block's chosen keys)."""
    if sel is not None:
        b = sel.shape[0]
        allowed = torch.zeros(b, e - s, e, dtype=torch.bool, device=qf.device)
        allowed.scatter_(
            -1, sel[:, s:e].clamp(max=e - 1), True
        )  # a later key clamped to e - 1 is masked anyway
        allowed &= torch.ones(e - s, e, dtype=torch.bool, device=qf.device).tril_(diagonal=s)
        if doc is not None:
            allowed &= doc[:, s:e, None] == doc[:, None, :e]
        keys = allowed.any(dim=0).any(dim=0).nonzero().flatten()  # the block's keys, shared by its rows
        if keys.numel() > UNION_DENSE * e:  # scattered choices: gathering them costs more than it saves
            keys, cols = None, slice(0, e)
        else:
            cols, allowed = keys, allowed[:, :, keys]
        scores = torch.bmm(qf[:, s:e], kf[:, cols].transpose(1, 2)).mul_(scale)
        scores.view(b, -1, e - s, scores.shape[-1]).masked_fill_(~allowed.unsqueeze(1), float("-inf"))
        return scores, keys
    scores = torch.bmm(qf[:, s:e], kf[:, :e].transpose(1, 2)).mul_(scale)
    past = torch.ones(e - s, e - s, dtype=torch.bool, device=qf.device).tril_()
    if doc is None:
        scores[:, :, s:e].masked_fill_(~past, float("-inf"))
        return scores, None
    allowed = doc[:, s:e, None] == doc[:, None, :e]  # (B, e - s, e)
    allowed[:, :, s:e] &= past
    b = doc.shape[0]
    scores.view(b, -1, e - s, e).masked_fill_(~allowed.unsqueeze(1), float("-inf"))
    return scores, None


# Custom ops rather than an autograd.Function: torch.compile calls them as they are instead of unrolling the
# loop over blocks (a graph growing with T / CPU_BLOCK_ROWS, and its compile time with it).
@torch.library.custom_op("dstrain::cpu_attention", mutates_args=())
def _cpu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    doc: torch.Tensor | None,
    sel: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over (N, T, d) rows of one dtype (see the top) -> (output, fp32 log-sum-exp (N, T)).
    Every row attends at least itself, so no row is empty. With `sel` (B, T, k) (sparse attention), a block
    of rows runs against the union of its rows' chosen keys, each row masked to its own."""
    n, t, _ = q.shape
    qf, kf = q.float(), k.float()
    out = v.new_empty(n, t, v.shape[-1])
    lse = qf.new_empty(n, t)
    for s, e in _blocks(t):
        p, keys = _block_scores(qf, kf, s, e, scale, doc, sel)
        lse[:, s:e] = m = torch.logsumexp(p, dim=-1)
        p = p.sub_(m.unsqueeze(-1)).exp_()
        out[:, s:e] = torch.bmm(p.to(v.dtype), v[:, :e] if keys is None else v[:, keys])
    return out, lse


@_cpu_attention.register_fake
def _(q, k, v, scale, doc, sel):  # noqa: ANN001, ANN202
    return v.new_empty(*q.shape[:2], v.shape[-1]), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("dstrain::cpu_attention_backward", mutates_args=())
def _cpu_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    doc: torch.Tensor | None,
    sel: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    low = q.dtype
    dout = dout.contiguous()
    qf, kf, vf, doutf = q.float(), k.float(), v.float(), dout.float()
    delta = (doutf * out.float()).sum(-1)  # rowsum(dO * O) = rowsum(P * dP)
    dq = torch.empty_like(q)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)  # summed over blocks in fp32
    for s, e in _blocks(q.shape[1]):
        p, keys = _block_scores(qf, kf, s, e, scale, doc, sel)
        p = p.sub_(lse[:, s:e].unsqueeze(-1)).exp_()
        cols = slice(0, e) if keys is None else keys
        dv_block = torch.bmm(p.transpose(1, 2).to(low), dout[:, s:e])
        dp = torch.bmm(doutf[:, s:e], vf[:, cols].transpose(1, 2))
        ds = dp.sub_(delta[:, s:e].unsqueeze(-1)).mul_(p).mul_(scale).to(low)
        dq[:, s:e] = torch.bmm(ds, k[:, cols])
        dk_block = torch.bmm(ds.transpose(1, 2), q[:, s:e])
        if keys is None:
            dv[:, :e] += dv_block
            dk[:, :e] += dk_block
        else:
            dv.index_add_(1, keys, dv_block.float())
            dk.index_add_(1, keys, dk_block.float())
    return dq, dk.to(low), dv.to(low)


@_cpu_attention_backward.register_fake
def _(dout, q, k, v, out, lse, scale, doc, sel):  # noqa: ANN001, ANN202
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:  # noqa: ANN001
    q, k, v, scale, doc, sel = inputs
    ctx.scale = scale
    ctx.save_for_backward(q, k, v, *output, doc, sel)


def _backward(ctx, dout, _dlse):  # noqa: ANN001, ANN202
    q, k, v, out, lse, doc, sel = ctx.saved_tensors
    return *_cpu_attention_backward(dout, q, k, v, out, lse, ctx.scale, doc, sel), None, None, None


_cpu_attention.register_autograd(_backward, setup_context=_setup)
