"""Multi-head latent attention (MLA) of the DeepSeek-V3 family, its rotary frequencies as transformers computes
them from the config (YaRN included), and DeepSeek-V3.2's lightning indexer (common/dsa.py: how it selects and
learns)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..common.attention import AttentionLayout, apply_rope, attend, inverse_frequencies, yarn_mscale
from ..common.dsa import SparseSettings, sparse_attention
from ..common.kernels import Linear
from ..common.mla import LatentProjections
from .config import ModelConfig


def _yarn_params(cfg: ModelConfig) -> dict | None:
    rs = cfg.rope_scaling
    if not rs or rs.get("rope_type", rs.get("type")) != "yarn":
        return None
    return rs


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (fp32, qk_rope_head_dim/2) and the cos/sin multiplier, as HF computes them."""
    return inverse_frequencies(
        cfg.qk_rope_head_dim, cfg.rope_theta, _yarn_params(cfg), cfg.max_position_embeddings
    )


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(d), times YaRN's mscale(factor, mscale_all_dim)^2 correction when configured."""
    scale = cfg.qk_head_dim**-0.5
    yarn = _yarn_params(cfg)
    if yarn is not None and yarn.get("mscale_all_dim"):
        scale *= yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2
    return scale


class Indexer(nn.Module):
    """The lightning indexer of one layer (see the top)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, bias=False)

    def forward(
        self, x: torch.Tensor, qr: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, D), qr (B, T, q_lora_rank) -> q (B, T, heads, dim), k (B, T, dim), w (B, T, heads) fp32."""
        b, t, _ = x.shape
        cfg, r = self.cfg, self.cfg.qk_rope_head_dim
        cos, sin = rope
        q = self.wq_b(qr).view(b, t, self.n_heads, self.head_dim)
        k = F.layer_norm(self.wk(x).float(), (self.head_dim,), self.k_norm.weight.float(), self.k_norm.bias.float(),
                         self.k_norm.eps).to(x.dtype)  # fmt: skip
        q_rot, q_pass = q.split([r, self.head_dim - r], dim=-1)
        k_rot, k_pass = k.split([r, self.head_dim - r], dim=-1)
        q = torch.cat([apply_rope(q_rot, cos, sin, cfg.indexer_rope_interleave), q_pass], dim=-1)
        k_rot = apply_rope(k_rot.unsqueeze(2), cos, sin, cfg.indexer_rope_interleave).squeeze(2)
        k = torch.cat([k_rot, k_pass], dim=-1)
        w = self.weights_proj(x)
        w = w.to(torch.promote_types(w.dtype, torch.float32)) * self.n_heads**-0.5
        return q, k, w


class MLA(LatentProjections):
    """Multi-head latent attention with decoupled rotary keys (one rotary key head shared by all heads); with
    DeepSeek Sparse Attention (dsa.py), each query attends only to the keys its layer's indexer chose."""

    seq_parallel: Any = None  # see DeepSeekLM
    # Tensor parallelism: sums a tensor over the ranks holding the other heads (the indexer's target needs
    # every head's attention).
    head_sum: Any = None

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__(cfg)
        self.scale = softmax_scale(cfg)
        self.indexer = Indexer(cfg) if cfg.has_indexer(layer_idx) else None
        self.sparse = (
            SparseSettings(layer_idx, cfg.indexer_source(layer_idx)) if cfg.sparse_attention else None
        )

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layout: AttentionLayout
    ) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        q, qr, k_nope, k_rope, v = self.project(x)
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        cos, sin = rope
        q_rope = apply_rope(q_rope, cos, sin, cfg.rope_interleave)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin, cfg.rope_interleave)
        heads = q.shape[2]
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, heads, -1)], dim=-1)
        sp = self.seq_parallel
        if self.sparse is not None:
            measure = self.sparse.loss or not self.training
            out = sparse_attention(self.sparse, self.indexer, x, qr, q, k, v, self.scale, rope, layout,
                                   cfg.index_topk, sp, self.head_sum, measure)  # fmt: skip
        else:
            out = sp.attend(q, k, v, self.scale, layout) if sp else attend(q, k, v, self.scale, layout)
        return self.o_proj(out.reshape(b, t, -1))
