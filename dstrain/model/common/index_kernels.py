"""Triton kernels of the lightning indexer (dsa.index_pass): its scores and their gradient. The torch code they
replace stays the CPU kernel and the oracle (tests/model/common/test_dsa_kernels.py).

`index_scores`: one program per (row, block of INDEX_ROWS query rows, block of INDEX_KEYS keys) computes
I = sum_h w_h ReLU(scale q_h . k) with one GEMM per head reduced in registers (nothing per head is written),
causal and document masks -> -inf. `index_score_grads` recomputes the per-head scores twice: dq and dw by
(rows, head) walking the keys, dk by key tile walking rows and heads; no atomics. Top-k stays torch.topk over
dsa._ordered's int64 keys of these scores: exact, with the tie rule. `head_probs`: the dense stage's KL target,
the main attention's probabilities summed over its heads, per (B, rows, keys) block: each head's log-sum-exp
(one program per row tile and head, walking key tiles), then the heads' probabilities summed in registers (one
program per tile). Imported only where kernels.triton_kernels holds (see dsa_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dsa_kernels import pow2

INDEX_ROWS, INDEX_KEYS = 16, 32  # query rows x keys per tile


@triton.jit
def _visible(DOC, b, rows, cols, rmask, cmask, T, HAS_DOC: tl.constexpr):
    """(rows, cols) bool: the query rows may see the keys (causal, same document, in range)."""
    ok = (cols[None, :] <= rows[:, None]) & rmask[:, None] & cmask[None, :]
    if HAS_DOC:
        dr = tl.load(DOC + b * T + rows, mask=rmask, other=-1)
        dc = tl.load(DOC + b * T + cols, mask=cmask, other=-2)
        ok = ok & (dr[:, None] == dc[None, :])
    return ok


@triton.jit
def _index_fwd(
    Q, K, W, DOC, OUT,
    sq_b, sq_t, sq_h, sk_b, sk_t, sw_b, sw_t, so_b, so_t,
    T, S, E, H, D, scale,
    HAS_DOC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """OUT[b, r, u] = I[b, S + r, u] for keys u < E, -inf where query S + r may not see key u."""
    b = tl.program_id(0)
    rows = S + tl.program_id(1) * BM + tl.arange(0, BM)
    cols = tl.program_id(2) * BN + tl.arange(0, BN)
    rmask, cmask = rows < E, cols < E
    d = tl.arange(0, DP)
    dmask = d < D
    kt = tl.load(K + b * sk_b + cols[None, :] * sk_t + d[:, None], mask=cmask[None, :] & dmask[:, None],
                 other=0.0)  # fmt: skip
    acc = tl.zeros((BM, BN), tl.float32)
    for h in range(H):
        qh = tl.load(Q + b * sq_b + rows[:, None] * sq_t + h * sq_h + d[None, :],
                     mask=rmask[:, None] & dmask[None, :], other=0.0)  # fmt: skip
        wh = tl.load(W + b * sw_b + rows * sw_t + h, mask=rmask, other=0.0)
        if IEEE:
            raw = tl.dot(qh, kt, input_precision="ieee")
        else:
            raw = tl.dot(qh, kt)
        acc += wh[:, None] * tl.maximum(raw * scale, 0.0)
    ok = _visible(DOC, b, rows, cols, rmask, cmask, T, HAS_DOC)
    tl.store(OUT + b * so_b + (rows - S)[:, None] * so_t + cols[None, :], tl.where(ok, acc, float("-inf")),
             mask=rmask[:, None] & cmask[None, :])  # fmt: skip


@triton.jit
def _index_tile(Q, K, W, COLS, DI, b, rows, r, n, h, sq_b, sq_t, sq_h, sk_b, sk_t, sw_b, sw_t, sd_b, sd_t, E, N, D,
                scale, DP: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """One head's tile: (q_h of the rows, the keys, d raw = d I * w_h * scale where the score was > 0, act)."""
    d = tl.arange(0, DP)
    rmask, nmask, dmask = rows < E, n < N, d < D
    cols = tl.load(COLS + n, mask=nmask, other=0)
    k = tl.load(K + b * sk_b + cols[:, None] * sk_t + d[None, :], mask=nmask[:, None] & dmask[None, :],
                other=0.0)  # fmt: skip
    qh = tl.load(Q + b * sq_b + rows[:, None] * sq_t + h * sq_h + d[None, :],
                 mask=rmask[:, None] & dmask[None, :], other=0.0)  # fmt: skip
    wh = tl.load(W + b * sw_b + rows * sw_t + h, mask=rmask, other=0.0)
    di = tl.load(DI + b * sd_b + r[:, None] * sd_t + n[None, :], mask=rmask[:, None] & nmask[None, :],
                 other=0.0)  # fmt: skip
    if IEEE:
        raw = tl.dot(qh, tl.trans(k), input_precision="ieee") * scale
    else:
        raw = tl.dot(qh, tl.trans(k)) * scale
    draw = tl.where(raw > 0, di * wh[:, None] * scale, 0.0)
    return qh, k, draw, tl.maximum(raw, 0.0) * di


