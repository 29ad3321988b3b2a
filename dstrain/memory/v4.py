"""DeepSeek-V4's layers as the memory estimate sizes them (shapes.py's `Shapes`, for model/deepseek_v4):
what differs from the V3 family is the block. The embedding, the head's cross-entropy, the routed experts, the
optimizer, ZeRO and the pipeline are estimate.py's, unchanged.

A block's activations, from what its ops save for backward (V4 keeps no custom autograd but mHC's expand and
the experts', so each op's own saved tensors are what stays):
- mHC (mhc.py), per sublayer: the block carries `hc_mult` streams (B, T, n, D); HyperConnection keeps the
  unweighted RMS of the flat streams in fp32 (and, in bf16, their fp32 copy), every Sinkhorn iteration's
  (n x n) per token, and expand its inputs (the streams as they came, the sublayer's output). 'mhc' checkpointing
  recomputes the weights: only the streams and the small post / comb stay.
- V4RMSNorm saves its input in fp32 and the fp32 normalised value (it multiplies the weight in fp32).
- Attention (attention.py): q_a and its norm, q = heads x head_dim through an unweighted RMS (fp32) and the
  rotation, the ONE key=value head, and per block of query rows (CPU_BLOCK_ROWS, GPU_BLOCK_ROWS) the
  fp32 probabilities over (the window + the block's rows, the compressed entries, the sink) — every block's
  kept for backward, so they grow with T x (window + entries) per head. The grouped output (o_groups x
  o_lora_rank) keeps its input and the low-rank output.
- Compressors (HCA; CSA overlapping at 2x width) keep the projected rows and the gate's fp32 softmax; CSA's
  lightning indexer scores every (query, index head, entry) in fp32 at once: kept (ReLU, scaled) when it learns
  (--dsa_stage dense or sparse), a forward temporary when frozen (LoRA's default).
- MoE: V4's router (sqrt(softplus) fp32 scores), the routed experts (estimate.py's), one shared expert with
  the SwiGLU clamp; a hash layer sizes as a biased one (its table is a buffer of vocabulary x k ids).

Tensor parallelism splits the query heads (and sinks), the output groups and the shared expert (tp_sizes).
Not modelled: the rope tables, the hash layers' token tables (vocabulary x k int64 buffers), routing counts.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from dstrain.model.deepseek_v4.attention import CPU_BLOCK_ROWS, GPU_BLOCK_ROWS
from dstrain.model.deepseek_v4.config import CSA, SLIDING

from .shapes import Layer, Shapes

if TYPE_CHECKING:
    from .workload import Workload


class MhcSizes(Shapes):
    """mHC's sizes on one rank (model/common/mhc.py: `hc_mult` residual streams, a HyperConnection per
    sublayer, replicated under tensor parallelism): DeepSeek-V4's and GLM-5.3-Flash's (memory/glm5_next.py)
    blocks share them."""

    def streams(self) -> int:
        """Bytes of the residual streams of the micro batch (what a pipeline stage sends)."""
        return self.n * self.cfg.hc_mult * self.cfg.hidden_size * self.a

    def boundary_width(self) -> int:
        return self.cfg.hc_mult * self.cfg.hidden_size

    def hc_tensors(self) -> tuple[list[int], int]:
        """(elements of a block's two HyperConnections' tensors: fn, base, scale each; of the 1-D ones)."""
        d, n = self.cfg.hidden_size, self.cfg.hc_mult
        mix = (2 + n) * n
        return [mix * n * d, mix, 3] * 2, 2 * (mix + 3)

    def hc_saved(self) -> tuple[int, int]:
        """One sublayer's mHC -> (what its weights keep, recomputed under 'mhc'; what stays: the streams'
        fp32 product with pre in collapse is not kept, its output is)."""
        c, n = self.cfg, self.n
        flat, k = n * c.hc_mult * c.hidden_size, c.hc_mult
        # each Sinkhorn iteration's two divisions keep their (n x n) numerator and (n) denominator
        sinkhorn = 2 * c.hc_sinkhorn_iters * n * (k * k + k) * 4
        weights = flat * (4 + (4 if self.a == 2 else 0)) + sinkhorn + 2 * n * (2 + k) * k * 4
        return weights, self.streams() + n * c.hidden_size * self.a + n * (k + k * k) * 4

    def hc_mixing(self) -> int:
        """expand's fp32 mixing of the streams (a forward temporary; three of them in its backward)."""
        return 2 * self.n * self.cfg.hc_mult * self.cfg.hidden_size * 4


