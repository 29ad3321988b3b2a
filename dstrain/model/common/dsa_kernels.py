"""Triton kernels of DeepSeek Sparse Attention: attention over each query's selected keys (attention.attend
with a selection); the indexer's are in index_kernels.py. The torch code they replace stays the CPU kernel and
the oracle the tests hold them to (tests/model/common/test_dsa_kernels.py, run by Triton's interpreter).

`sparse_attend`: one program per (query, block of heads) walks the query's chosen keys in blocks of
SPARSE_KEYS with an online softmax in fp32 and keeps the log-sum-exp; backward recomputes the probabilities
twice, for dq walking each query's keys, for dk and dv walking each key's queries (the selection transposed by
one sort): no atomics, deterministic. Cost and memory grow with T x k; nothing (T, T)-sized. (Atomics per
key, head and dim instead ran 17x slower than the forward on an H100.) Repeated, later (causal) and other
documents' keys are set to -1 beforehand (`usable_keys`, (B, T, k) int32, sorted per row so that repeats are
adjacent), and the kernels skip them. Optionally the forward also writes the head-summed probabilities over
the chosen keys with a second sweep: the sparse stage's KL target (`sparse_attend` with `target`, dsa.sparse_kl),
so that nothing recomputes the main attention's scores for the indexer. Offsets
are int32: B x T x k < 2^31 (a 64K row with top-k 2048 is 2^27).

Imported only where kernels.triton_kernels holds: Triton installed, and a CUDA tensor or TRITON_INTERPRET=1
(Triton's CPU interpreter, chosen when Triton is first imported: set it before the process starts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPARSE_KEYS = 16  # chosen keys per step of the sparse kernels


def pow2(n: int) -> int:
    """A power-of-two block width covering n (at least 16: tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(n))


def _heads_block(h: int) -> int:
    return min(triton.next_power_of_2(h), 16)


# ---- sparse attention ---------------------------------------------------------------------------------------


@triton.jit
def _row(base, heads, hmask, stride_h, dims, DP: tl.constexpr):
    """(heads, DP) fp32: one position's rows for a block of heads (masked: 0)."""
    d = tl.arange(0, DP)
    mask = hmask[:, None] & (d < dims)[None, :]
    return tl.load(base + heads[:, None] * stride_h + d[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _gather(base, idx, ok, heads, hmask, stride_t, stride_h, dims, DP: tl.constexpr):
    """(heads, keys, DP) fp32 rows of the keys `idx` (masked: 0)."""
    d = tl.arange(0, DP)
    ptr = base + idx[None, :, None] * stride_t + heads[:, None, None] * stride_h + d[None, None, :]
    mask = ok[None, :, None] & hmask[:, None, None] & (d < dims)[None, None, :]
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _chosen(K, KEYS, bt, j0, NSEL, q, heads, hmask, stride_t, stride_h, D, scale, BK: tl.constexpr,
            DP: tl.constexpr):  # fmt: skip
    """Keys j0 : j0 + BK of query `bt`'s chosen ones: (their positions j, indices, which are usable, their
    (heads, BK, DP) fp32 rows, the scaled scores q . k (heads, BK))."""
    j = j0 + tl.arange(0, BK)
    idx = tl.load(KEYS + bt * NSEL + j, mask=j < NSEL, other=-1)
    ok = idx >= 0
    k = _gather(K, idx, ok, heads, hmask, stride_t, stride_h, D, DP)
    return j, idx, ok, k, tl.sum(q[:, None, :] * k, axis=2) * scale


@triton.jit
def _sparse_fwd(
    Q, K, V, KEYS, OUT, LSE, PSUM,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, so_b, so_t, so_h,
    T, H, NSEL, D, DV, scale,
    BH: tl.constexpr, BK: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr, TARGET: tl.constexpr,
):  # fmt: skip
    bt = tl.program_id(0)
    b = bt // T
    t = bt % T
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < H
    dv = tl.arange(0, DVP)
    q = _row(Q + b * sq_b + t * sq_t, heads, hmask, sq_h, D, DP)
    m = tl.full((BH,), float("-inf"), tl.float32)
    m_safe = tl.zeros((BH,), tl.float32)
    total = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, DVP), tl.float32)
    for j0 in range(0, NSEL, BK):
        _, idx, ok, _, s = _chosen(
            K + b * sk_b, KEYS, bt, j0, NSEL, q, heads, hmask, sk_t, sk_h, D, scale, BK, DP
        )
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: nothing to rescale
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = _gather(V + b * sv_b, idx, ok, heads, hmask, sv_t, sv_h, DV, DVP)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v, axis=1)
        m = m_new
    seen = total > 0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    lse = tl.where(seen, m_safe + tl.log(tl.where(seen, total, 1.0)), 0.0)
    tl.store(OUT + b * so_b + t * so_t + heads[:, None] * so_h + dv[None, :], out.to(OUT.dtype.element_ty),
             mask=hmask[:, None] & (dv < DV)[None, :])  # fmt: skip
    tl.store(LSE + bt * H + heads, lse, mask=hmask)
    if TARGET:  # the head-summed probabilities of the chosen keys, with the final log-sum-exp
        for j0 in range(0, NSEL, BK):
            j, _, ok, _, s = _chosen(
                K + b * sk_b, KEYS, bt, j0, NSEL, q, heads, hmask, sk_t, sk_h, D, scale, BK, DP
            )
            p = tl.where(ok[None, :] & hmask[:, None], tl.exp(s - lse[:, None]), 0.0)
            tl.atomic_add(PSUM + bt * NSEL + j, tl.sum(p, axis=0), mask=j < NSEL)


