"""The training objective as a mean over the GLOBAL batch, whatever its split into micro batches and ranks.

J = sum(lm CE) / N_lm + (lambda / D) * sum_k sum(mtp_k CE) / N_k + alpha * mean_rows(aux)

with N counted over every micro batch of the step on every data-parallel rank before any backward.
DeepSpeed's engine.backward divides each micro loss by GA and its gradient reduction averages over the dp
ranks, so micro batch i contributes GA * dp * (its CE sums / N) + alpha * aux_i: summed over micro batches
and ranks and divided by GA * dp, that is exactly J (micro batches have equal rows, so the mean of per-micro
row means is the global row mean). The combination itself is the model's `combine_losses`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dstrain.batch import target_mask
from dstrain.model import ModelConfig, ModelOutput, combine_losses


def count_targets(batch: dict[str, torch.Tensor], mtp_depth: int) -> torch.Tensor:
    """int64 (1 + D,): targets the model counts in this micro batch, [lm, mtp depth 1..D]; the same rule as
    the model (labels != -100 and no document boundary crossed), so it can be known before the forward."""
    labels, pos = batch["labels"], batch.get("position_ids")
    counts = [target_mask(labels, pos, 1).sum()]
    for k in range(1, mtp_depth + 1):
        shift = k + 1
        if labels.shape[1] > shift:
            counts.append(target_mask(labels, pos, shift).sum())
        else:
            counts.append(labels.new_zeros(()))
    return torch.stack(counts).to(torch.int64).cpu()


@dataclass(frozen=True)
class Weights:
    alpha: float
    """aux (sequence-balance) loss weight"""
    lam: float
    """MTP loss weight"""

    @classmethod
    def of(cls, cfg: ModelConfig) -> Weights:
        return cls(alpha=float(cfg.aux_loss_alpha), lam=float(cfg.mtp_loss_weight))


def micro_loss(out: ModelOutput, n_global: torch.Tensor, scale: float, w: Weights) -> torch.Tensor:
    """Loss to hand engine.backward for one micro batch. `n_global`: (1 + D,) global target counts of the
    step; `scale` = GA * dp, undoing DeepSpeed's 1/GA and rank averaging for the token-mean terms."""
    n = n_global.to(torch.float32).clamp(min=1)
    lm = out.lm_loss_sum.float() * (scale / n[0])
    mtp = None
    if out.mtp_loss_sum is not None and out.mtp_loss_sum.numel():
        mtp = (out.mtp_loss_sum.float() / n[1:].to(out.mtp_loss_sum.device)).mean() * scale
    aux = out.aux_loss.float() if out.aux_loss is not None else None
    return combine_losses(lm, mtp, aux, w.alpha, w.lam)
