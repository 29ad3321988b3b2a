"""GLM-5.3-Flash's causal LM (the text model) as plain single-device PyTorch: mHC residual streams (DeepSeek-V4's,
common/mhc.py), each block a KDA layer (common/kda.py, bounded forget gate) or a DSA layer (attention.py)
followed by a dense SwiGLU MLP or V3-style MoE (sigmoid routing, correction bias, one shared expert), every
SwiGLU clamped at swiglu_limit; the streams' final collapse an unweighted mean (transformers' Glm5NextTextHyperHead:
no parameters, unlike V4's), then the norm and head; MTP.

Module names are transformers' `Glm5NextTextModel` names (the language model's), except KDA's (the checkpoint's:
three short convolutions, the forget gate's tensors directly under `self_attn`) and the mHC tensors (`attn_hc.fn`
..., the files' `hc_attn_fn`: state_dict.py maps them). MTP (which transformers does not build; the published
folder holds it as layer `num_hidden_layers`): GLM-5's form per stream, eh_proj([enorm(embedding of the token k
ahead), hnorm(stream)]), one DSA + MoE block with its own indexer, the mean collapse, `shared_head.norm`, the
shared head. Packed rows: KDA restarts at each document, DSA attends within it and pools from its start.
Sequence parallelism (dstrain/parallel/sp.py): each rank embeds, mixes streams and routes its slice of every row;
KDA and DSA work over whole rows for a slice of the heads (the k-pool indexer over whole rows on every rank).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dstrain.batch import real_tokens, sequence_halo

from ..common.attention import attention_layout
from ..common.dsa import SparseControls
from ..common.kda import KDA, document_starts
from ..common.kernels import Linear
from ..common.layers import MLP, MoE, RMSNorm
from ..common.loss import Head
from ..common.mhc import HyperConnection, expand
from ..common.output import ModelOutput
from ..common.surface import BlockModelSurface, finish_streams, look_ahead, run_layers
from .attention import Context, DSAttention
from .config import Glm5NextConfig
from .indexer import make_pools, selection_width


class ClampedMoE(MoE):
    """common.layers.MoE with every SwiGLU (routed and shared experts) clamped at swiglu_limit."""

    def __init__(self, cfg: Glm5NextConfig) -> None:
        super().__init__(cfg)
        self.experts.limit = cfg.swiglu_limit
        if self.shared_experts is not None:
            self.shared_experts.limit = cfg.swiglu_limit


class Block(nn.Module):
    def __init__(self, cfg: Glm5NextConfig, layer_idx: int) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.kda = cfg.is_kda_layer(layer_idx)
        if self.kda:
            self.self_attn = KDA(d, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim, eps,
                                 lower_bound=cfg.linear_lower_bound)  # fmt: skip
        else:
            self.self_attn = DSAttention(cfg, layer_idx)
        self.mlp = (
            ClampedMoE(cfg)
            if cfg.is_moe_layer(layer_idx)
            else MLP(d, cfg.intermediate_size, cfg.swiglu_limit)
        )
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        hc = (d, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(self, streams: torch.Tensor, ctx: Context):  # noqa: ANN201
        """streams (B, T, n, D) -> (streams, balance loss or None, expert load or None)."""
        post, comb, x = self.attn_hc(streams)
        h = self.input_layernorm(x)
        out = self.self_attn(h, ctx.starts) if self.kda else self.self_attn(h, ctx)
        streams = expand(post, comb, out, streams)
        post, comb, x = self.ffn_hc(streams)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            out, aux, load = self.mlp(h, ctx.real)
            return expand(post, comb, out, streams), aux, load
        return expand(post, comb, self.mlp(h), streams), None, None


def collapse_mean(streams: torch.Tensor) -> torch.Tensor:
    """GLM-5.3-Flash's final collapse of the streams: their unweighted mean."""
    return streams.mean(dim=2)