@triton.jit
def _sparse_dq(
    Q, K, V, KEYS, DO, LSE, DELTA, DQ,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sd_b, sd_t, sd_h,
    T, H, NSEL, D, DVD, scale,
    BH: tl.constexpr, BK: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
):  # fmt: skip
    """dq of one query (a block of heads): its chosen keys walked as in the forward."""
    bt = tl.program_id(0)
    b = bt // T
    t = bt % T
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < H
    d = tl.arange(0, DP)
    qmask = hmask[:, None] & (d < D)[None, :]
    q = _row(Q + b * sq_b + t * sq_t, heads, hmask, sq_h, D, DP)
    do = _row(DO + b * sd_b + t * sd_t, heads, hmask, sd_h, DVD, DVP)
    lse = tl.load(LSE + bt * H + heads, mask=hmask, other=0.0)
    delta = tl.load(DELTA + bt * H + heads, mask=hmask, other=0.0)
    dq = tl.zeros((BH, DP), tl.float32)
    for j0 in range(0, NSEL, BK):
        _, idx, ok, k, s = _chosen(
            K + b * sk_b, KEYS, bt, j0, NSEL, q, heads, hmask, sk_t, sk_h, D, scale, BK, DP
        )
        v = _gather(V + b * sv_b, idx, ok, heads, hmask, sv_t, sv_h, DVD, DVP)
        p = tl.where(ok[None, :] & hmask[:, None], tl.exp(s - lse[:, None]), 0.0)
        ds = p * (tl.sum(do[:, None, :] * v, axis=2) - delta[:, None]) * scale
        dq += tl.sum(ds[:, :, None] * k, axis=1)
    tl.store(DQ + (bt * H + heads[:, None]) * D + d[None, :], dq, mask=qmask)


