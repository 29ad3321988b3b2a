"""The training objective as a mean over the GLOBAL batch, whatever its split into micro batches and ranks.

J = sum(lm CE) / N_lm + (lambda / D) * sum_k sum(mtp_k CE) / N_k + alpha * mean_rows(aux)

with N counted over every micro batch of the step on every data-parallel rank before any backward.
DeepSpeed's engine.backward divides each micro loss by GA and its gradient reduction averages over the dp
ranks, so micro batch i contributes GA * dp * (its CE sums / N) + alpha * aux_i: summed over micro batches
and ranks and divided by GA * dp, that is exactly J (micro batches have equal rows, so the mean of per-micro
row means is the global row mean).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dstrain.model import target_mask


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


@dataclass
class Weights:
    alpha: float
    """aux (sequence-balance) loss weight"""
    lam: float
    """MTP loss weight"""


def micro_loss(out, n_global: torch.Tensor, scale: float, w: Weights) -> torch.Tensor:  # noqa: ANN001
    """Loss to hand engine.backward for one micro batch. `n_global`: (1 + D,) global target counts of the
    step; `scale` = GA * dp, undoing DeepSpeed's 1/GA and rank averaging for the token-mean terms."""
    n = n_global.to(torch.float32).clamp(min=1)
    loss = out.lm_loss_sum.float() * (scale / n[0])
    if w.lam and out.mtp_loss_sum is not None and out.mtp_loss_sum.numel():
        depth = out.mtp_loss_sum.numel()
        loss = (
            loss
            + (w.lam * scale / depth) * (out.mtp_loss_sum.float() / n[1:].to(out.mtp_loss_sum.device)).sum()
        )
    if w.alpha and out.aux_loss is not None:
        loss = loss + w.alpha * out.aux_loss.float()
    return loss


def check_counts(out, expected: torch.Tensor, step: int) -> None:  # noqa: ANN001
    """The counts used to scale the loss must be the model's own; a mismatch would silently mis-weight."""
    got = [int(out.lm_tokens)]
    if out.mtp_tokens is not None:
        got += [int(c) for c in out.mtp_tokens]
    want = [int(c) for c in expected[: len(got)]]
    if got != want:
        raise RuntimeError(f"step {step}: model counted {got} target tokens, trainer counted {want}")