class MTPLayer(nn.Module):
    def __init__(self, cfg: Glm5NextConfig, layer_idx: int) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * d, d, bias=False)
        self.block = Block(cfg, layer_idx)
        self.shared_head_norm = RMSNorm(d, cfg.rms_norm_eps)

    def inputs(self, embedded: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """The depth's streams: each stream joined with the embedding of the token k ahead."""
        e = self.enorm(embedded).unsqueeze(2).expand_as(streams)
        return self.eh_proj(torch.cat([e, self.hnorm(streams)], dim=-1))

    def hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """The depth's streams averaged and normed: what the shared head reads."""
        return self.shared_head_norm(collapse_mean(streams))


class Glm5NextLM(BlockModelSurface, SparseControls, nn.Module):
    """The model with DeepSeekLM's surface: forward -> ModelOutput, blocks(), routers(), indexers(),
    update_expert_bias(), set_activation_checkpointing(), the DSA stages (SparseControls)."""

    NAME = "GLM-5.3-Flash"

    # Sequence parallelism (dstrain.parallel.sp) sets this on the model, its KDA, DSA and MoE layers: each rank's
    # input_ids / position_ids / labels are its slice of every row plus `halo` tokens after it (the targets of its
    # last positions and MTP's look-ahead inputs); KDA and DSA trade the slice for a slice of the heads over
    # whole rows, the k-pool indexer runs over whole rows on every rank (its figures the whole rows', alike on
    # every rank of the group)
    seq_parallel: Any = None
    indexer_figures_per_slice = False

    def __init__(self, cfg: Glm5NextConfig) -> None:
        super().__init__()
        self.config = cfg
        n = cfg.num_hidden_layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(n))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Head(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.mtp = nn.ModuleList(MTPLayer(cfg, n + k) for k in range(cfg.num_nextn_predict_layers))
        self.moe_layer_ids = [i for i in range(n + len(self.mtp)) if cfg.is_moe_layer(i)]
        self.activation_checkpointing = "none"

    def blocks(self) -> list[Block]:
        return [*self.layers, *(m.block for m in self.mtp)]

    def indexers(self) -> list[nn.Module]:
        return [b.self_attn.indexer for b in self.blocks() if not b.kda and b.self_attn.indexer is not None]

    def sparse_settings(self) -> list:  # noqa: ANN201 - SparseControls' (KDA blocks have none)
        return [b.self_attn.sparse for b in self.blocks() if not b.kda]

    @property
    def halo(self) -> int:
        return sequence_halo(len(self.mtp))

    def streams_of(self, embedded: torch.Tensor) -> torch.Tensor:
        """The residual streams at the bottom: n copies of the embedding (B, T, n, D)."""
        return embedded.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()

    def context(self, position_ids: torch.Tensor | None, b: int, t: int, device: torch.device) -> Context:
        """Position ids of this forward's `t` tokens -> the context: the layout, KDA's document starts and the
        k-pools over whole rows (the sequence-parallel group's slices gathered), `real` this forward's tokens."""
        sp, whole, n = self.seq_parallel, position_ids, t
        if sp is not None:
            pos = position_ids if position_ids is not None else torch.arange(t, device=device).expand(b, t)
            whole, n = sp.gather(pos), t * sp.size
        layout = attention_layout(whole, b, n, device)
        starts = None if layout.causal_only else document_starts(whole)
        pools = make_pools(whole, b, n, self.config.index_kpool, device)
        return Context(layout, starts, pools, real_tokens(position_ids))

    def pipeline_context(self, position_ids: torch.Tensor, input_ids: torch.Tensor) -> tuple[Context]:
        b, t = position_ids.shape
        return (self.context(position_ids, b, t, position_ids.device),)

    def selection_width(self, t: int) -> int:
        """Keys of a shared selection (what a pipeline stage sends on to a later shared DSA layer)."""
        return selection_width(self.config.index_topk, self.config.index_kpool)

    def run_block(self, block: Block, streams: torch.Tensor, ctx: Context):  # noqa: ANN201
        if self.activation_checkpointing == "full" and self.training:
            return checkpoint(block, streams, ctx, use_reentrant=False)
        return block(streams, ctx)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_logits: bool | None = None,
        token_losses: bool = False,
    ) -> ModelOutput:
        """input_ids (B, T); position_ids (B, T) restarting at 0 per packed document (-1: padding); labels
        (B, T) unshifted, -100 not a target; `token_losses`: each position's cross-entropy too (DPO)."""
        b, t = input_ids.shape
        local_pos = position_ids
        if self.seq_parallel is not None:
            t -= self.halo  # this rank's tokens; the halo only feeds targets and MTP's look-ahead inputs
            if position_ids is None:
                position_ids = torch.arange(t + self.halo, device=input_ids.device).expand(b, -1)
            local_pos = position_ids[:, :t]
        ctx = self.context(local_pos, b, t, input_ids.device)
        streams, aux, loads = run_layers(self, self.streams_of(self.embed_tokens(input_ids[:, :t])), ctx)
        ahead = look_ahead(self.embed_tokens, input_ids, t)
        return self.finish(streams, ahead, ctx, position_ids, labels, aux, loads, return_logits, token_losses)

    def finish(
        self,
        streams: torch.Tensor,
        ahead,  # noqa: ANN001 - k -> embeddings of the tokens k ahead (B, T, D)
        ctx: Context,
        position_ids: torch.Tensor | None,
        labels: torch.Tensor | None,
        aux: torch.Tensor | None,
        loads: Any,
        return_logits: bool | None = None,
        token_losses: bool = False,
    ) -> ModelOutput:
        """The mean collapse, norm, head and losses, and the MTP depths, from the last block's streams."""
        return finish_streams(self, collapse_mean, streams, ahead, ctx, position_ids, labels, aux, loads,
                              return_logits, token_losses)  # fmt: skip


__all__ = ["Glm5NextLM"]
