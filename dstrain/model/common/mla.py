"""Multi-head latent attention's projections as DeepSeek's checkpoints name them, shared by every family whose
attention is MLA: the query (through a low-rank latent where `q_lora_rank` is set), the compressed key/value
latent with one shared key part (`kv_a_proj_with_mqa`), its up-projection to every head's key and value, and the
output. A family's attention subclasses `LatentProjections` and decides what the shared key part is (DeepSeek-V3
rotates it; Kimi Linear keeps it unrotated) and how the heads attend."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .kernels import Linear
from .layers import RMSNorm


class LatentProjections(nn.Module):
    def __init__(self, cfg: Any) -> None:
        """`cfg`: a config with transformers' MLA fields (hidden_size, num_attention_heads, q_lora_rank,
        kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, qk_head_dim, v_head_dim, attention_bias)."""
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

    def project(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, D) -> q (B, T, H, qk_head_dim), the normed query latent (None without q_lora_rank), every
        head's key part k_nope (B, T, H, qk_nope_head_dim), the shared key part (B, T, qk_rope_head_dim) and v
        (B, T, H, v_head_dim). Heads are read off the projections by reshape, so tensor parallelism can split
        q_b/kv_b columns by whole heads."""
        cfg = self.cfg
        b, t, _ = x.shape
        qr = None
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            qr = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(qr)
        q = q.view(b, t, -1, cfg.qk_head_dim)
        latent, k_shared = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, -1, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        return q, qr, k_nope, k_shared, v


def mla_params(cfg: Any) -> int:
    """Parameters of `LatentProjections(cfg)` (its biases apart: DeepSeek's checkpoints have none)."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    if cfg.q_lora_rank is None:
        q = d * h * cfg.qk_head_dim
    else:
        q = d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim
    kv = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    kv += cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv + h * cfg.v_head_dim * d
