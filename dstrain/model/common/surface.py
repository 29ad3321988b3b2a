"""What the KDA-hybrid families' models (Kimi Linear, GLM-5.3-Flash) share of DeepSeekLM's surface beyond their
blocks: the tied head, the routers and their balancing bias, activation checkpointing's modes, per-block
compilation. A model class mixes it in and gives `blocks()`, `embed_tokens`, `lm_head`, `config` and `NAME`."""

from __future__ import annotations

import torch
from torch import nn

from .layers import MoE, Router, update_expert_bias


class BlockModelSurface:
    NAME = "the model"
    """How a refusal names the model."""
    CHECKPOINTING = ("none", "full")
    """Its --activation_checkpointing modes ('full': every block recomputed in backward)."""

    def tie_weights(self) -> None:
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
            raise ValueError(
                f"activation checkpointing {mode!r}: {self.NAME} runs {' or '.join(self.CHECKPOINTING)}"
            )
        self.activation_checkpointing = mode

    def compile_blocks(self, **options) -> None:  # noqa: ANN003 - torch.compile's
        """Each block compiled on its own, in place (names and state dict unchanged), and the head's loss."""
        block: nn.Module
        for block in self.blocks():
            block.compile(**options)
        self.lm_head.compile_loss(**options)
