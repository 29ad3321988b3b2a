"""Kimi Linear's MLA: DeepSeek's multi-head latent attention without rotary embedding (NoPE). The shared key part
(`qk_rope_head_dim` of `kv_a_proj_with_mqa`'s output) is kept and joins every head's key unrotated; the softmax
scale is 1/sqrt(qk_head_dim), with no YaRN correction."""

from __future__ import annotations

from typing import Any

import torch

from ..common.attention import AttentionLayout, attend
from ..common.mla import LatentProjections
from .config import KimiLinearConfig


class NoPEMLA(LatentProjections):
    seq_parallel: Any = None  # see KimiLinearLM: heads over whole rows

    def __init__(self, cfg: KimiLinearConfig) -> None:
        super().__init__(cfg)
        self.scale = cfg.qk_head_dim**-0.5

    def forward(self, x: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
        b, t, _ = x.shape
        q, _, k_nope, k_shared, v = self.project(x)
        k = torch.cat([k_nope, k_shared.unsqueeze(2).expand(-1, -1, q.shape[2], -1)], dim=-1)
        sp = self.seq_parallel
        out = sp.attend(q, k, v, self.scale, layout) if sp else attend(q, k, v, self.scale, layout)
        return self.o_proj(out.reshape(b, t, -1))
