"""GLM-5.3-Flash's k-pool lightning indexer: DeepSeek-V3.2's indexer (common/dsa.py) scoring pools of
`index_kpool` consecutive tokens instead of tokens.

Pools start at each document's first token (so a packed document pools as it does alone). A pool's key is a
learned gated average of its tokens' indexer keys: per channel, softmax over the pool's tokens of
`index_kpool_compress_gate x + index_kpool_compress_ape[slot]`. A query scores the complete pools that end at
or before it, I[t, p] = sum_h w_h(t) ReLU(scale q_h(t) . key(p)) (fp32), keeps its best index_topk / kpool
pools (ties: the later pool wins, dsa.top_keys) and attends their tokens plus always its own incomplete pool's
tokens (the tail). Every key selected: exactly dense MLA.

Training (dstrain's rule; transformers only infers): DeepSeek-V3.2's KL at the granularity of the selection.
The target is the main attention's probabilities (detached, summed over heads) over the tokens of the pools
the query may choose (the sparse stage: those it chose), summed per pool and L1-normalised; the indexer's
distribution is softmax(I) over the same pools; the loss KL(target || indexer) per query whose support is not
empty, summed. The indexer's inputs are detached, and its KL gradient (computed here, with respect to q, the
pool keys and w) is injected as dsa.inject does for V3.2's indexer; the pool keys carry it on by autograd to
wk, k_norm and the compression parameters. All in torch, by blocks of query rows (no (T, T) per head kept).

Sequence parallelism: each token's parts (q, key, compression gate, w) are computed on its rank and gathered to
whole rows, the pools (from the whole rows' positions) built there, and every rank selects alike; the target's
per-pool mass is summed over the group's heads (`head_sum`, as over tensor-parallel ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..common.dsa import SCORE_ELEMENTS, _kl, top_keys
from ..common.kernels import Linear


@dataclass
class Pools:
    """The k-pools of a batch's rows (one per forward, from the position ids alone)."""

    token: torch.Tensor
    """(B, P, kpool) int64 the token at each slot of each pool (clamped into the row)."""
    slot: torch.Tensor
    """(B, P, kpool) bool the slot holds one of the pool's tokens."""
    end: torch.Tensor
    """(B, P) int64 a complete pool's last token; T (visible to no query) for an incomplete one."""
    doc: torch.Tensor
    """(B, P) the pool's document (-1 for rows' unused pool slots)."""
    tail_start: torch.Tensor
    """(B, T) int64 the first token of each query's own incomplete pool (the query itself + 1 if none)."""
    query_doc: torch.Tensor
    """(B, T) every query's document."""
    owner: torch.Tensor
    """(B, T) int64 each token's pool; P (no pool) for padding."""


def make_pools(position_ids: torch.Tensor | None, b: int, t: int, kpool: int, device: torch.device) -> Pools:
    """Pools restart at each document's start (position 0); padding (position -1) is in none."""
    pos = torch.arange(t, device=device).expand(b, t) if position_ids is None else position_ids[:, :t]
    real = pos >= 0
    doc = (pos == 0).cumsum(1)
    begins = real & (pos % kpool == 0)
    pool_of = torch.where(real, begins.long().cumsum(1) - 1, -1)  # (B, T) each token's pool (or -1)
    p = max(int(begins.sum(1).max()), 1)
    start = torch.zeros(b, p, dtype=torch.long, device=device)
    rows, cols = begins.nonzero(as_tuple=True)
    start[rows, pool_of[rows, cols]] = cols
    used = torch.zeros(b, p, dtype=torch.bool, device=device)
    used[rows, pool_of[rows, cols]] = True
    token = (start.unsqueeze(-1) + torch.arange(kpool, device=device)).clamp(max=t - 1)
    slot = used.unsqueeze(-1) & (
        pool_of.gather(1, token.flatten(1)).view_as(token) == torch.arange(p, device=device)[None, :, None]
    )
    complete = slot.all(-1)
    end = torch.where(complete, start + kpool - 1, t)
    pool_doc = torch.where(used, doc.gather(1, start), -1)
    idx = torch.arange(t, device=device)
    tail_start = torch.where(real, idx - (pos + 1) % kpool + 1, idx + 1)
    return Pools(token, slot, end, pool_doc, tail_start, doc, torch.where(pool_of < 0, p, pool_of))