@triton.jit
def _sparse_dkv(
    Q, K, V, STARTS, QUERIES, DO, LSE, DELTA, DK, DV,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sd_b, sd_t, sd_h,
    T, H, D, DVD, scale,
    BH: tl.constexpr, BQ: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
):  # fmt: skip
    """dk and dv of one key (a block of heads): the queries that chose it, QUERIES[STARTS[u]:STARTS[u + 1]]
    (the selection transposed), walked in blocks of BQ. No atomics: each key is one program's."""
    bu = tl.program_id(0)
    b = bu // T
    u = bu % T
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < H
    d = tl.arange(0, DP)
    dv = tl.arange(0, DVP)
    kmask = hmask[:, None] & (d < D)[None, :]
    vmask = hmask[:, None] & (dv < DVD)[None, :]
    k = _row(K + b * sk_b + u * sk_t, heads, hmask, sk_h, D, DP)
    v = _row(V + b * sv_b + u * sv_t, heads, hmask, sv_h, DVD, DVP)
    dk = tl.zeros((BH, DP), tl.float32)
    dvv = tl.zeros((BH, DVP), tl.float32)
    lo = tl.load(STARTS + bu)
    hi = tl.load(STARTS + bu + 1)
    for i0 in range(lo, hi, BQ):
        i = i0 + tl.arange(0, BQ)
        ok = i < hi
        tq = tl.load(QUERIES + i, mask=ok, other=0)
        q = _gather(Q + b * sq_b, tq, ok, heads, hmask, sq_t, sq_h, D, DP)
        do = _gather(DO + b * sd_b, tq, ok, heads, hmask, sd_t, sd_h, DVD, DVP)
        rows = (b * T + tq)[None, :] * H + heads[:, None]
        rmask = ok[None, :] & hmask[:, None]
        lse = tl.load(LSE + rows, mask=rmask, other=0.0)
        delta = tl.load(DELTA + rows, mask=rmask, other=0.0)
        s = tl.sum(q * k[:, None, :], axis=2) * scale  # (BH, BQ)
        p = tl.where(rmask, tl.exp(s - lse), 0.0)
        ds = p * (tl.sum(do * v[:, None, :], axis=2) - delta) * scale
        dk += tl.sum(ds[:, :, None] * q, axis=1)
        dvv += tl.sum(p[:, :, None] * do, axis=1)
    tl.store(DK + (bu * H + heads[:, None]) * D + d[None, :], dk, mask=kmask)
    tl.store(DV + (bu * H + heads[:, None]) * DVD + dv[None, :], dvv, mask=vmask)


def usable_keys(selection: torch.Tensor, doc: torch.Tensor | None) -> torch.Tensor:
    """(B, T, k) int32: each row's chosen keys in ascending order, -1 for a repeat, a later key (causal) and a
    key of another document: the keys the sparse kernels attend."""
    keys = selection.sort(dim=-1).values
    t = keys.shape[1]
    drop = keys > torch.arange(t, device=keys.device).view(1, t, 1)
    drop[..., 1:] |= keys[..., 1:] == keys[..., :-1]
    if doc is not None:
        drop |= doc.gather(1, keys.flatten(1).clamp(max=t - 1)).view_as(keys) != doc.unsqueeze(-1)
    return keys.masked_fill(drop, -1).to(torch.int32)


def _launch_shape(q: torch.Tensor, v: torch.Tensor) -> tuple[tuple[int, int], dict]:
    b, t, h, d = q.shape
    bh = _heads_block(h)
    meta = dict(BH=bh, BK=SPARSE_KEYS, DP=pow2(d), DVP=pow2(v.shape[-1]))
    return (b * t, triton.cdiv(h, bh)), meta


def sparse_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, scale: float, target: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """-> (output (B, T, H, Dv) in v's dtype, fp32 log-sum-exp (B, T, H), with `target` the fp32 (B, T, k)
    probabilities of the `keys` (usable_keys) summed over the heads). q, k, v: last dim contiguous; k and v may
    be expanded over heads (stride 0: MLA's shared key)."""
    b, t, h, d = q.shape
    nsel = keys.shape[-1]
    out = torch.empty(b, t, h, v.shape[-1], dtype=v.dtype, device=q.device)
    lse = torch.empty(b, t, h, dtype=torch.float32, device=q.device)
    psum = torch.zeros(b, t, nsel, dtype=torch.float32, device=q.device) if target else lse
    grid, meta = _launch_shape(q, v)
    _sparse_fwd[grid](q, k, v, keys, out, lse, psum, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                      *out.stride()[:3], t, h, nsel, d, v.shape[-1], scale, TARGET=target, **meta)  # fmt: skip
    return out, lse, psum if target else None


