"""Kimi Linear's layers as the memory estimate sizes them (shapes.py's `Shapes`, for model/kimi_linear): its
MLA layers are V3's without rotary embedding (NoPE: the same tensors, no rotation), its MLPs V3's (a dense first
MLP, then MoE with shared experts), no MTP; what differs is the KDA layer (model/common/kda.py). The embedding,
the head's cross-entropy, the optimizer, ZeRO and the pipeline are estimate.py's, unchanged.

A KDA layer's activations, from what its ops save for backward (no custom autograd: each op's own saved tensors
are what stays). Per token and head (d_k = d_v = linear_head_dim, C = kda.CHUNK tokens per chunk):
- the projections' input, the forget gate's and output gate's low-rank (d_k) inputs; the forget gate's fp32
  exp, log input, softplus and where-mask; beta's sigmoid (and its fp32 copy in bf16);
- per q, k, v the short convolution's input and its (T + K - 1)-long output (SiLU's input), and the fp32 SiLU
  output q and k are L2-normalised from (with their norms); the normalised q and k;
- the chunked delta rule (`kda_chunked`), all fp32: the pairwise decays exp(G_i - G_j) (C x d_k per token and
  head) and each einsum's broadcast product q_i * k_j and k_i * k_j of the same size, i.e. 3 C x q's fp32
  size, the dominant term; the C x C scores, the delta rule's writes and the WY system; the solved [u | w] and
  its right-hand side; the decays to each chunk's end; per chunk the fp32 state entering it (d_k x d_v per head)
  and the loop's q, k and u-sized products;
- the gated RMSNorm's fp32 input, statistics, normalised value, sigmoid gate and product; o_proj's input.
Tensor parallelism keeps whole KDA heads (parallel/tp.py `_split_kda`: the low-rank gate inputs replicated);
sequence parallelism (Ulysses) trades q/k/v, g and beta for a slice of the heads over whole rows, so the
chunked rule runs on (whole rows) x (heads / sp): the same elements per rank as the tokens divided.

Working memory: the forward's temporaries stay under what the layer goes on to save (the gated norm's fp32
ones are its peak above it); backward, an einsum's gradients with respect to the decays and to its product
exist at once (2 x the decays, measured). Tested: the activations against autograd's saved tensors, the peak
against a measured CPU run (tests/memory).

Not modelled: a padded last chunk's copies (rows not a multiple of CHUNK), packed documents' masks and state
resets; einsum's contraction order as torch picks it without opt_einsum (with it installed the saved products
may differ); a stored base (--base_precision stored) keeps KDA's linears as parameters (Kimi Linear's release
is bf16: only a folder of another quantization would store them).
"""

from __future__ import annotations

import dataclasses

from dstrain.model.common.kda import CHUNK

from .shapes import Layer, Shapes