@triton.jit
def _index_dq(
    Q, K, W, COLS, DI, DQ, DW,
    sq_b, sq_t, sq_h, sk_b, sk_t, sw_b, sw_t, sd_b, sd_t,
    S, E, N, H, D, scale,
    BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """DQ[b, r, h] and DW[b, r, h] (fp32) of one head and BM rows, from DI[b, r, n] = d loss / d I[S + r,
    COLS[n]], walking the keys."""
    b = tl.program_id(0)
    r = tl.program_id(1) * BM + tl.arange(0, BM)
    h = tl.program_id(2)
    rows = S + r
    d = tl.arange(0, DP)
    dq = tl.zeros((BM, DP), tl.float32)
    dw = tl.zeros((BM,), tl.float32)
    for n0 in range(0, N, BN):
        n = n0 + tl.arange(0, BN)
        qh, k, draw, wgrad = _index_tile(Q, K, W, COLS, DI, b, rows, r, n, h, sq_b, sq_t, sq_h, sk_b, sk_t, sw_b,
                                         sw_t, sd_b, sd_t, E, N, D, scale, DP, IEEE)  # fmt: skip
        dw += tl.sum(wgrad, axis=1)
        if IEEE:
            dq += tl.dot(draw, k, input_precision="ieee")
        else:  # bf16 / fp16 GEMMs with fp32 accumulation, d raw rounded as FlashAttention-2 rounds dS
            dq += tl.dot(draw.to(k.dtype), k)
    rmask = rows < E
    tl.store(
        DQ + ((b * (E - S) + r[:, None]) * H + h) * D + d[None, :], dq, mask=rmask[:, None] & (d < D)[None, :]
    )
    tl.store(DW + (b * (E - S) + r) * H + h, dw, mask=rmask)


@triton.jit
def _index_dk(
    Q, K, W, COLS, DI, DK,
    sq_b, sq_t, sq_h, sk_b, sk_t, sw_b, sw_t, sd_b, sd_t,
    T, S, E, N, H, D, scale,
    BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """DK[b, COLS[n]] += (fp32) the block's rows' and heads' share, for BN keys, walking rows and heads: one
    program per key tile, so no two programs write a key (COLS holds distinct keys)."""
    b = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    d = tl.arange(0, DP)
    dk = tl.zeros((BN, DP), tl.float32)
    for r0 in range(0, E - S, BM):
        r = r0 + tl.arange(0, BM)
        for h in range(H):
            qh, k, draw, wgrad = _index_tile(Q, K, W, COLS, DI, b, S + r, r, n, h, sq_b, sq_t, sq_h, sk_b, sk_t,
                                             sw_b, sw_t, sd_b, sd_t, E, N, D, scale, DP, IEEE)  # fmt: skip
            if IEEE:
                dk += tl.dot(tl.trans(draw), qh, input_precision="ieee")
            else:
                dk += tl.dot(tl.trans(draw.to(qh.dtype)), qh)
    nmask = n < N
    cols = tl.load(COLS + n, mask=nmask, other=0)
    ptr = DK + (b * T + cols[:, None]) * D + d[None, :]
    mask = nmask[:, None] & (d < D)[None, :]
    tl.store(ptr, tl.load(ptr, mask=mask, other=0.0) + dk, mask=mask)


@triton.jit
def _head_tile(Q, K, DOC, b, rows, cols, h, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, T, E, D, scale, HAS_DOC: tl.constexpr,
               DP: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """One head's scaled scores of the rows against the keys `cols`, -inf where a row may not see a key."""
    d = tl.arange(0, DP)
    rmask, cmask, dmask = rows < E, cols < E, d < D
    qh = tl.load(Q + b * sq_b + rows[:, None] * sq_t + h * sq_h + d[None, :], mask=rmask[:, None] & dmask[None, :],
                 other=0.0)  # fmt: skip
    kt = tl.load(K + b * sk_b + cols[None, :] * sk_t + h * sk_h + d[:, None], mask=cmask[None, :] & dmask[:, None],
                 other=0.0)  # fmt: skip
    if IEEE:
        raw = tl.dot(qh, kt, input_precision="ieee") * scale
    else:
        raw = tl.dot(qh, kt) * scale
    return tl.where(_visible(DOC, b, rows, cols, rmask, cmask, T, HAS_DOC), raw, float("-inf"))


@triton.jit
def _head_lse(
    Q, K, DOC, LSE,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h,
    T, S, E, H, D, scale,
    HAS_DOC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """LSE[b, r, h] (fp32): head h's log-sum-exp of row S + r over the keys it may see (online, in key tiles)."""
    b = tl.program_id(0)
    r = tl.program_id(1) * BM + tl.arange(0, BM)
    h = tl.program_id(2)
    m = tl.full((BM,), float("-inf"), tl.float32)
    total = tl.zeros((BM,), tl.float32)
    for n0 in range(0, E, BN):
        s = _head_tile(Q, K, DOC, b, S + r, n0 + tl.arange(0, BN), h, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, T, E, D,
                       scale, HAS_DOC, DP, IEEE)  # fmt: skip
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp(m - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
        m = m_new
    lse = tl.where(total > 0, m + tl.log(tl.where(total > 0, total, 1.0)), float("inf"))  # inf: no key, p = 0
    tl.store(LSE + (b * (E - S) + r) * H + h, lse, mask=S + r < E)


@triton.jit
def _head_probs(
    Q, K, DOC, LSE, OUT,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h,
    T, S, E, H, D, scale,
    HAS_DOC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """OUT[b, r, u] = sum over heads of softmax_h(row S + r)[u], for keys u < E (0 where unseen): the heads'
    sum reduced in registers, nothing per head written."""
    b = tl.program_id(0)
    r = tl.program_id(1) * BM + tl.arange(0, BM)
    cols = tl.program_id(2) * BN + tl.arange(0, BN)
    rmask = S + r < E
    acc = tl.zeros((BM, BN), tl.float32)
    for h in range(H):
        s = _head_tile(Q, K, DOC, b, S + r, cols, h, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, T, E, D, scale, HAS_DOC,
                       DP, IEEE)  # fmt: skip
        lse = tl.load(LSE + (b * (E - S) + r) * H + h, mask=rmask, other=float("inf"))
        acc += tl.exp(s - lse[:, None])
    tl.store(
        OUT + (b * (E - S) + r[:, None]) * E + cols[None, :], acc, mask=rmask[:, None] & (cols < E)[None, :]
    )


def _index_meta(q: torch.Tensor) -> dict:
    return dict(BM=INDEX_ROWS, BN=INDEX_KEYS, DP=pow2(q.shape[-1]), IEEE=q.dtype == torch.float32)


def index_scores(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, s: int, e: int, doc: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """(B, e - s, e) fp32 index scores of query rows s:e against keys :e (dsa.index_pass's block), -inf where
    masked. q (B, T, heads, dim) and k (B, T, dim) of one dtype (last dim contiguous), w (B, T, heads) fp32."""
    b, t, h, d = q.shape
    out = torch.empty(b, e - s, e, dtype=torch.float32, device=q.device)
    docs = doc.contiguous() if doc is not None else out
    grid = (b, triton.cdiv(e - s, INDEX_ROWS), triton.cdiv(e, INDEX_KEYS))
    _index_fwd[grid](q, k, w, docs, out, *q.stride()[:3], *k.stride()[:2], *w.stride()[:2], *out.stride()[:2],
                     t, s, e, h, d, scale, HAS_DOC=doc is not None, **_index_meta(q))  # fmt: skip
    return out


def index_score_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    s: int,
    e: int,
    cols: torch.Tensor,
    d_index: torch.Tensor,
    scale: float,
    dk: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain from d_index (B, e - s, n) fp32 = d loss / d I[s:e, cols] (0 off the support) to the indexer:
    -> (dq (B, e - s, heads, dim), dw (B, e - s, heads)) fp32 of the rows; dk (B, T, dim) fp32 += the keys'."""
    b, t, h, d = q.shape
    n = cols.numel()
    dq = torch.empty(b, e - s, h, d, dtype=torch.float32, device=q.device)
    dw = torch.empty(b, e - s, h, dtype=torch.float32, device=q.device)
    d_index = d_index.float().contiguous()
    cols = cols.to(torch.int32).contiguous()
    strides = (*q.stride()[:3], *k.stride()[:2], *w.stride()[:2], *d_index.stride()[:2])
    meta = _index_meta(q)
    _index_dq[(b, triton.cdiv(e - s, INDEX_ROWS), h)](q, k, w, cols, d_index, dq, dw, *strides, s, e, n, h, d,
                                                      scale, **meta)  # fmt: skip
    _index_dk[(b, triton.cdiv(n, INDEX_KEYS))](q, k, w, cols, d_index, dk, *strides, t, s, e, n, h, d, scale,
                                               **meta)  # fmt: skip
    return dq, dw


def head_probs(
    q: torch.Tensor, k: torch.Tensor, s: int, e: int, doc: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """(B, e - s, e) fp32: the main attention's probabilities of query rows s:e over keys :e (causal, same
    document), summed over its heads: the dense stage's KL target before the sum over other ranks' heads
    (dsa._target_block's over every visible key). q, k (B, T, H, D) of one dtype, last dim contiguous (k may be
    expanded over heads). Two launches: each head's log-sum-exp, then the heads' probabilities summed."""
    b, t, h, d = q.shape
    lse = torch.empty(b, e - s, h, dtype=torch.float32, device=q.device)
    out = torch.empty(b, e - s, e, dtype=torch.float32, device=q.device)
    docs = doc.contiguous() if doc is not None else out
    args = (*q.stride()[:3], *k.stride()[:3], t, s, e, h, d, scale)
    meta = dict(HAS_DOC=doc is not None, **_index_meta(q))
    _head_lse[(b, triton.cdiv(e - s, INDEX_ROWS), h)](q, k, docs, lse, *args, **meta)
    _head_probs[(b, triton.cdiv(e - s, INDEX_ROWS), triton.cdiv(e, INDEX_KEYS))](
        q, k, docs, lse, out, *args, **meta
    )
    return out