class PoolIndexer(nn.Module):
    """One DSA layer's indexer, transformers' names: wq_b, wk, k_norm, weights_proj, index_kpool_compress_ape
    (kpool, dim), index_kpool_compress_gate (dim, hidden)."""

    def __init__(self, hidden_size: int, q_lora_rank: int, heads: int, dim: int, kpool: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.kpool = heads, dim, kpool
        self.wq_b = Linear(q_lora_rank, heads * dim, bias=False)
        self.wk = Linear(hidden_size, dim, bias=False)
        self.k_norm = nn.LayerNorm(dim, eps=1e-6)
        self.weights_proj = Linear(hidden_size, heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(kpool, dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(dim, hidden_size))

    def forward(
        self, x: torch.Tensor, qr: torch.Tensor, pools: Pools, seq_parallel: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, D), qr (B, T, q_lora_rank) -> q (B, T, heads, dim), pool keys (B, P, dim), w (B, T, heads)
        fp32 (the head weights times heads^-1/2). Under sequence parallelism x and qr are this rank's slice,
        `pools` the whole rows': each token's parts are computed locally and gathered to whole rows
        (`gather_rows`: every rank selects alike, the gradient of its own slice is its part), the pools built
        on the whole rows."""
        q, k, gate, w = self.token_parts(x, qr)
        ape = self.index_kpool_compress_ape
        if seq_parallel is not None:
            q, k, gate, w = (seq_parallel.gather_rows(z) for z in (q, k, gate, w))
            ape = _CountedOnce.apply(ape, seq_parallel.rank == 0)
        return q, self.pool_keys(k, gate, ape, pools), w

    def token_parts(
        self, x: torch.Tensor, qr: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each token's own parts: q (B, T, heads, dim), its normalised key (B, T, dim), its compression gate
        logits (B, T, dim) and w (B, T, heads) fp32."""
        b, t, _ = x.shape
        q = self.wq_b(qr).view(b, t, self.n_heads, self.head_dim)
        k = F.layer_norm(self.wk(x).float(), (self.head_dim,), self.k_norm.weight.float(), self.k_norm.bias.float(),
                         self.k_norm.eps).to(x.dtype)  # fmt: skip
        gate = F.linear(x, self.index_kpool_compress_gate.to(x.dtype))
        w = self.weights_proj(x)
        return q, k, gate, w.to(torch.promote_types(w.dtype, torch.float32)) * self.n_heads**-0.5

    @staticmethod
    def pool_keys(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, pools: Pools) -> torch.Tensor:
        """The pools' keys (B, P, dim): per channel, the softmax over the pool's tokens of gate + ape[slot]."""
        b = k.shape[0]
        rows = torch.arange(b, device=k.device)[:, None, None]
        logits = gate[rows, pools.token].float() + ape.float()
        logits = logits.masked_fill(~pools.slot.unsqueeze(-1), float("-inf"))
        # an unused pool slot of the row has no token: 0 weights, not softmax's NaN
        probs = torch.where(pools.slot.any(-1)[..., None, None], logits.softmax(dim=2), 0.0).to(k.dtype)
        return (probs * k[rows, pools.token]).sum(dim=2)


class _CountedOnce(torch.autograd.Function):
    """Identity; in backward the gradient on the sequence-parallel group's first rank, 0 on the others: a
    parameter that every rank of the group uses alike on whole rows (the pools' position bias) gets its
    gradient once when the group's gradients are summed, as the per-token parameters do from their slices."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: bool) -> torch.Tensor:  # noqa: ANN001
        ctx.keep = keep
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return (grad if ctx.keep else torch.zeros_like(grad)), None


@dataclass
class Selection:
    keys: torch.Tensor
    """(B, T, topk + kpool - 1) int64 the keys each query attends (padded with repeats)."""
    stats: torch.Tensor
    """fp64 (4,) as dsa.PassResult.stats."""
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    """d(KL sum)/d(q, pool keys, w)."""


def selection_width(topk: int, kpool: int) -> int:
    """Keys each query's selection holds: its topk // kpool pools' tokens and its own incomplete pool's."""
    return topk // kpool * kpool + kpool - 1


@torch.no_grad()
def select(
    q: torch.Tensor,
    pool_k: torch.Tensor,
    w: torch.Tensor,
    pools: Pools,
    topk: int,
    target: tuple[torch.Tensor, torch.Tensor, float, bool, Any] | None = None,
    real: torch.Tensor | None = None,
    grads: bool = False,
) -> Selection:
    """Each query's keys (see the top); with `target` (main q, main k (B, T, H, d) detached, their scale,
    sparse stage, and the sum over the tensor-parallel ranks' heads or None) the KL and recall, with `grads`
    its gradient. `real` (B, T): the queries holding a token."""
    b, t, heads, dim = q.shape
    kpool, npool, dev = pools.token.shape[-1], pool_k.shape[1], q.device
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, wf = q.to(work), pool_k.to(work), w.to(work)
    scale = dim**-0.5
    # every row's selection is width pools wide whatever its pool count (`selection_width`: pipeline stages send
    # it in a fixed shape); where fewer pools exist, the rest repeat a chosen key
    width = topk // kpool
    keys = torch.empty(b, t, selection_width(topk, kpool), dtype=torch.long, device=dev)
    stats = torch.zeros(4, dtype=torch.float64, device=dev)
    dq, dk, dw = (
        (torch.zeros(z.shape, dtype=work, device=dev) for z in (q, pool_k, w)) if grads else (None,) * 3
    )
    main_heads = target[0].shape[2] if target is not None else 1
    rows = max(1, SCORE_ELEMENTS // (b * max(heads * npool, main_heads * t)))
    slots = torch.arange(kpool, device=dev)
    for s in range(0, t, rows):
        e = min(s + rows, t)
        c = e - s
        at = torch.arange(s, e, device=dev)
        visible = (pools.end[:, None, :] <= at[None, :, None]) & (
            pools.doc[:, None, :] == pools.query_doc[:, s:e, None]
        )
        raw = torch.matmul(qf[:, s:e].reshape(b, c * heads, dim), kf.transpose(1, 2))
        act = raw.view(b, c, heads, npool).mul_(scale).relu_()
        index = torch.matmul(wf[:, s:e].unsqueeze(2), act).squeeze(2).masked_fill(~visible, float("-inf"))
        top = top_keys(index, min(width, npool))  # (B, c, width or all the pools)
        chosen_ok = visible.gather(-1, top)
        if top.shape[-1] < width:
            top = torch.cat([top, top[..., :1].expand(-1, -1, width - top.shape[-1])], dim=-1)
            chosen_ok = F.pad(chosen_ok, (0, width - chosen_ok.shape[-1]))
        pool_tokens = pools.token.gather(
            1, top.flatten(1).unsqueeze(-1).expand(-1, -1, kpool).clamp(max=npool - 1)
        )
        pool_tokens = pool_tokens.view(b, c, width * kpool).masked_fill(
            ~chosen_ok.repeat_interleave(kpool, -1), -1
        )
        tail = pools.tail_start[:, s:e, None] + slots[: kpool - 1]
        tail = tail.masked_fill(tail > at[None, :, None], -1)
        sel = torch.cat([pool_tokens, tail], dim=-1)
        fill = sel.max(dim=-1, keepdim=True).values  # a chosen key (any repeat attends the same set)
        fill = torch.where(fill < 0, at[None, :, None].expand(b, c, 1), fill)
        keys[:, s:e] = torch.where(sel < 0, fill, sel)
        if target is None:
            continue
        chosen = torch.zeros(b, c, npool, dtype=torch.bool, device=dev).scatter_(-1, top, True) & visible
        support = chosen if target[3] else visible
        p = _pool_target(target, s, e, support, pools)
        has = support.any(-1)
        if real is not None:
            has = has & real[:, s:e]
        logq = index.masked_fill(~support, float("-inf")).log_softmax(-1).nan_to_num(neginf=float("-inf"))
        sup = support & has.unsqueeze(-1)
        p = p.masked_fill(~sup, 0.0)
        kl = torch.where(has, _kl(p, torch.where(sup, logq, 0.0), sup), 0.0)
        stats[0] += kl.sum(dtype=torch.float64)
        stats[1] += has.sum(dtype=torch.float64)
        if not target[3]:
            stats[2] += (p * chosen).sum(dtype=torch.float64)
            stats[3] += has.sum(dtype=torch.float64)
        if grads:
            d_index = torch.where(sup, logq.exp() - p, 0.0)  # (B, c, P)
            dw[:, s:e] = torch.matmul(act, d_index.unsqueeze(-1)).squeeze(-1)
            d_raw = (d_index.unsqueeze(2) * wf[:, s:e].unsqueeze(-1) * (act > 0) * scale).view(
                b, c * heads, npool
            )
            dq[:, s:e] = torch.matmul(d_raw, kf).view(b, c, heads, dim)
            dk += torch.matmul(d_raw.transpose(1, 2), qf[:, s:e].reshape(b, c * heads, dim))
    out = (dq.to(q.dtype), dk.to(pool_k.dtype), dw.to(w.dtype)) if grads else None
    return Selection(keys, stats, out)


def _pool_target(
    target: tuple[torch.Tensor, torch.Tensor, float, bool, Any],
    s: int,
    e: int,
    support: torch.Tensor,
    pools: Pools,
) -> torch.Tensor:
    """(B, e - s, P): the main attention's probabilities of query rows s:e over the supported pools' tokens,
    summed over heads and per pool, L1-normalised (0 where a row has no support)."""
    q, k, scale, _, head_sum = target
    b, t = k.shape[:2]
    npool = pools.token.shape[1]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    owner = pools.owner
    padded = F.pad(support, (0, 1))  # the extra pool: tokens in none
    token_ok = padded.gather(-1, owner[:, None, :].expand(-1, e - s, -1))  # (B, c, T)
    scores = torch.matmul(q[:, s:e].to(work).transpose(1, 2), k.to(work).permute(0, 2, 3, 1)) * scale
    probs = scores.masked_fill(~token_ok.unsqueeze(1), float("-inf")).softmax(-1).nan_to_num(0.0).sum(1)
    mass = torch.zeros(b, e - s, npool + 1, dtype=work, device=q.device)
    mass.scatter_add_(-1, owner[:, None, :].expand(-1, e - s, -1), probs)
    mass = mass[..., :npool]
    if head_sum is not None:  # tensor parallelism: every rank's heads
        mass = head_sum(mass)
    return mass / mass.sum(-1, keepdim=True).clamp(min=1e-30)
