"""Kimi Linear's MLA: DeepSeek's multi-head latent attention without rotary embedding (NoPE). The shared key part
(`qk_rope_head_dim` of `kv_a_proj_with_mqa`'s output) is kept and joins every head's key unrotated; the softmax
scale is 1/sqrt(qk_head_dim), with no YaRN correction."""

from __future__ import annotations

import torch
from torch import nn

from ..common.attention import AttentionLayout, attend
from ..common.kernels import Linear
from ..common.layers import RMSNorm
from .config import KimiLinearConfig


class NoPEMLA(nn.Module):
    def __init__(self, cfg: KimiLinearConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.num_attention_heads, cfg.hidden_size
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(d, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(d, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = Linear(h * cfg.v_head_dim, d, bias=cfg.attention_bias)
        self.scale = cfg.qk_head_dim**-0.5

    def forward(self, x: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, -1, cfg.qk_head_dim)  # heads read off by reshape: a column split keeps whole heads
        latent, k_shared = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, -1, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_shared.unsqueeze(2).expand(-1, -1, q.shape[2], -1)], dim=-1)
        return self.o_proj(attend(q, k, v, self.scale, layout).reshape(b, t, -1))
