"""GLM-5.3-Flash's layers as the memory estimate sizes them (shapes.py's `Shapes`, for model/glm5_next): its
parts are sized where they are defined — mHC's streams and weights as DeepSeek-V4's (v4.py `MhcSizes`), the KDA
layers as Kimi Linear's with the bounded forget gate (kimi_linear.py `KdaSizes`), the DSA layers' NoPE MLA, the
MoE (one shared expert) and the dense first MLP as the V3 family's (estimate.py). The embedding, the head and
its cross-entropy, the optimizer, ZeRO and the rest are estimate.py's, unchanged.

What is GLM's own (from what its ops save for backward; no custom autograd but mHC's expand, the experts' and
the attention kernel's):
- every SwiGLU is clamped (`swiglu_limit`): the dense MLP's and the shared expert's clamps keep their raw gate
  and up (the routed experts' Function keeps its pre-activation only, as unclamped);
- a DSA layer attends the keys its k-pool indexer selected (indexer.py): (B, T, width x kpool + kpool - 1)
  int64 (width = min(index_topk / kpool, pools)), kept by the attention (a GPU's Triton kernel also keeps its
  int32 usable keys) and shared with the "shared" layers that reuse them (kept once per full layer). A
  learning indexer (--dsa_stage dense or sparse) keeps k_norm's fp32 input and statistics, the pool keys'
  fp32 softmax over their tokens, its (compute dtype) probabilities and the gathered token keys, and the KL's
  gradients injected into backward: d q (B, T, heads, dim), d pool keys (B, pools, dim), d w fp32 (B, T, heads);
  while it runs (no grad), blocks of query rows (SCORE_ELEMENTS) of the main attention's fp32 scores for the
  KL target, and the gradients' fp32 accumulators;
- MTP: enorm on the embedding, hnorm over every stream, eh_proj's input (every stream's [e, h]); the final
  collapse is an unweighted mean (no parameters), then the norm.

Tensor parallelism splits KDA's and MLA's heads (parallel/tp.py; the indexer and mHC replicated). Checkpointing:
"none" and "full" (a block keeps its input streams). Not modelled: the k-pool bookkeeping (Pools: a few (B, T)
int64 tensors per forward), packed documents' masks, KDA's as kimi_linear.py says.
"""

from __future__ import annotations

import dataclasses

from dstrain.model.common.dsa import SCORE_ELEMENTS

from .kimi_linear import KdaSizes
from .shapes import Layer
from .v4 import MhcSizes