class KdaSizes(Shapes):
    """A KDA layer's sizes on one rank (parameters, stored base, activations): Kimi Linear's and GLM-5.3-Flash's
    (memory/glm5_next.py) layers share them; the config reads transformers' `linear_*` fields."""

    @property
    def kda_heads(self) -> int:
        """A rank's KDA heads (tensor parallelism keeps whole heads)."""
        return self.cfg.linear_num_heads // self.tp

    # parameters --------------------------------------------------------------------------------------------
    def kda_tensors(self) -> tuple[list[int], int]:
        """(elements of each KDA tensor on this rank, of its 1-D ones): q, k, v, their convolutions, the forget
        gate (f_a replicated, f_b, A_log, dt_bias), b_proj, the output gate (g_a replicated, g_b), the norm's
        weight (replicated), o_proj (flops._kda_params)."""
        c = self.cfg
        d, dk, h, taps = c.hidden_size, c.linear_head_dim, self.kda_heads, c.linear_conv_kernel_dim
        inner = h * dk
        out = [d * inner] * 3 + [inner * taps] * 3 + [d * dk, dk * inner, h, inner, d * h, d * dk, dk * inner]
        return out + [dk, inner * d], inner + dk

    def store_kda(self, layer: Layer, moe: bool) -> None:
        """A KDA block's weights a stored base holds: the MLP's linears and the experts as V3's; KDA's stay
        parameters."""
        c, d = self.cfg, self.cfg.hidden_size
        if self.w.stored is not None:
            width = c.moe_intermediate_size * c.n_shared_experts if moe else c.intermediate_size
            kind = "shared" if moe else "mlp"
            mats = [(kind, width // self.tp, d)] * 2 + [(kind, d, width // self.tp)] if width else []
            layer.stored, layer.experts_stored = self.w.stored.linears(c, mats, self.ep if moe else 0)

    # activations -------------------------------------------------------------------------------------------
    def kda_activations(self) -> tuple[int, int, int]:
        """-> (what a KDA layer saves, its forward and backward temporaries)."""
        c, n, a, b = self.cfg, self.n, self.a, self.b
        d, dk, h, taps = c.hidden_size, c.linear_head_dim, self.kda_heads, c.linear_conv_kernel_dim
        inner = h * dk  # per token, this rank's heads (under sp: n * inner = rows x heads / sp x d_k)
        sp, rows = self.w.dims.sp, self.w.seq_len
        heads = h // sp  # heads of the chunked rule, over whole rows
        chunks = -(-rows // CHUNK)
        r = b * chunks * CHUNK * heads  # (token, head) pairs of the chunked rule, padded
        # input_layernorm and its output (the projections' input), f_a's and g_a's outputs; the forget gate in
        # fp32: Kimi's softplus form its exp, log input, softplus and where-mask, the bounded form (GLM's,
        # `linear_lower_bound`) the product's input and the sigmoid; beta's sigmoid (bf16: and its fp32 copy)
        gate = 13 if getattr(c, "linear_lower_bound", None) is None else 8
        out = (
            self.norm(d) + n * d * a + 2 * n * dk * a + n * inner * gate + n * h * (a + (4 if a == 2 else 0))
        )
        # q, k, v: the convolution's input and output (K - 1 longer), the fp32 SiLU output of q and k, their
        # norms, the normalised q and k
        conv = b * heads * dk * (rows + taps - 1) * a
        out += 3 * (n * inner * a + conv) + 2 * (n * inner * 4 + n * h * 4) + 2 * n * inner * 4
        # the chunked rule: pairwise decays and the einsums' two broadcast products; the scores, the writes
        # (before and after beta) and the WY system; exp(cum), [v | k exp(cum)], the solution, the decays to
        # the chunk's end; in the loop the state entering each chunk, q exp(cum), the written keys, u
        out += 3 * r * CHUNK * dk * 4 + 3 * r * CHUNK * 4
        out += r * dk * 4 + 2 * r * 2 * dk * 4 + r * dk * 4
        out += b * heads * chunks * dk * dk * 4 + 3 * r * dk * 4 + r * dk * 4 + b * heads * chunks * dk * 4
        # the gated norm: its fp32 input, rsqrt, normalised, the sigmoid gate, the weighted product; o_proj's input
        out += 4 * n * inner * 4 + n * h * 4 + n * inner * a
        # forward: what is saved grows past the pairwise differences' masked copy (a forward temporary), so the
        # gated norm's fp32 temporaries are its peak above them; backward: an einsum's gradient with respect
        # to the decays and to its broadcast product at once (measured: 2.0-2.1 x the decays' size)
        pair = r * CHUNK * dk * 4
        return out, 3 * n * inner * 4, 2 * pair


class KimiLinearShapes(KdaSizes):
    """Parameter and activation sizes of one rank's Kimi Linear layers."""

    def block(self, index: int) -> Layer:
        key = (self.cfg.is_kda_layer(index), self.cfg.is_moe_layer(index))
        if key not in self._blocks:  # blocks of one kind have the same sizes
            self._blocks[key] = self._kda_block(key[1]) if key[0] else self._block(key[1])
        block = self._blocks[key]
        return dataclasses.replace(
            block, name=f"block {index}", tensors=list(block.tensors), stored=list(block.stored)
        )

    def _kda_block(self, moe: bool) -> Layer:
        d = self.cfg.hidden_size
        tensors, vectors = self.kda_tensors()
        layer = Layer("block", tensors=[d, d, *tensors], vectors=2 * d + vectors)
        self.add_ffn(layer, moe)
        self.store_kda(layer, moe)
        self.block_activations(layer, moe, attention=self.kda_activations())
        return layer
