"""Kimi Linear's causal LM as plain single-device PyTorch: KDA layers (common/kda.py) and NoPE MLA layers
(attention.py), each followed by a dense SwiGLU MLP or a V3-style MoE (sigmoid routing with the correction bias,
shared experts; common/layers.py).

Module names are transformers' `KimiLinearForCausalLM` names minus `model.`, except a KDA layer's, which are the
published checkpoint's (three short convolutions, the forget gate's tensors directly under `self_attn`); the key
table (state_dict.py) maps the MoE's `mlp.` to the files' `block_sparse_moe.`. Packed rows: MLA attends within
each document, and KDA's state and short convolutions restart where a document starts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dstrain.batch import real_tokens, sequence_halo

from ..common.attention import AttentionLayout, attention_layout
from ..common.kda import KDA, document_starts
from ..common.layers import MLP, MoE, RMSNorm
from ..common.loss import Head, combine_losses, lm_losses
from ..common.output import ModelOutput
from ..common.surface import BlockModelSurface, run_layers
from .attention import NoPEMLA
from .config import KimiLinearConfig

A_LOG_SHAPE = (1, 1)  # Kimi's checkpoints hold A_log as (1, 1, H, 1)


class Block(nn.Module):
    def __init__(self, cfg: KimiLinearConfig, layer_idx: int) -> None:
        super().__init__()
        self.kda = cfg.is_kda_layer(layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.kda:
            h = cfg.linear_num_heads
            self.self_attn = KDA(cfg.hidden_size, h, cfg.linear_head_dim, cfg.linear_conv_kernel_dim,
                                 cfg.rms_norm_eps, a_log_shape=(*A_LOG_SHAPE, h, 1))  # fmt: skip
        else:
            self.self_attn = NoPEMLA(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = cfg.is_moe_layer(layer_idx)
        self.mlp = MoE(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, starts: torch.Tensor | None, layout: AttentionLayout):  # noqa: ANN201
        """-> (x, balance loss or None, expert load or None)."""
        h = self.input_layernorm(x)
        x = x + (self.self_attn(h, starts) if self.kda else self.self_attn(h, layout))
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            out, aux, load = self.mlp(h, layout.real)
            return x + out, aux, load
        return x + self.mlp(h), None, None


class KimiLinearLM(BlockModelSurface, nn.Module):
    """The model with DeepSeekLM's surface: forward -> ModelOutput, blocks(), routers(), update_expert_bias(),
    set_activation_checkpointing(), run_block() / finish()."""

    NAME = "Kimi Linear"

    # Sequence parallelism (dstrain.parallel.sp): this rank holds a slice of every row (plus the targets' halo);
    # MLA and KDA trade it for a slice of the heads over whole rows (attention.py, common/kda.py)
    seq_parallel: Any = None
    indexer_figures_per_slice = False

    def __init__(self, cfg: KimiLinearConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Head(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.mtp = nn.ModuleList()  # no multi-token prediction
        self.moe_layer_ids = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        self.activation_checkpointing = "none"

    def blocks(self) -> list[Block]:
        return list(self.layers)

    def indexers(self) -> list[nn.Module]:
        return []

    @property
    def halo(self) -> int:
        return sequence_halo(0)

    def streams_of(self, embedded: torch.Tensor) -> torch.Tensor:
        return embedded

    def pipeline_context(self, position_ids: torch.Tensor, input_ids: torch.Tensor | None) -> tuple:
        """What every block reads besides the hidden states: (document starts, attention layout), the layout
        last as every family's (the pipeline finds its figures there)."""
        b, t = position_ids.shape
        return self.context(position_ids, b, t, position_ids.device)

    def context(
        self, position_ids: torch.Tensor | None, b: int, t: int, device: torch.device
    ) -> tuple[torch.Tensor | None, AttentionLayout]:
        """Position ids of this forward's `t` tokens -> (document starts, attention layout), both over whole
        rows (the sequence-parallel group's slices gathered); the layout's `real` this forward's tokens."""
        sp = self.seq_parallel
        whole = position_ids
        if sp is not None:
            pos = position_ids if position_ids is not None else torch.arange(t, device=device).expand(b, t)
            whole = sp.gather(pos)
        layout = attention_layout(whole, b, t * (sp.size if sp else 1), device)
        layout.real = real_tokens(position_ids)
        starts = None if layout.causal_only else document_starts(whole)
        return starts, layout

    def run_block(self, block: Block, h: torch.Tensor, starts: torch.Tensor | None, layout: AttentionLayout):  # noqa: ANN201
        """One block (recomputed in backward under 'full' activation checkpointing) -> (h, aux, load)."""
        if self.activation_checkpointing == "full" and self.training:
            return checkpoint(block, h, starts, layout, use_reentrant=False)
        return block(h, starts, layout)

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
            t -= self.halo  # this rank's tokens; the halo only feeds its last positions' targets
            local_pos = position_ids[:, :t] if position_ids is not None else None
            if position_ids is None:
                position_ids = torch.arange(t + self.halo, device=input_ids.device).expand(b, -1)
        context = self.context(local_pos, b, t, input_ids.device)
        h, aux, loads = run_layers(self, self.embed_tokens(input_ids[:, :t]), *context)
        main_loads = torch.stack(loads) if loads else None
        return self.finish(h, None, *context, position_ids, labels, aux, main_loads, return_logits,
                           token_losses)  # fmt: skip

    def finish(
        self,
        h: torch.Tensor,
        ahead: Any,  # no MTP: unused (the pipeline's signature)
        starts: torch.Tensor | None,  # the context (pipeline_context), unused here
        layout: AttentionLayout,
        position_ids: torch.Tensor | None,
        labels: torch.Tensor | None,
        aux: torch.Tensor | None,
        loads: torch.Tensor | None,
        return_logits: bool | None = None,
        token_losses: bool = False,
    ) -> ModelOutput:
        """Final norm, head and losses from the last block's output."""
        hidden = self.norm(h)
        out = ModelOutput()
        if return_logits or (return_logits is None and labels is None):
            out.logits = self.lm_head(hidden)
        if labels is not None:
            out.lm_loss_sum, out.lm_tokens, rows = lm_losses(
                self.lm_head, hidden, labels, position_ids, token_losses
            )
            if rows is not None:
                out.lm_token_loss = rows
        if aux is not None:
            out.aux_loss = aux
            out.expert_load = loads.detach()
        if labels is not None:
            lm = out.lm_loss_sum / out.lm_tokens.clamp(min=1)
            cfg = self.config
            out.loss = combine_losses(lm, None, out.aux_loss, cfg.aux_loss_alpha, cfg.mtp_loss_weight)
        return out


__all__ = ["KimiLinearLM"]
