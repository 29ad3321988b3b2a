"""DeepSeek-V4 attention: one shared key=value head, a sliding window of raw tokens, compressed entries.

Per layer type: `sliding_attention` sees the last `sliding_window` tokens; `heavily_compressed_attention` (HCA)
adds every causal entry of a compressor that pools `m` tokens (128) into one; `compressed_sparse_attention`
(CSA) pools overlapping windows of 2m tokens every m (4) and sees only the entries its lightning indexer picks.
Queries go through q_lora_rank and a per-head unweighted RMSNorm; RoPE turns the last qk_rope_head_dim dims of
a head with adjacent pairs rotated in place (the key is the value, so the output's order matters, unlike
MLA's), and the output is turned back at the query's position. A learnable per-head sink joins the softmax's
denominator; the output projection is block-diagonal over `o_groups`, then one dense projection.

Packed documents (transformers pools across them): the sliding window stays inside a document; a compressed
entry is visible to a query when its own window lies in the query's document and before it, pools no window
of another document, and is rotated at its window's position within the document: a document that starts at
a multiple of the compress rates computes exactly as alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..common.attention import inverse_frequencies
from ..common.dsa import SparseSettings, inject, top_keys
from ..common.kernels import Linear, gpu_kernels
from ..common.layers import RMSNorm
from ..common.mhc import unweighted_rms
from ..common.stored import dense_weight
from .config import CSA, SLIDING, V4Config

# Query rows per block of the attention (its scores are (B, H, rows, keys)): 64 on a CPU, where small blocks
# keep the work in cache; on a GPU a block is a few kernel launches, so blocks must be large to keep it busy
# (H200, 2 x 4096 tokens: 64-row blocks ran the step 3.3x slower than transformers' whole-row attention).
CPU_BLOCK_ROWS, GPU_BLOCK_ROWS = 64, 1024


class V4RMSNorm(RMSNorm):
    """V4's norm multiplies the weight in fp32 before the cast (its weights are kept fp32 by transformers)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class V4Rope:
    """The two rotary sets: "main" (rope_theta, no scaling) for sliding layers, "compress" (compress_rope_theta
    with the config's YaRN, its cos/sin multiplier fixed at 1) for CSA/HCA layers, their compressors and the
    indexer."""

    def __init__(self, cfg: V4Config) -> None:
        r, top = cfg.qk_rope_head_dim, cfg.max_position_embeddings
        yarn = dict(cfg.rope_scaling, attention_factor=1.0) if cfg.rope_scaling else None
        self.args = {
            "main": (r, cfg.rope_theta, None, top),
            "compress": (r, cfg.compress_rope_theta, yarn, top),
        }
        self.cache: dict[tuple[str, torch.device], torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., r/2) fp32 cos and sin at `positions`."""
        key = (kind, positions.device)
        if key not in self.cache:  # computed on first use: the model may have been built on meta
            with torch.device("cpu"):
                self.cache[key] = inverse_frequencies(*self.args[kind])[0].to(positions.device)
        freqs = positions[..., None].float() * self.cache[key]
        return freqs.cos(), freqs.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last 2 * cos.shape[-1] dims of x as adjacent pairs, in place of them (cos/sin broadcast
    against x's leading dims), computed in fp32."""
    r = 2 * cos.shape[-1]
    rope = x[..., -r:].float()
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    turned = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat([x[..., :-r], turned.to(x.dtype)], dim=-1)


