"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a lightning indexer per layer picks the `index_topk` keys
each query attends to, and learns by a KL loss against the main attention.

The indexer (DeepSeek-V3.2's: deepseek_v3/attention.py `Indexer`, HF keys
`self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`; DeepSeek-V4's CSA indexer scores compressed entries the
same way): queries from MLA's compressed query `qr`, one key head from the layer's input, RoPE on their first qk_rope_head_dim dims (half-split
pairs in V3.2, adjacent in GLM-5), index score I[t, u] = sum_h w_h(t) * ReLU(scale * q_h(t) . k(u)) in fp32 with
w = weights_proj(x) / sqrt(index_n_heads), causal and document masks, and each query's top index_topk keys,
shared by every MLA head. T <= index_topk keeps every key: exactly dense MLA. GLM-5's "shared" layers have no
indexer and attend with the previous full layer's selection.

Training (DeepSeek-V3.2 report, section 2.1; Megatron-LM's dsa.py): the target is the main attention's
probabilities (detached), summed over all heads and L1-normalised per query, under the same masks; the loss is
KL(target || softmax(I)) per query, summed over queries, scaled by the caller (the mean over the global batch's
real queries times --indexer_loss_coef). The indexer's inputs (x, qr) are detached, so the main model learns from
the LM loss alone and the indexer from its KL alone. In the sparse stage both distributions are restricted to
the selected keys. Nothing (T, T)-sized is kept: `index_pass` walks blocks of query rows, computing scores,
the selection, the KL and its gradient with respect to the indexer's q, k and w in the same pass; those
gradients (the size of q, k and w) are kept and handed to autograd when the attention output's gradient
arrives (`_inject`), scaled by the caller's factor, as Megatron's DSAIndexerLossAutoScaler does. Where
Triton's kernels run (kernels.triton_kernels: a GPU, or the interpreter in tests) the scores and their gradient
are index_kernels' fused kernels, in the dense stage the KL's target is index_kernels.head_probs (every head's
softmax summed in registers: no per-head block), and in the sparse stage the attention kernel returns the KL's
target from its own pass (`sparse_kl`): the indexer's loss costs no second look at the main attention
(`kernel_path` names what runs). The KL is fp32, by a formula stable for close distributions (`_kl`).

Top-k is deterministic with a fixed tie rule: among equal scores the later key wins (GLM-5 reports that
non-deterministic top-k degraded training).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from .attention import UNION_DENSE, AttentionLayout, attend
from .kernels import gpu_kernels, triton_kernels

SCORE_ELEMENTS = 1 << 23  # (rows x heads x keys) fp32 score elements per block of query rows: 32 MiB


@dataclass
class Target:
    """The main attention the indexer learns from: q, k (B, T, H, d) detached, its softmax scale, and the sum
    over the heads that other ranks hold (tensor or sequence parallel), or None."""

    q: torch.Tensor
    k: torch.Tensor
    scale: float
    sparse: bool
    """The sparse stage's loss: both distributions restricted to the selected keys."""
    head_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    real: torch.Tensor | None = None
    """(B, T) bool: the queries that hold a token; padding's (PAD_POSITION) count in no KL, recall or gradient,
    as Megatron-LM's packed (THD) path drops them. None: every query does."""


@dataclass
class PassResult:
    selection: torch.Tensor | None
    """(B, T, k) int64: the keys of each query (padded with repeats where a row has fewer keys than k)."""
    stats: torch.Tensor
    """fp64 (4,): KL summed over queries, queries, recall (the target mass inside the selection) summed over
    queries, queries counted for recall (0 where the target was restricted to the selection)."""
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """d(KL sum)/d(q, k, w) of the indexer."""
    scores: torch.Tensor | None = None
    """(B, T, k) fp32: the index scores of the selection's keys in ascending key order, as
    dsa_kernels.usable_keys orders them (index_pass with `scores`; for `sparse_kl`)."""


def _ordered(scores: torch.Tensor) -> torch.Tensor:
    """fp32 -> int64 keys that sort like the scores, with the key index as tie-break (the later key wins)."""
    bits = (scores.float() + 0.0).contiguous().view(torch.int32).to(torch.int64)  # + 0.0: -0.0 ties 0.0
    order = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    index = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
    return (order << 32) | index


def top_keys(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The `k` best keys along the last dim, deterministically (see `_ordered`), in descending order."""
    k = min(k, scores.shape[-1])
    return _ordered(scores).topk(k, dim=-1).indices


def _valid(s: int, e: int, doc: torch.Tensor | None, b: int, device: torch.device) -> torch.Tensor:
    """(B or 1, e - s, e) bool: query rows s:e may see keys :e (causal, same document)."""
    causal = torch.ones(e - s, e, dtype=torch.bool, device=device).tril_(diagonal=s)
    if doc is None:
        return causal.unsqueeze(0)
    return causal & (doc[:, s:e, None] == doc[:, None, :e])


@torch.no_grad()
def index_pass(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    topk: int | None,
    doc: torch.Tensor | None,
    target: Target | None = None,
    grads: bool = False,
    scores: bool = False,
) -> PassResult:
    """One walk over blocks of query rows: the indexer's scores, each query's `topk` keys (None: no
    selection), with a `target` the KL loss and the recall, with `grads` the KL's gradient (see the top),
    with `scores` the selected keys' scores."""
    b, t, heads, dim = q.shape
    dev = q.device
    scale = dim**-0.5
    work = torch.float64 if q.dtype == torch.float64 else torch.float32  # float64 for gradcheck
    kernels = _kernels(q)
    # Triton's scores read q and k as they are (bf16 GEMMs accumulate in fp32); torch upcasts them
    qf, kf, wf = (q, k, w.float()) if kernels else (q.to(work), k.to(work), w.to(work))
    width = min(topk, t) if topk is not None else 0
    selection = torch.empty(b, t, width, dtype=torch.int64, device=dev) if topk is not None else None
    chosen_scores = torch.empty(b, t, width, dtype=torch.float32, device=dev) if scores else None
    stats = torch.zeros(4, dtype=torch.float64, device=dev)
    dq = torch.zeros(q.shape, dtype=work, device=dev) if grads else None
    dk = torch.zeros(k.shape, dtype=work, device=dev) if grads else None
    dw = torch.zeros(w.shape, dtype=work, device=dev) if grads else None
    # The kernels keep no per-head scores: a block's are (B, rows, keys); torch's target (B, main heads, ...)
    # where it restricts each head's softmax to a selection (or the kernels do not run)
    main_heads = target.q.shape[2] if target is not None and (target.sparse or not kernels) else 0
    rows = max(1, SCORE_ELEMENTS // (b * max(1 if kernels else heads, main_heads) * t))
    if kernels and target is not None and not target.sparse:  # head_probs reads rows with a unit last stride
        from .dsa_kernels import last_dim_contiguous

        target = replace(target, q=last_dim_contiguous(target.q), k=last_dim_contiguous(target.k))
    for s in range(0, t, rows):
        e = min(s + rows, t)
        c = e - s
        # the masks: the kernels' scores come masked; a selection alone needs no more (the sparse stage's route)
        valid = _valid(s, e, doc, b, dev).expand(b, c, e) if target is not None or not kernels else None
        if kernels:
            act, index = None, kernels.index_scores(qf, kf, wf, s, e, doc, scale)  # masked
        else:
            raw = torch.matmul(qf[:, s:e].reshape(b, c * heads, dim), kf[:, :e].transpose(1, 2))
            act = raw.view(b, c, heads, e).mul_(scale).relu_()  # act > 0 exactly where the score was
            index = torch.matmul(wf[:, s:e].unsqueeze(2), act).squeeze(2)  # (B, c, e)
            index = index.masked_fill(~valid, float("-inf"))
        if selection is not None:
            top = top_keys(index, width)
            if top.shape[-1] < width:  # fewer keys than width: every one is chosen; pad with repeats
                top = torch.cat([top, top[..., -1:].expand(-1, -1, width - top.shape[-1])], dim=-1)
            selection[:, s:e] = top
            if chosen_scores is not None:
                chosen_scores[:, s:e] = index.gather(-1, top.sort(dim=-1).values)
        if target is None:
            continue
        chosen = None
        if selection is not None:
            chosen = torch.zeros(b, c, e, dtype=torch.bool, device=dev).scatter_(
                -1, top.clamp(max=e - 1), True
            )
        support = valid & chosen if target.sparse else valid
        # Sparse: the target over the block's chosen keys only (the attention kernel's scheme)
        keys = support.any(dim=0).any(dim=0).nonzero().flatten() if target.sparse else None
        if keys is not None and keys.numel() > UNION_DENSE * e:
            keys = None
        cols = slice(0, e) if keys is None else keys
        sub = support[..., cols]
        p = _target_block(target, s, e, sub, cols, doc, kernels)
        logq = index[..., cols].to(work).masked_fill(~sub, float("-inf")).log_softmax(dim=-1)
        kl = _kl(p, logq, sub)
        counted = b * c
        if target.real is not None:
            keep = target.real[:, s:e]
            sub = sub & keep.unsqueeze(-1)
            kl, p = kl.masked_fill(~keep, 0.0), p.masked_fill(~sub, 0.0)
            counted = keep.sum(dtype=torch.float64)
        stats[0] += kl.sum(dtype=torch.float64)
        stats[1] += counted
        if chosen is not None and not target.sparse:
            stats[2] += (p * chosen).sum(dtype=torch.float64)
            stats[3] += counted
        if grads:  # d KL / d I is 0 off the support: the chain to q, k and w only over the keys scored
            d_index = torch.where(sub, logq.exp() - p, 0.0)
            if kernels:
                at = torch.arange(e, device=dev) if keys is None else keys
                dq[:, s:e], dw[:, s:e] = kernels.index_score_grads(qf, kf, wf, s, e, at, d_index, scale, dk)
            else:
                act_k = act if keys is None else act[..., keys]
                dw[:, s:e] = torch.matmul(act_k, d_index.unsqueeze(-1)).squeeze(-1)
                d_raw = d_index.unsqueeze(2) * wf[:, s:e].unsqueeze(-1) * (act_k > 0) * scale
                d_raw = d_raw.view(b, c * heads, -1)
                dq[:, s:e] = torch.matmul(d_raw, kf[:, cols]).view(b, c, heads, dim)
                d_keys = torch.matmul(d_raw.transpose(1, 2), qf[:, s:e].reshape(b, c * heads, dim))
                if keys is None:
                    dk[:, :e] += d_keys
                else:
                    dk.index_add_(1, keys, d_keys)
    out_grads = (dq.to(q.dtype), dk.to(k.dtype), dw.to(w.dtype)) if grads else None
    return PassResult(selection, stats, out_grads, chosen_scores)


@torch.no_grad()
def sparse_kl(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    result: PassResult,
    keys: torch.Tensor,
    target: torch.Tensor,
    real: torch.Tensor | None,
    grads: bool,
) -> PassResult:
    """The sparse stage's KL where the attention kernel produced its target in its own pass
    (dsa_kernels.sparse_attend with `target`): `target` (B, T, k) fp32 is every head's probability of each of
    the `keys` (usable_keys of result.selection: sorted, -1 where unusable) summed, over the group's heads too;
    the indexer's distribution is its scores over the same keys (result.scores, from index_pass with
    `scores`). -> `result` with the KL's stats and, with `grads`, its gradient to the indexer's q, k and w
    (index_kernels, block by block). Equal to index_pass's sparse KL, which recomputes the target."""
    b, t, _, dim = q.shape
    kernels = _kernels(q) if grads else None
    assert kernels is not None or not grads, "sparse_kl's gradient runs where the Triton kernels do"
    stats = torch.zeros(4, dtype=torch.float64, device=q.device)
    stats[1] = real.sum(dtype=torch.float64) if real is not None else b * t
    if grads:
        wf = w.float()
        dq, dk, dw = (torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in (q, k, w))
    rows = max(1, SCORE_ELEMENTS // (b * t))  # the gradient's (B, rows, keys :e) block: as index_pass's
    for s in range(0, t, rows):
        e = min(s + rows, t)
        usable = keys[:, s:e] >= 0
        if real is not None:
            usable &= real[:, s:e].unsqueeze(-1)
        logq = result.scores[:, s:e].masked_fill(~usable, float("-inf")).log_softmax(dim=-1)
        p = target[:, s:e].masked_fill(~usable, 0.0)
        p = p / p.sum(dim=-1, keepdim=True).clamp(min=1e-30)
        stats[0] += _kl(p, logq, usable).sum(dtype=torch.float64)  # a padding query's support is empty: 0
        if grads:  # d KL / d I over each row's keys, scattered to the block's keys :e
            d_block = torch.zeros(b, e - s, e, dtype=torch.float32, device=q.device)
            d_index = torch.where(usable, logq.exp() - p, 0.0)
            d_block.scatter_add_(-1, keys[:, s:e].long().clamp(min=0), d_index)
            at = torch.arange(e, device=q.device)
            dq[:, s:e], dw[:, s:e] = kernels.index_score_grads(q, k, wf, s, e, at, d_block, dim**-0.5, dk)
    out = (dq.to(q.dtype), dk.to(k.dtype), dw.to(w.dtype)) if grads else None
    return PassResult(result.selection, stats, out, result.scores)


def kernel_path(device: torch.device, dtype: torch.dtype) -> str:
    """What sparse attention runs on `device` at `dtype`: the indexer's scores, top-k, and attention over the
    selected keys (`dstrain env`, a run's kernel line)."""
    if triton_kernels(device, dtype):
        where = "" if device.type == "cuda" else " (Triton's CPU interpreter)"
        return (
            f"triton indexer, torch top-k of its scores' ordered keys, triton sparse attention (the sparse "
            f"stage's KL target from its own pass), triton dense-stage KL target (heads summed in registers)"
            f"{where}"
        )
    if gpu_kernels(device):
        return (
            "torch indexer blocks, torch top-k, SDPA over a (B, 1, T, T) mask of the chosen keys "
            "(Triton's kernels need Triton and a GPU, or TRITON_INTERPRET=1)"
        )
    return "torch indexer blocks, torch top-k, block attention over the chosen keys (dstrain's CPU kernel)"


def _kernels(q: torch.Tensor) -> Any:
    """index_kernels (the Triton indexer) where it runs for q (kernels.triton_kernels), else None."""
    if not triton_kernels(q.device, q.dtype):
        return None
    from . import index_kernels  # imports Triton: only where it runs

    return index_kernels


def _kl(p: torch.Tensor, logq: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per query over the support, stable in fp32. Term by term (p log p - p log q) each log carries
    its rounding, eps |log p|, the row's normaliser's alike in every term: fp32 KLs of close distributions
    were off by up to 85% per query (the layouts' KL figures parted by 3.6e-4). With r = log p - log q and any c,
    KL = sum p (r - c) - log1p(sum q expm1(r - c)) uses sum p = sum q = 1 exactly, not their rounded sums: a
    constant error in r (the normalisers') cancels, an element's rounding enters times (p - q), and c = the
    p-weighted mean of r keeps both terms small. Measured against float64 (T 64 to 16K, KLs 5e-7 to 5e-5 per
    query): per query within 5e-4, a batch's sum within 1.2e-5."""
    logp = torch.where(support, p, 1.0).log()
    r = torch.where(support, logp - logq.masked_fill(~support, 0.0), 0.0)
    held = support & (p > 0)  # an fp32 probability may underflow: its r is -inf, its terms p r are 0
    c = torch.where(held, p * r, 0.0).sum(-1, keepdim=True)
    first = torch.where(held, p * (r - c), 0.0).sum(-1)
    return first - torch.where(support, logq.exp() * torch.expm1(r - c), 0.0).sum(-1).log1p()


def _target_block(
    target: Target,
    s: int,
    e: int,
    support: torch.Tensor,
    cols: slice | torch.Tensor,
    doc: torch.Tensor | None = None,
    kernels: Any = None,
) -> torch.Tensor:
    """(B, e - s, keys) fp32 (float64 for float64 inputs): the main attention's probabilities of query rows
    s:e over the support (of the keys `cols`), summed over every head (the group's too) and L1-normalised.
    With `kernels` (index_kernels) the dense stage's (every key `doc` lets it see) in two launches, nothing
    per head kept."""
    if kernels is not None and not target.sparse:  # q, k with a unit last stride (index_pass)
        p = kernels.head_probs(target.q, target.k, s, e, doc, target.scale)
    else:
        work = torch.float64 if target.q.dtype == torch.float64 else torch.float32
        qm = target.q[:, s:e].to(work).transpose(1, 2)  # (B, H, c, d)
        km = target.k[:, cols].to(work).transpose(1, 2)  # (B, H, keys, d)
        scores = torch.matmul(qm, km.transpose(-1, -2)).mul_(target.scale)
        p = scores.masked_fill_(~support.unsqueeze(1), float("-inf")).softmax(dim=-1).sum(dim=1)
    if target.head_sum is not None:
        p = target.head_sum(p)
    return p / p.sum(dim=-1, keepdim=True).clamp(min=1e-30)


class _Inject(torch.autograd.Function):
    """Identity on the attention output; in backward, the indexer's precomputed KL gradients of `inputs`
    times `scale`, once: a graph walked by several backward calls (a pipeline stage runs one per tensor it
    sent, with retain_graph) must not add it again."""

    @staticmethod
    def forward(ctx, out, scale, n, *inputs_and_grads):  # noqa: ANN001, ANN205
        ctx.save_for_backward(*inputs_and_grads[n:])
        ctx.scale, ctx.n, ctx.done = scale, n, False
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        rest = (None,) * ctx.n  # no gradient for the precomputed gradients themselves
        if ctx.done:
            return grad, None, None, *(None,) * ctx.n, *rest
        ctx.done = True
        return grad, None, None, *(g * ctx.scale for g in ctx.saved_tensors), *rest


def inject(out: torch.Tensor, scale: float, inputs: tuple, grads: tuple) -> torch.Tensor:
    """`out`, whose backward also sends `grads` (times `scale`) into `inputs` (the indexer's tensors)."""
    return _Inject.apply(out, scale, len(inputs), *inputs, *grads)


@dataclass
class SparseSettings:
    """How one layer's sparse attention runs (set by DeepSeekLM.set_sparse_attention)."""

    layer: int
    source: int
    """The layer whose selection this one attends with (itself unless GLM-5 shares an earlier one's)."""
    dense: bool = False
    """The dense warm-up: attention over every key (the indexer still learns)."""
    loss: bool = True
    """Compute the indexer's KL (and, training, inject its gradient)."""
    grad_scale: float | torch.Tensor | None = None
    """Factor on the KL sum's gradient (a 0-dim tensor: on the device, read by no host); None: 1 / (queries of
    the forward that hold a token)."""


class SparseControls:
    """The sparse-attention stages of a model (DeepSeekLM, DeepSeekV4LM) whose blocks' attention holds its
    `sparse` settings (None: a dense layer)."""

    def sparse_settings(self) -> list[SparseSettings]:
        """Every sparse-attention layer's settings (none without sparse attention)."""
        return [b.self_attn.sparse for b in self.blocks() if b.self_attn.sparse is not None]

    def set_sparse_attention(self, stage: str) -> None:
        """'dense': dense attention, the indexer learns (the warm-up); 'sparse': attention over the selected
        keys, the indexer learns by the sparse KL; 'frozen': attention over the selected keys, no indexer loss."""
        if stage not in ("dense", "sparse", "frozen"):
            raise ValueError(f"sparse attention stage {stage!r}: choose dense, sparse or frozen")
        for s in self.sparse_settings():
            s.dense, s.loss = stage == "dense", stage != "frozen"

    def set_indexer_grad_scale(self, scale: float | torch.Tensor | None) -> None:
        """Factor on each indexer's KL-sum gradient (the trainer's global normalisation times the loss
        coefficient); None: the mean over the forward's queries."""
        for s in self.sparse_settings():
            s.grad_scale = scale


def sparse_attention(
    settings: SparseSettings,
    indexer: nn.Module | None,
    x: torch.Tensor,
    qr: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    rope: tuple[torch.Tensor, torch.Tensor],
    layout: AttentionLayout,
    topk: int,
    seq_parallel: Any = None,
    head_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    measure: bool = True,
) -> torch.Tensor:
    """MLA's attention with the indexer's selection (q, k, v as `attend` takes them, this rank's part of them
    under tensor or sequence parallelism). `measure`: compute the KL and recall (and, where the indexer
    trains, the KL's gradient); in the dense stage or at evaluation the KL is the dense one."""
    if indexer is None:
        selection = layout.selections[settings.source]
        return _attend(seq_parallel, q, k, v, scale, layout, None if settings.dense else selection)
    iq, ik, iw = indexer(x.detach(), qr.detach(), rope)
    if seq_parallel is not None:  # the indexer needs every key of the row: the group's whole rows
        iq, ik, iw = (seq_parallel.gather_rows(z) for z in (iq, ik, iw))
        q, k, v = (seq_parallel.to_heads(z) for z in (q, k, v))
        head_sum = seq_parallel.sum
    trains = torch.is_grad_enabled() and any(p.requires_grad for p in indexer.parameters())
    sparse_loss = not settings.dense and torch.is_grad_enabled()
    real = layout.real_rows
    grads = measure and settings.loss and trains
    if measure and sparse_loss and topk < iq.shape[1] and triton_kernels(q.device, q.dtype) and _kernels(iq):
        # The attention kernel hands back the KL's target from its own pass: no second look at q and k
        from .dsa_kernels import sparse_attend

        result = index_pass(iq, ik, iw, topk, layout.doc, scores=True)
        out, p, keys = sparse_attend(q, k, v, scale, result.selection, layout.doc, target=True)
        result = sparse_kl(iq, ik, iw, result, keys, head_sum(p) if head_sum else p, real, grads)
    else:
        target = Target(q.detach(), k.detach(), scale, sparse_loss, head_sum, real) if measure else None
        result = index_pass(iq, ik, iw, topk, layout.doc, target, grads=grads)
        out = attend(q, k, v, scale, layout, None if settings.dense else result.selection)
    layout.selections[settings.layer] = result.selection
    layout.stats[settings.layer] = result.stats
    if result.grads is not None:
        factor = settings.grad_scale
        if factor is None:  # the mean over the forward's real queries
            factor = 1.0 / (real.sum().clamp(min=1) if real is not None else iq.shape[0] * iq.shape[1])
        out = inject(out, factor, (iq, ik, iw), result.grads)
    return seq_parallel.to_tokens(out) if seq_parallel is not None else out


def _attend(seq_parallel, q, k, v, scale, layout, selection):  # noqa: ANN001, ANN202
    if seq_parallel is None:
        return attend(q, k, v, scale, layout, selection)
    q, k, v = (seq_parallel.to_heads(z) for z in (q, k, v))
    return seq_parallel.to_tokens(attend(q, k, v, scale, layout, selection))
