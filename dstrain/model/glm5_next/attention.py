"""GLM-5.3-Flash's DSA layer: NoPE MLA (common/mla.py, no rotary part: qk_rope_head_dim 0) attending the keys its
k-pool indexer (indexer.py) selected, or a shared layer's: the previous full layer's selection. The stages
(dense warm-up, sparse, frozen) and the indexer's gradient scale are dsa.SparseSettings, set through
dsa.SparseControls as for DeepSeek-V3.2 and GLM-5."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..common.attention import AttentionLayout, attend
from ..common.dsa import SparseSettings, inject
from ..common.mla import LatentProjections
from .config import Glm5NextConfig
from .indexer import PoolIndexer, Pools, select


@dataclass
class Context:
    """What every block of one forward reads besides the streams."""

    layout: AttentionLayout
    starts: torch.Tensor | None
    """(B, T) bool: where a packed document starts (KDA's state restarts), None for plain rows."""
    pools: Pools
    real: torch.Tensor | None
    """(B, T) bool: the positions that hold a token (the routers' counts; MTP: pairs), None: all."""

    # where a pipeline stage (dstrain.parallel.pipe) finds the selections it sends on and the indexers' figures
    @property
    def selections(self) -> dict:
        return self.layout.selections

    @property
    def stats(self) -> dict:
        return self.layout.stats


class DSAttention(LatentProjections):
    # Tensor parallelism (dstrain.parallel.tp): sums the indexer's target over the ranks holding the other heads
    head_sum: Any = None
    # Sequence parallelism (dstrain.parallel.sp): the indexer over whole rows (its inputs gathered, every rank
    # selecting alike, the target's per-pool mass summed over the group's heads), attention for heads / sp heads
    # over whole rows (all-to-alls), the output back to this rank's tokens
    seq_parallel: Any = None

    def __init__(self, cfg: Glm5NextConfig, layer_idx: int) -> None:
        super().__init__(cfg)
        # transformers' query and latent norms take the model's eps (LatentProjections' default is 1e-6)
        self.q_a_layernorm.eps = self.kv_a_layernorm.eps = cfg.rms_norm_eps
        self.scale = cfg.qk_head_dim**-0.5
        self.indexer = (
            PoolIndexer(
                cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
            )
            if cfg.has_indexer(layer_idx)
            else None
        )
        self.sparse = SparseSettings(layer_idx, cfg.indexer_source(layer_idx))

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        """x (B, T, D) this rank's tokens -> (B, T, D); `ctx` over whole rows under sequence parallelism."""
        b, t, _ = x.shape
        q, qr, k, _, v = self.project(x)  # the shared key part is empty (NoPE)
        layout, settings, sp = ctx.layout, self.sparse, self.seq_parallel
        head_sum = self.head_sum
        if sp is not None:  # (B, T / sp, H, d) -> (B, T, H / sp, d): whole rows, a slice of the heads
            q, k, v = (sp.to_heads(z) for z in (q, k, v))
            head_sum = sp.sum
        if self.indexer is None:
            keys = layout.selections[settings.source]
            out = attend(q, k, v, self.scale, layout, None if settings.dense else keys)
            return self._output(out, b, t)
        iq, pk, iw = self.indexer(x.detach(), qr.detach(), ctx.pools, sp)
        measure = settings.loss or not self.training
        trains = torch.is_grad_enabled() and any(p.requires_grad for p in self.indexer.parameters())
        grads = measure and settings.loss and trains
        sparse_loss = not settings.dense and torch.is_grad_enabled()
        target = (q.detach(), k.detach(), self.scale, sparse_loss, head_sum) if measure else None
        result = select(iq, pk, iw, ctx.pools, self.cfg.index_topk, target, layout.real_rows, grads)
        out = attend(q, k, v, self.scale, layout, None if settings.dense else result.keys)
        layout.selections[settings.layer] = result.keys
        if measure:
            layout.stats[settings.layer] = result.stats
        if result.grads is not None:
            factor = settings.grad_scale
            if factor is None:  # the mean over the forward's real queries (the whole rows')
                real = layout.real_rows
                factor = 1.0 / (real.sum().clamp(min=1) if real is not None else iq.shape[0] * iq.shape[1])
            out = inject(out, factor, (iq, pk, iw), result.grads)
        return self._output(out, b, t)

    def _output(self, out: torch.Tensor, b: int, t: int) -> torch.Tensor:
        if self.seq_parallel is not None:
            out = self.seq_parallel.to_tokens(out)
        return self.o_proj(out.reshape(b, t, -1))