class Glm5NextShapes(MhcSizes, KdaSizes):
    """Parameter and activation sizes of one rank's GLM-5.3-Flash layers."""

    def block(self, index: int) -> Layer:
        c = self.cfg
        key = (c.is_kda_layer(index), c.is_moe_layer(index), c.has_indexer(index))
        if key not in self._blocks:  # blocks of one kind have the same sizes
            self._blocks[key] = self._glm_block(*key)
        block = self._blocks[key]
        return dataclasses.replace(
            block, name=f"block {index}", tensors=list(block.tensors), stored=list(block.stored)
        )

    # parameters --------------------------------------------------------------------------------------------
    def indexer_tensors(self) -> list[int]:
        """V3.2's lightning indexer and the k-pool compression's position bias and gate (flops._indexer_params)."""
        c = self.cfg
        return [
            *super().indexer_tensors(),
            c.index_kpool * c.index_head_dim,
            c.index_head_dim * c.hidden_size,
        ]

    def _glm_block(self, kda: bool, moe: bool, indexer: bool) -> Layer:
        c, d = self.cfg, self.cfg.hidden_size
        hc, hc_vectors = self.hc_tensors()
        if kda:
            attention, vectors = self.kda_tensors()
        else:
            attention, vectors = self.attention_tensors(), self.attention_vectors()
            if indexer:
                attention += self.indexer_tensors()
                vectors += 2 * c.index_head_dim  # its key LayerNorm
        layer = Layer("block", tensors=[d, d, *attention, *hc], vectors=2 * d + vectors + hc_vectors)
        self.add_ffn(layer, moe)
        if kda:
            self.store_kda(layer, moe)
        else:
            self.store(layer, moe, indexer)
        self.glm_activations(layer, kda, moe, indexer)
        return layer

    # activations -------------------------------------------------------------------------------------------
    def mtp_saved(self) -> int:
        """enorm, hnorm over every stream, eh_proj's input ([e, h] per stream), shared_head_norm."""
        c, n, a = self.cfg, self.n, self.a
        d, k = c.hidden_size, c.hc_mult
        return 2 * self.norm(d) + k * self.norm(d) + n * k * 2 * d * a

    def selected(self) -> int:
        """Keys each query attends in a sparse DSA layer (0: every key, dense)."""
        c, w = self.cfg, self.w
        t, kpool = w.seq_len, c.index_kpool
        width = min(c.index_topk // kpool, -(-t // kpool)) * kpool + kpool - 1
        return width if w.dsa_stage != "dense" and width < t else 0

    def dsa_activations(self, indexer: bool) -> tuple[int, int, int]:
        """-> (what a DSA layer saves, its forward and backward temporaries): MLA's (NoPE: V3's tensors without
        the rotation), the selected keys (its own, or a shared layer's source's), a learning indexer's."""
        c, n, a, b, w = self.cfg, self.n, self.a, self.b, self.w
        keys = self.selected()
        out = self.attention_saved() + n * keys * ((8 if indexer else 0) + (0 if self.cpu else 4))
        heads = n * self.heads * c.qk_head_dim * a  # attention's q/k/v-sized temporaries
        fwd, bwd = 3 * heads, 5 * heads
        if not indexer:
            return out, fwd, bwd
        hi, di, t = c.index_n_heads, c.index_head_dim, w.seq_len
        pools = b * -(-t // c.index_kpool)
        # selecting: a block of rows' fp32 index scores (scores, weighted, masked: three), its chosen pools
        rows = max(1, SCORE_ELEMENTS // (b * max(hi * pools // b, self.heads * t)))
        block = b * min(rows, t)
        select = 3 * block * hi * pools // b * 4 + block * keys * 8
        if w.dsa_stage != "frozen":
            # k_norm's fp32 input, mean and rstd (bf16: its weight and bias in fp32); the compression's slot
            # mask, fp32 softmax, probabilities and gathered keys; the injected KL gradients
            out += n * di * 4 + 8 * n + (8 * di if a == 2 else 0)
            out += n + n * di * 4 + 2 * n * di * a
            out += n * hi * di * a + pools * di * a + n * hi * 4
            # the target's block of fp32 head scores (the scores, masked, softmax), the main keys in fp32 (bf16),
            # the gradients' fp32 accumulators and, in bf16, fp32 copies of q, the pool keys, w
            grads = n * hi * di * 4 + pools * di * 4 + n * hi * 4
            select += 3 * block * self.heads * t * 4 + (n * self.heads * c.qk_head_dim * 4 if a == 2 else 0)
            select += grads * (2 if a == 2 else 1)
        return out, max(fwd, select), bwd

    def glm_activations(self, layer: Layer, kda: bool, moe: bool, indexer: bool) -> None:
        c, n, a = self.cfg, self.n, self.a
        d = c.hidden_size
        attn, attn_fwd, attn_bwd = self.kda_activations() if kda else self.dsa_activations(indexer)
        # FFN: post_attention_layernorm and its output, the MoE (V3's) or the dense MLP, each SwiGLU outside the
        # experts' Function also keeping its raw gate and up (the clamp)
        width = (
            c.moe_intermediate_size * c.n_shared_experts // self.tp if moe else c.intermediate_size // self.tp
        )
        ffn = self.norm(d) + n * d * a + (self.moe_saved() if moe else self.swiglu(width)) + 2 * n * width * a
        weights, stays = self.hc_saved()
        full = 2 * (weights + stays) + attn + ffn
        mode = self.w.checkpointing
        layer.saved = {"none": full, "full": self.streams()}[mode]
        recomputed = {"none": 0, "full": full - self.streams()}[mode]
        mlp_fwd, work = self.mlp_work(moe)
        mixing = self.hc_mixing()
        fwd = max(attn_fwd, mlp_fwd, mixing)
        bwd = max(attn_bwd, work, 3 * mixing)
        linear, held, peak = self.dequantized(layer, moe)
        layer.forward = max(fwd, mlp_fwd + held, peak, linear)
        # + the streams' gradients in and out, d output, d input
        grads = 2 * self.streams() + 2 * n * d * a
        layer.backward = recomputed + grads + max(bwd, work + held, peak, linear)
        layer.dequant = (layer.forward - fwd, layer.backward - recomputed - grads - bwd)
