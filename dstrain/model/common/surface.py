"""What every family's model shares of its surface beyond its blocks. `BlockModelSurface`: the tied head, the
routers and their balancing bias, activation checkpointing's modes, per-block compilation; a model class mixes it
in and gives `blocks()`, `embed_tokens`, `lm_head`, `config` and `NAME` (and overrides what differs).
`run_layers` and `look_ahead`: the main layers' loop and MTP's inputs.
`finish_streams` (DeepSeek-V4, GLM-5.3-Flash): the head, the losses and the MTP depths of a model whose residual
is several streams (mHC)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dstrain.batch import real_pairs

from .layers import MoE, Router, update_expert_bias
from .loss import combine_losses, lm_losses, mtp_depth_loss
from .output import ModelOutput


class BlockModelSurface:
    NAME = "the model"
    """How a refusal names the model."""
    CHECKPOINTING = ("none", "full")
    """Its --activation_checkpointing modes ('full': every block recomputed in backward)."""

    def tie_weights(self) -> None:
        """Re-tie after anything that replaces Parameters (`to_empty` from the meta device does)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def routers(self) -> list[Router]:
        return [b.mlp.gate for b in self.blocks() if isinstance(b.mlp, MoE)]

    def update_expert_bias(self, load: torch.Tensor) -> None:
        update_expert_bias(self.routers(), load, self.config.bias_update_speed)

    def set_activation_checkpointing(self, mode: str | bool) -> None:
        """A mode of CHECKPOINTING, or True ('full') / False ('none')."""
        mode = {True: "full", False: "none"}.get(mode, mode)
        if mode not in self.CHECKPOINTING:
            *rest, last = self.CHECKPOINTING
            raise ValueError(
                f"activation checkpointing {mode!r}: {self.NAME} runs {', '.join(rest)} or {last}"
            )
        self.activation_checkpointing = mode

    def compile_blocks(self, **options) -> None:  # noqa: ANN003 - torch.compile's
        """Each block compiled on its own, in place (names and state dict unchanged), and the head's loss."""
        block: nn.Module
        for block in self.blocks():
            block.compile(**options)
        self.lm_head.compile_loss(**options)


def run_layers(
    model: nn.Module, x: torch.Tensor, *context: Any
) -> tuple[torch.Tensor, Any, list[torch.Tensor]]:
    """`model.layers` in turn (`model.run_block(block, x, *context)`) -> the last one's output, the sum of the MoE
    layers' balance losses (None without any) and their expert loads, in order."""
    aux, loads = None, []
    for block in model.layers:
        x, block_aux, load = model.run_block(block, x, *context)
        if block_aux is not None:
            aux = block_aux if aux is None else aux + block_aux
            loads.append(load)
    return x, aux, loads


def look_ahead(embed: nn.Module, input_ids: torch.Tensor, t: int) -> Callable[[int], torch.Tensor]:
    """MTP depth k's inputs at position i: the embedding of token i + k (zeros past the row)."""

    def ahead(k: int) -> torch.Tensor:
        ids = input_ids[:, k : k + t]
        return embed(F.pad(ids, (0, t - ids.shape[1])))

    return ahead


def finish_streams(
    model: nn.Module,
    collapse: Callable[[torch.Tensor], torch.Tensor],
    streams: torch.Tensor,
    ahead: Callable[[int], torch.Tensor],
    ctx: Any,
    position_ids: torch.Tensor | None,
    labels: torch.Tensor | None,
    aux: torch.Tensor | None,
    loads: Any,
    return_logits: bool | None = None,
    token_losses: bool = False,
) -> ModelOutput:
    """`model`'s output from its last block's streams: `collapse` to one hidden state, the norm, the head and
    its losses, and the MTP depths (each layer's `inputs(embedded, streams)`, `block` and `hidden(streams)`)
    with their balance losses and loads after the main layers' (`aux`, `loads`); `ctx` the forward's context
    (its `real` per depth, its indexers' figures in `stats`); `ahead(k)`: the embeddings of the tokens k ahead."""
    cfg = model.config
    hidden = model.norm(collapse(streams))
    out = ModelOutput()
    loads = [*loads] if loads is not None else []
    if return_logits or (return_logits is None and labels is None):
        out.logits = model.lm_head(hidden)
    if labels is not None:
        out.lm_loss_sum, out.lm_tokens, rows = lm_losses(
            model.lm_head, hidden, labels, position_ids, token_losses
        )
        if rows is not None:
            out.lm_token_loss = rows
        if len(model.mtp):
            aux = _mtp_depths(model, out, streams, ahead, ctx, position_ids, labels, aux, loads)
    if ctx.stats:
        out.indexer_stats = torch.stack(list(ctx.stats.values())).sum(0)
    if aux is not None:
        out.aux_loss = aux
        out.expert_load = torch.stack(loads).detach()
    if labels is not None:
        lm = out.lm_loss_sum / out.lm_tokens.clamp(min=1)
        mtp = (out.mtp_loss_sum / out.mtp_tokens.clamp(min=1)).mean() if len(model.mtp) else None
        out.loss = combine_losses(lm, mtp, out.aux_loss, cfg.aux_loss_alpha, cfg.mtp_loss_weight)
    return out


def _mtp_depths(model, out, streams, ahead, ctx, position_ids, labels, aux, loads):  # noqa: ANN001, ANN202
    """MTP depth k at position i reads token i + k and predicts labels[i + k + 1]."""
    b, t = streams.shape[:2]
    sums, counts = [], []
    for k, mtp in enumerate(model.mtp, start=1):
        streams = mtp.inputs(ahead(k), streams)
        # a position whose look-ahead token is padding holds no pair: its router counts nothing
        depth = dataclasses.replace(ctx, real=real_pairs(position_ids, b, t, k, streams.device))
        streams, block_aux, load = model.run_block(mtp.block, streams, depth)
        if block_aux is not None:
            aux = block_aux if aux is None else aux + block_aux
            loads.append(load)
        s, c, hits = mtp_depth_loss(
            model.lm_head, mtp.hidden(streams), labels, position_ids, k, model.training
        )
        if hits is not None:
            out.mtp_hits = hits
        sums.append(s)
        counts.append(c)
    out.mtp_loss_sum, out.mtp_tokens = torch.stack(sums), torch.stack(counts)
    return aux