class V4Shapes(MhcSizes):
    """Parameter and activation sizes of one rank's DeepSeek-V4 layers."""

    def __init__(self, w: Workload) -> None:
        super().__init__(w)
        # tensor parallelism (model/deepseek_v4 tp_sizes) splits the query heads with their sinks, the output
        # projection's groups and the shared expert's hidden size; the rest is replicated
        self.groups = self.cfg.o_groups // self.tp
        self.shared = self.cfg.moe_intermediate_size // self.tp

    # parameters --------------------------------------------------------------------------------------------
    def compressor(self, dim: int, rate: int, overlap: bool) -> list[int]:
        width = 2 * dim if overlap else dim
        d = self.cfg.hidden_size
        return [d * width, d * width, rate * width, dim]

    def attention_tensors(self, index: int) -> tuple[list[int], int]:
        """(elements of each attention tensor, of its 1-D ones) of layer `index` (flops._block_params')."""
        c = self.cfg
        d, h, hd, rq = c.hidden_size, self.heads, c.head_dim, c.q_lora_rank
        g, ro = self.groups, c.o_lora_rank
        out = [d * rq, rq, rq * h * hd, d * hd, hd, g * ro * h * hd // g, d * g * ro, h]
        vectors = rq + hd + h
        kind = c.attention_type(index)
        if kind != SLIDING:
            out += self.compressor(hd, c.compress_rate(index), kind == CSA)
            vectors += hd
        if kind == CSA:
            hi, di = c.index_n_heads, c.index_head_dim
            out += self.compressor(di, c.compress_rates[CSA], True) + [rq * hi * di, d * hi]
            vectors += di
        return out, vectors

    def block(self, index: int) -> Layer:
        kind = self.cfg.attention_type(index)  # blocks of one attention kind have the same sizes
        if kind not in self._blocks:
            self._blocks[kind] = self._block(index)
        block = self._blocks[kind]
        return dataclasses.replace(
            block, name=f"block {index}", tensors=list(block.tensors), stored=list(block.stored)
        )

    def _block(self, index: int) -> Layer:
        c, d = self.cfg, self.cfg.hidden_size
        attention, vectors = self.attention_tensors(index)
        hc, hc_vectors = self.hc_tensors()  # the attention's and the FFN's mHC
        moe = [c.n_routed_experts * d, *[d * self.shared] * 3]  # router, shared expert
        layer = Layer("block", tensors=[d, d, *attention, *hc, *moe], vectors=2 * d + vectors + hc_vectors)
        layer.experts = 3 * (c.n_routed_experts // self.ep) * d * c.moe_intermediate_size
        self.store_v4(layer, index)
        self.activations(layer, index)
        return layer

    def store_v4(self, layer: Layer, index: int) -> None:
        if self.w.stored is not None:
            layer.stored, layer.experts_stored = self.w.stored.linears(
                self.cfg, self.matrices(index), self.ep
            )

    def matrices(self, index: int) -> list[tuple[str, int, int]]:
        """(kind, rows, columns) of block `index`'s linears (stored.KINDS; the routers, the indexer's head
        weights and mHC are never quantized)."""
        c = self.cfg
        d, h, hd, rq = c.hidden_size, self.heads, c.head_dim, c.q_lora_rank
        go = self.groups * c.o_lora_rank
        out = [(rq, d), (h * hd, rq), (hd, d), (go, h * hd // self.groups), (d, go)]
        kind = c.attention_type(index)
        if kind != SLIDING:
            out += [(hd * (2 if kind == CSA else 1), d)] * 2
        mats = [("attention", r, k) for r, k in out]
        if kind == CSA:
            di = c.index_head_dim
            mats += [("indexer", 2 * di, d)] * 2 + [("indexer", c.index_n_heads * di, rq)]
        return mats + [("shared", self.shared, d)] * 2 + [("shared", d, self.shared)]

    def mtp(self, depth: int) -> Layer:
        """MTP depth k: e_proj and h_proj (h_proj on every stream), enorm, hnorm, norm, its own HC head, a
        block, the shared head."""
        c = self.cfg
        d, n = c.hidden_size, c.hc_mult
        layer = self.block(c.num_hidden_layers + depth - 1)
        layer.name = f"MTP {depth}"
        layer.tensors += [d * d, d * d, d, d, d, n * n * d, n, 1]
        layer.vectors += 3 * d + n + 1
        stored = self.w.stored
        if stored is not None and not stored.mtp:  # the MTP modules train: parameters, dense
            layer.forward -= layer.dequant[0]
            layer.backward -= layer.dequant[1]
            layer.stored, layer.experts_stored, layer.dequant = [], 0, (0, 0)
        elif stored is not None and stored.of("mtp") is not None:
            layer.stored += [(d * d, stored.of("mtp").nbytes(d, d))] * 2
        # enorm and e_proj's input, hnorm over the streams (in fp32 its input is the streams, held) and h_proj's
        # input (every stream); its HC head and norm
        hnorm = self.v4_norm(n * d) - (self.n * n * d * 4 if self.a == 4 else 0)
        layer.saved += self.v4_norm(d) + self.n * d * self.a + hnorm + self.streams() + self.hc_head_saved()
        return layer

    def head(self) -> Layer:
        """The HC head (collapsing the streams), the final norm and the output head."""
        c = self.cfg
        d, n = c.hidden_size, c.hc_mult
        own = [] if c.tie_word_embeddings else [c.vocab_size * d]
        return Layer("head", tensors=[n * n * d, n, 1, d, *own], saved=self.hc_head_saved(),
                     backward=3 * self.n * d * self.a + 2 * self.n * n * d * 4, vectors=d + n + 1,
                     matrices=False)  # fmt: skip

    # activations -----------------------------------------------------------------------------------------
    def v4_norm(self, width: int) -> int:
        """V4RMSNorm: its input in fp32 (an fp32 copy of a bf16 one), the fp32 normalised value, rsqrt."""
        return self.n * width * 8 + 4 * self.n

    def hc_head_saved(self) -> int:
        """HyperHead: the streams it collapses (a block's output, kept by nothing else), the unweighted RMS of
        the flat streams in fp32 (+ their fp32 copy in bf16); then the final V4RMSNorm."""
        c = self.cfg
        flat = self.n * c.hc_mult * c.hidden_size
        return flat * (self.a + 4 + (4 if self.a == 2 else 0)) + self.v4_norm(c.hidden_size)

    def entries(self, index: int) -> int:
        """Compressed entries of the whole rows of layer `index` (sequence parallelism gathers them)."""
        rate = self.cfg.compress_rate(index)
        return self.w.seq_len // rate if rate else 0

    def attention_core(self, index: int) -> tuple[int, int]:
        """-> (what every block of query rows keeps, the largest block's scores): a block of r rows scores
        against the window's keys before it and its own rows, the entries and the sink, and keeps the fp32
        probabilities and the einsums' copies of them and of its queries; in bf16 also the fp32 copies of its
        keys and entries."""
        c, b, h, hd = self.cfg, self.b, self.heads, self.cfg.head_dim
        rows = CPU_BLOCK_ROWS if self.cpu else GPU_BLOCK_ROWS
        entries, window = self.entries(index), c.sliding_window
        scores = largest = keys = 0
        for s in range(0, self.t, rows):
            e = min(s + rows, self.t)
            per = (e - max(0, s - window + 1)) + entries + 1
            scores += (e - s) * per
            keys += per - 1
            largest = max(largest, (e - s) * per)
        # the probabilities, the einsums' copies of them and of the queries (one per einsum: two with entries)
        kept = 2 * b * h * scores * 4 + self.n * h * hd * 4 * (2 if entries else 1)
        if self.a == 2:  # the fp32 copies of the keys and entries (two einsums each)
            kept += 2 * b * keys * hd * 4
        return kept, b * h * largest * 4

    def indexer_scores(self, index: int) -> int:
        """Bytes of one (B, T, index heads, entries) fp32 tensor of CSA's indexer (0 elsewhere)."""
        c = self.cfg
        if c.attention_type(index) != CSA:
            return 0
        return self.n * c.index_n_heads * self.entries(index) * 4

    def activations(self, layer: Layer, index: int) -> None:
        c, n, a = self.cfg, self.n, self.a
        d, h, hd, rq = c.hidden_size, self.heads, c.head_dim, c.q_lora_rank
        weights, streams = self.hc_saved()
        # attention: input norm and output, q_a's norm and output, q and its unweighted RMS (fp32, in bf16 a
        # copy) and rotation, the key=value head through its norm and rotation, the blocks of rows
        r = c.qk_rope_head_dim  # in bf16 a rotation keeps an fp32 copy of the rotary dims
        q = n * h * hd * a if a == 4 else n * h * (hd * (2 + 4) + r * 4)
        attn = self.v4_norm(d) + n * d * a + self.v4_norm(rq) + n * rq * a + q
        core, block = self.attention_core(index)
        attn += self.v4_norm(hd) + 2 * n * hd * a + core
        back = n * h * hd * a if a == 4 else n * h * r * 4  # rotated back at the query
        attn += back + n * h * hd * a + n * self.groups * c.o_lora_rank * a  # grouped, o_b's input
        kind, whole = c.attention_type(index), self.b * self.w.seq_len
        learns = kind == CSA and self.w.dsa_stage != "frozen"
        scores = self.indexer_scores(index)
        if kind != SLIDING:  # the compressor: projected rows and the gate's fp32 softmax (bf16: and its copy)
            attn += whole * hd * (2 if kind == CSA else 1) * 8
        if learns:  # the indexer's compressor, queries, its scores (ReLU'd, scaled) and the KL's gradient
            di = c.index_head_dim
            attn += whole * 2 * di * 8 + n * c.index_n_heads * di * 4 * 2 + 2 * scores
            attn += 3 * n * self.entries(index) * 4
        # FFN: its norm and output, the router, the routed experts (estimate.py's), the shared expert clamped
        inter, e, k = c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok
        router = 8 * n * e + 16 * n * k + (4 * n * d + 4 * e * d if a == 2 else 0)
        rows = self.routed_rows()
        routed = 8 * n * k + rows * 2 * inter * a
        if self.ep > 1:
            routed += 2 * rows * d * a + 8 * rows + n * k * d * 4 + 8 * n * k
        shared = self.swiglu(self.shared) + 2 * n * self.shared * a  # + the clamped gate and up
        ffn = self.v4_norm(d) + n * d * a + router + routed + shared
        mode = self.w.checkpointing
        full = 2 * streams + 2 * weights + attn + ffn
        layer.saved = {"none": full, "mhc": full - 2 * weights, "full": self.streams()}[mode]
        recomputed = {"none": 0, "mhc": weights, "full": full - self.streams()}[mode]
        # forward: the running block of scores (the scores, masked, concatenated and the softmax), the
        # indexer's (B, T, heads, entries) beyond what it keeps (frozen: two at a time, learning: one), the
        # experts' rows, expand's fp32 mixing
        rows_fwd, work = self.mlp_work(True)
        mixing = self.hc_mixing()
        index_fwd = (1 if learns else 2) * scores
        fwd = max(4 * block, index_fwd, rows_fwd, mixing)
        bwd = max(4 * block + 2 * n * h * hd * 4, 3 * scores if learns else 0, work, 3 * mixing)
        linear, held, peak = self.dequantized(layer, True)
        layer.forward = max(fwd, rows_fwd + held, peak, linear)
        layer.backward = recomputed + 2 * self.streams() + max(bwd, work + held, peak, linear)
        layer.dequant = (layer.forward - fwd, layer.backward - recomputed - 2 * self.streams() - bwd)