def transposed(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection by key: (starts (B * T + 1,) int32, queries (B * T * k,) int32) where the queries whose usable
    keys include key u of row b are queries[starts[b * T + u]:starts[b * T + u + 1]], in ascending order."""
    b, t, nsel = keys.shape
    flat = keys.flatten().long()
    row = torch.arange(b, device=keys.device).repeat_interleave(t * nsel) * t
    owner = torch.where(flat >= 0, row + flat, b * t)  # unusable entries sort last, past every key
    owner, order = owner.sort(stable=True)
    counts = torch.bincount(owner, minlength=b * t + 1)[: b * t]
    starts = torch.zeros(b * t + 1, dtype=torch.int64, device=keys.device)
    starts[1:] = counts.cumsum(0)
    queries = (order // nsel % t).to(torch.int32)  # past starts[-1]: unusable entries, never read (no sync)
    return starts.to(torch.int32), queries


def sparse_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq by walking each query's keys, dk and dv by walking each key's queries (`transposed`): no atomics,
    the same bits every run."""
    b, t, h, d = q.shape
    dvd = v.shape[-1]
    dout = dout.contiguous()
    delta = (dout.float() * out.float()).sum(-1)  # rowsum(dO * O) = rowsum(P * dP)
    dq = torch.empty(b, t, h, d, dtype=torch.float32, device=q.device)
    dk = torch.empty(b, t, h, d, dtype=torch.float32, device=q.device)
    dv = torch.empty(b, t, h, dvd, dtype=torch.float32, device=q.device)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3])
    grid, meta = _launch_shape(q, v)
    _sparse_dq[grid](
        q, k, v, keys, dout, lse, delta, dq, *strides, t, h, keys.shape[-1], d, dvd, scale, **meta
    )
    starts, queries = transposed(keys)
    meta["BQ"] = meta.pop("BK")
    _sparse_dkv[grid](
        q, k, v, starts, queries, dout, lse, delta, dk, dv, *strides, t, h, d, dvd, scale, **meta
    )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class SparseAttention(torch.autograd.Function):
    """-> the output, and with `target` the head-summed probabilities of the keys too (no gradient)."""

    @staticmethod
    def forward(ctx, q, k, v, keys, scale, target=False):  # noqa: ANN001, ANN205
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        out, lse, psum = sparse_forward(q, k, v, keys, scale, target)
        ctx.save_for_backward(q, k, v, out, lse, keys)
        ctx.scale = scale
        if psum is None:
            return out
        ctx.mark_non_differentiable(psum)
        return out, psum

    @staticmethod
    def backward(ctx, dout, *_):  # noqa: ANN001, ANN205
        q, k, v, out, lse, keys = ctx.saved_tensors
        return *sparse_backward(dout, q, k, v, out, lse, keys, ctx.scale), None, None, None


def sparse_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    selection: torch.Tensor,
    doc: torch.Tensor | None,
    target: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attention.attend with a selection: q, k (B, T, H, Dqk), v (B, T, H, Dv), selection (B, T, k) -> the
    output; with `target` also the sparse stage's KL target from the same pass: -> (output, fp32 (B, T, k)
    every head's probability of each usable key summed, the usable keys (usable_keys: -1 where none))."""
    keys = usable_keys(selection, doc)
    if not target:
        return SparseAttention.apply(q, k, v, keys, scale)
    out, psum = SparseAttention.apply(q, k, v, keys, scale, True)
    return out, psum, keys