@dataclass
class V4Inputs:
    """What every V4 block of one forward reads besides its streams."""

    rope: V4Rope
    position_ids: torch.Tensor
    """(B, T) of this forward's tokens, restarting at 0 per packed document."""
    doc: torch.Tensor | None
    """(B, whole rows) document ids, None: one document per row."""
    ids: torch.Tensor
    """(B, T) the tokens: hash layers route by them."""
    real: torch.Tensor | None = None
    """(B, T) bool: the positions holding a token (None: all); routers count only these."""
    stats: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per CSA layer, its indexer's fp64 [KL sum, queries, recall sum, queries counted for recall]."""
    seq_parallel: Any = None
    """Sequence parallelism (dstrain.parallel.sp): this rank's tokens are a slice of every row."""
    offset: int = 0
    """The row index of this forward's first token (its slice's start under sequence parallelism)."""
    row_positions: torch.Tensor | None = None
    """(B, whole rows) position ids (None: `position_ids` are the whole rows')."""
    rotations: dict[Any, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """cos and sin computed once per forward for every layer (`cos_sin`, `entry_cos_sin`)."""

    def cos_sin(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens' rotation of `kind` ("main" or "compress")."""
        if kind not in self.rotations:
            self.rotations[kind] = self.rope.cos_sin(self.position_ids, kind)
        return self.rotations[kind]

    def entry_cos_sin(self, rate: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation of `n` compressed entries of `rate` tokens: at their windows' start."""
        key = ("entries", rate, n)
        if key not in self.rotations:
            rows = self.row_positions if self.row_positions is not None else self.position_ids
            starts = torch.arange(n, device=rows.device) * rate
            self.rotations[key] = self.rope.cos_sin(rows[:, starts], "compress")
        return self.rotations[key]

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) of this forward's tokens -> the whole rows' (the sequence-parallel group's slices, with
        the gradient of every rank's use summed back into each slice)."""
        return x if self.seq_parallel is None else self.seq_parallel.gather_rows_summed(x)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T): a new id where a document starts (position 0); padding (-1) continues the last document."""
    return (position_ids == 0).cumsum(dim=1)


class Compressor(nn.Module):
    """Softmax-gated pooling of `rate` tokens per entry (per channel), RMSNorm, RoPE at the window's start.
    `overlap` (CSA): two halves of width `dim` each; entry w pools the previous window's first halves and its
    own window's second halves, 2 * rate tokens."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.kv_proj = Linear(hidden, width, bias=False)
        self.gate_proj = Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, width))
        self.kv_norm = V4RMSNorm(dim, eps)

    def entries(self, x: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, hidden) -> (B, T // rate, dim) pooled and normed, not rotated; a partial last window is
        not an entry yet. With `doc` (B, T) an overlapping entry pools no previous window of another
        document (as at the start of a row)."""
        b, t, _ = x.shape
        m, d = self.rate, self.dim
        nw = t // m
        if nw == 0:
            return x.new_zeros(b, 0, d)
        width = self.position_bias.shape[-1]
        kv = self.kv_proj(x[:, : nw * m]).view(b, nw, m, width)
        # the position bias joins the gate in fp32 whatever the dtype it arrives in (bf16 under DeepSpeed)
        work = torch.promote_types(x.dtype, torch.float32)
        gate = self.gate_proj(x[:, : nw * m]).view(b, nw, m, width).to(work) + self.position_bias.to(work)
        if self.overlap:
            before = kv.new_zeros(b, 1, m, d)
            kv = torch.cat([torch.cat([before, kv[:, :-1, :, :d]], dim=1), kv[..., d:]], dim=2)
            closed = gate.new_full((b, 1, m, d), float("-inf"))
            gate = torch.cat([torch.cat([closed, gate[:, :-1, :, :d]], dim=1), gate[..., d:]], dim=2)
            if doc is not None and nw > 1:
                starts = torch.arange(nw, device=x.device) * m
                cut = doc[:, starts] != doc[:, (starts - m).clamp(min=0)]  # (B, nw)
                earlier = torch.arange(2 * m, device=x.device) < m
                gate = gate.masked_fill(cut[:, :, None, None] & earlier[:, None], float("-inf"))
        pooled = (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)
        return self.kv_norm(pooled)


def visible_entries(comp: Compressor, nw: int, doc: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """(B or 1, len(rows), nw) bool: entry w is visible to the query at row index t when its last token is at
    most t and its own window starts in t's document (`doc`: the whole rows'; an overlapping entry's previous
    window is then closed at the document's start: Compressor.entries)."""
    w = torch.arange(nw, device=rows.device)
    seen = ((w + 1) * comp.rate - 1)[None, :] <= rows[:, None]  # (T, nw)
    if doc is None:
        return seen.unsqueeze(0)
    first = doc[:, w * comp.rate]  # (B, nw)
    return seen.unsqueeze(0) & (first[:, None, :] == doc[:, rows, None])


class Scorer(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.weights_proj = Linear(hidden, heads, bias=False)


class Indexer(Compressor):
    """The CSA lightning indexer: its own overlapping compressor at index_head_dim, queries from the attention's
    compressed query; score I[t, s] = sum_h w_h(x_t) / sqrt(H) * relu(q_th . k_s) / sqrt(d)."""

    def __init__(self, cfg: V4Config) -> None:
        rate = cfg.compress_rates[CSA]
        super().__init__(cfg.hidden_size, cfg.index_head_dim, rate, True, cfg.rms_norm_eps)
        self.heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.scorer = Scorer(cfg.hidden_size, cfg.index_n_heads)

    def scores(
        self,
        x: torch.Tensor,
        q_res: torch.Tensor,
        keys: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """-> (B, T, n entries) fp32 index scores (no mask)."""
        b, t, _ = x.shape
        q = rotate(self.q_b_proj(q_res).view(b, t, self.heads, self.dim), *(r.unsqueeze(2) for r in rope))
        dots = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1))  # (B, T, H, n)
        dots = F.relu(dots) * self.dim**-0.5
        w = self.scorer.weights_proj(x).float() * self.heads**-0.5
        return (dots * w.unsqueeze(-1)).sum(dim=2)

    def select(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """(B, T, n) bool: each query's top-k visible entries (all of them when fewer), ties broken by DSA's
        deterministic rule (`dsa.top_keys`: the later entry wins)."""
        scores = scores.masked_fill(~visible, float("-inf"))
        chosen = torch.zeros_like(scores, dtype=torch.bool)
        chosen.scatter_(-1, top_keys(scores, self.topk), True)
        return chosen & visible


def attend(
    q: torch.Tensor,
    kv: torch.Tensor,
    entries: torch.Tensor | None,
    entry_mask: torch.Tensor | None,
    sinks: torch.Tensor,
    window: int,
    doc: torch.Tensor | None,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (B, T, H, d) the queries of rows offset.., kv (B, whole rows, d) the shared key=value head, entries
    (B, n, d) compressed ones with entry_mask (B or 1, T, n) which each query sees -> (B, T, H, d), and
    (B, T, n) fp32 the attention probabilities of the entries summed over the heads, detached (None without
    entries). The query at row index t sees raw keys (t - window, t] of its document (`doc`: the whole rows');
    the softmax's denominator also holds exp(sink_h). Rows run in blocks so that the scores held are
    (rows x (window + entries)), never (T x T)."""
    b, t, h, d = q.shape
    scale = d**-0.5
    out, entry_probs = [], []
    pos = torch.arange(kv.shape[1], device=q.device)
    sink = sinks.float().view(1, h, 1, 1)
    rows = GPU_BLOCK_ROWS if gpu_kernels(q.device) else CPU_BLOCK_ROWS
    for s in range(0, t, rows):
        e = min(s + rows, t)
        gs, ge = offset + s, offset + e  # the block's row indices
        lo = max(0, gs - window + 1)
        keys = kv[:, lo:ge]
        scores = torch.einsum("brhd,bkd->bhrk", q[:, s:e].float(), keys.float()) * scale
        rel = pos[gs:ge, None] - pos[None, lo:ge]
        allowed = ((rel >= 0) & (rel < window)).unsqueeze(0)
        if doc is not None:
            allowed = allowed & (doc[:, gs:ge, None] == doc[:, None, lo:ge])
        parts = [scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))]
        if entries is not None and entries.shape[1]:
            comp = torch.einsum("brhd,bkd->bhrk", q[:, s:e].float(), entries.float()) * scale
            parts.append(comp.masked_fill(~entry_mask[:, s:e].unsqueeze(1), float("-inf")))
        parts.append(sink.expand(b, h, e - s, 1))
        probs = torch.cat(parts, dim=-1).softmax(dim=-1)
        n_raw = ge - lo
        o = torch.einsum("bhrk,bkd->brhd", probs[..., :n_raw], keys.float())
        if len(parts) == 3:
            o = o + torch.einsum("bhrk,bkd->brhd", probs[..., n_raw:-1], entries.float())
            entry_probs.append(probs[..., n_raw:-1].detach().sum(dim=1))
        out.append(o.to(q.dtype))
    return torch.cat(out, dim=1), torch.cat(entry_probs, dim=1) if entry_probs else None


def indexer_kl(
    scores: torch.Tensor,
    probs: torch.Tensor,
    support: torch.Tensor,
    chosen: torch.Tensor | None,
    real: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's KL rule (DSA's, over compressed entries): per query, the target is the attention's
    probabilities of the entries in `support` (normalised with the window and the sink, summed over heads),
    L1-normalised; the loss KL(target || softmax of the index scores over the support), queries without an
    entry skipped, and padding's (`real` (B, T) False) too, as in DSA (dsa.Target.real). -> (d KL sum / d
    scores (fp32), fp64 [KL sum, queries, recall sum, recall queries]); the recall (target mass inside the
    selection `chosen`) where the support is not the selection itself."""
    if real is not None:
        support = support & real.unsqueeze(-1)
    has = support.any(dim=-1, keepdim=True)
    p = torch.where(support, probs.double(), 0.0)
    p = p / p.sum(dim=-1, keepdim=True).clamp(min=1e-30)
    logq = scores.detach().double().masked_fill(~support, float("-inf")).masked_fill(~has, 0.0)
    logq = logq.log_softmax(dim=-1)
    kl = torch.where(support, torch.xlogy(p, p) - p * logq.masked_fill(~support, 0.0), 0.0).sum()
    grad = torch.where(support & has, logq.exp() - p, 0.0).float()
    queries = has.sum(dtype=torch.float64)
    if chosen is None:
        return grad, torch.stack([kl, queries, kl.new_zeros(()), kl.new_zeros(())])
    recall = (p * chosen).sum(dtype=torch.float64)
    return grad, torch.stack([kl, queries, recall, queries])


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


class V4Attention(nn.Module):
    # Tensor parallelism (dstrain.parallel.tp) keeps a rank's heads and output groups and sets these two: the
    # shared key=value head and the compressed entries, used by every rank's heads, pass `all_heads` (their
    # gradient summed over the ranks); the entries' attention probabilities, summed over this rank's heads,
    # pass `head_sum` (the indexer's target sums every head's).
    all_heads: Any = staticmethod(_same)
    head_sum: Any = staticmethod(_same)

    def __init__(self, cfg: V4Config, layer_idx: int) -> None:
        super().__init__()
        self.kind = cfg.attention_type(layer_idx)
        self.rope_kind = "main" if self.kind == SLIDING else "compress"
        self.heads, self.head_dim, self.groups = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        self.window, self.eps = cfg.sliding_window, cfg.rms_norm_eps
        h, d, hidden = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        self.q_a_proj = Linear(hidden, cfg.q_lora_rank, bias=False)
        self.q_a_norm = V4RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = Linear(cfg.q_lora_rank, h * d, bias=False)
        self.kv_proj = Linear(hidden, d, bias=False)
        self.kv_norm = V4RMSNorm(d, cfg.rms_norm_eps)
        # block-diagonal: group g maps its heads' (H / G) * d outputs to o_lora_rank
        self.o_a_proj = Linear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.o_b_proj = Linear(cfg.o_groups * cfg.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.empty(h))
        self.compressor: Compressor | None = None
        self.sparse: SparseSettings | None = (
            None  # CSA: its indexer's stage (DeepSeekV4LM.set_sparse_attention)
        )
        if self.kind != SLIDING:
            rate = cfg.compress_rates[self.kind]
            self.compressor = Compressor(hidden, d, rate, self.kind == CSA, cfg.rms_norm_eps)
            if self.kind == CSA:
                self.compressor.indexer = Indexer(cfg)
                self.sparse = SparseSettings(layer_idx, layer_idx)

    def forward(self, x: torch.Tensor, inputs: V4Inputs) -> torch.Tensor:
        """x (B, T, hidden) -> (B, T, hidden)."""
        b, t, _ = x.shape
        cos, sin = inputs.cos_sin(self.rope_kind)
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms(self.q_b_proj(q_res).view(b, t, self.heads, self.head_dim), self.eps)
        q = rotate(q, cos.unsqueeze(2), sin.unsqueeze(2))
        kv = self.all_heads(inputs.whole(rotate(self.kv_norm(self.kv_proj(x)), cos, sin)))
        entries = mask = None
        if self.compressor is not None:
            whole_x = inputs.whole(x)  # the compressors pool the whole rows
            entries, visible = self._entries(whole_x, inputs, t)
            entries, mask = self.all_heads(entries), visible
        if self.sparse is not None and entries.shape[1]:
            scores, chosen = self._index(x, whole_x, q_res, inputs, visible)
            mask = visible if self.sparse.dense else chosen
        o, probs = attend(q, kv, entries, mask, self.sinks, self.window, inputs.doc, inputs.offset)
        if self.sparse is not None and entries.shape[1] and (self.sparse.loss or not self.training):
            o = self._indexer_loss(
                o, scores, self.head_sum(probs), mask, None if mask is chosen else chosen, inputs
            )
        o = rotate(o, cos.unsqueeze(2), -sin.unsqueeze(2))  # the value's rotation undone at the query
        grouped = o.reshape(b, t, self.groups, -1)
        # with LoRA: W + BA; a stored base weight dequantized
        w = getattr(self.o_a_proj, "effective_weight", lambda: dense_weight(self.o_a_proj.weight, x.dtype))()
        qat = self.o_a_proj._modules.get("qat")
        if qat is not None:  # QAT: the (merged) weight as the export quantizes it
            w = qat(w.float()).to(x.dtype)
        w = w.view(self.groups, -1, grouped.shape[-1])
        return self.o_b_proj(torch.einsum("btgi,gri->btgr", grouped, w).flatten(2))

    def _entries(self, whole_x: torch.Tensor, inputs: V4Inputs, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> the compressed entries of the whole rows, rotated (B, n, d), and which each of this forward's
        `t` queries sees (B, t, n)."""
        comp = self.compressor
        raw = comp.entries(whole_x, inputs.doc)
        nw = raw.shape[1]
        cos, sin = inputs.entry_cos_sin(comp.rate, nw)
        rows = torch.arange(inputs.offset, inputs.offset + t, device=whole_x.device)
        visible = visible_entries(comp, nw, inputs.doc, rows).expand(whole_x.shape[0], -1, -1)
        return rotate(raw, cos, sin), visible

    def _index(self, x, whole_x, q_res, inputs, visible):  # noqa: ANN001, ANN202
        """-> the index scores (B, T, n) fp32 of this forward's queries, with autograd to the indexer only
        (its inputs detached: the main model learns from the LM loss alone), and each query's chosen entries."""
        indexer = self.compressor.indexer
        x, q_res = x.detach(), q_res.detach()
        keys = rotate(
            indexer.entries(whole_x.detach(), inputs.doc),
            *inputs.entry_cos_sin(indexer.rate, visible.shape[-1]),
        )
        scores = indexer.scores(x, q_res, keys, inputs.cos_sin("compress"))
        return scores, indexer.select(scores.detach(), visible)

    def _indexer_loss(self, o, scores, probs, support, chosen, inputs):  # noqa: ANN001, ANN202
        grad, stats = indexer_kl(scores, probs, support, chosen, inputs.real)
        inputs.stats[self.sparse.layer] = stats
        if self.training and torch.is_grad_enabled() and scores.requires_grad:
            real = inputs.real  # the default: the mean over the forward's real queries
            queries = real.sum().clamp(min=1) if real is not None else scores.shape[0] * scores.shape[1]
            factor = self.sparse.grad_scale if self.sparse.grad_scale is not None else 1.0 / queries
            o = inject(o, factor, (scores,), (grad,))
        return o
