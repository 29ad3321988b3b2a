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
from typing import Any, NamedTuple

import torch

from dstrain import dist
from dstrain.batch import host_to_device, real_tokens, target_mask
from dstrain.model import ModelConfig, ModelOutput, combine_losses


def count_targets(batch: dict[str, torch.Tensor], mtp_depth: int, halo: int = 0) -> torch.Tensor:
    """int64 (1 + D,): targets the model counts in this micro batch, [lm, mtp depth 1..D]; the same rule as
    the model (labels != -100 and no document boundary crossed), so it can be known before the forward.
    `halo`: the batch is a sequence-parallel slice with that many tokens after its own (batch.sequence_shard)."""
    labels, pos = batch["labels"], batch.get("position_ids")
    t = labels.shape[1] - halo
    counts = []
    for shift in range(1, mtp_depth + 2):
        n = min(t, labels.shape[1] - shift)
        counts.append(target_mask(labels, pos, shift)[:, :n].sum() if n > 0 else labels.new_zeros(()))
    return torch.stack(counts).to(torch.int64).cpu()


def count_queries(batch: dict[str, torch.Tensor], halo: int = 0) -> torch.Tensor:
    """int64 (): the positions of this micro batch that hold a token (PAD_POSITION's do not), the queries whose
    indexer KL counts (dsa.Target.real); of a sequence-parallel slice, its own positions (`halo` as in
    count_targets)."""
    labels, real = batch["labels"], real_tokens(batch.get("position_ids"))
    t = labels.shape[1] - halo
    if real is None:
        return torch.tensor(labels.shape[0] * t, dtype=torch.int64)
    return real[:, :t].sum().to(torch.int64).cpu()


@dataclass(frozen=True)
class LossWeights:
    alpha: float
    """aux (sequence-balance) loss weight"""
    lam: float
    """MTP loss weight"""

    @classmethod
    def of(cls, cfg: ModelConfig) -> LossWeights:
        return cls(alpha=float(cfg.aux_loss_alpha), lam=float(cfg.mtp_loss_weight))


def micro_loss(out: ModelOutput, n_global: torch.Tensor, scale: float, w: LossWeights) -> torch.Tensor:
    """Loss to hand engine.backward for one micro batch. `n_global`: (1 + D,) global target counts of the
    step; `scale` = GA * dp, undoing DeepSpeed's 1/GA and rank averaging for the token-mean terms."""
    n = n_global.to(torch.float32).clamp(min=1)
    lm = out.lm_loss_sum.float() * (scale / n[0])
    mtp = None
    if out.mtp_loss_sum is not None and out.mtp_loss_sum.numel():
        mtp = (out.mtp_loss_sum.float() / n[1:].to(out.mtp_loss_sum.device)).mean() * scale
    aux = out.aux_loss.float() if out.aux_loss is not None else None
    return combine_losses(lm, mtp, aux, w.alpha, w.lam)


class Reduced(NamedTuple):
    """A step's (or an evaluation's) figures summed over the world."""

    lm: torch.Tensor
    mtp: torch.Tensor
    aux: torch.Tensor
    load: torch.Tensor | None
    counts: torch.Tensor
    hits: torch.Tensor
    indexer: torch.Tensor
    """Sparse attention: [KL sum, queries, recall sum, queries counted for recall] (dsa.PassResult)."""
    extra: torch.Tensor | None = None
    """The sums of `all_reduced`'s `extra` values (the trainer's preemption flags), or None."""

    def indexer_figures(self, values: list[float] | None = None) -> dict[str, float | None]:
        """indexer_loss: the indexers' KL, mean over layers and queries; indexer_recall: the share of the
        main attention's mass inside the selected keys (where the target was dense); {} without indexers.
        `values`: `indexer` already read to the host (with the step's other figures)."""
        kl, rows, recall, recall_rows = values if values is not None else (float(x) for x in self.indexer)
        if not rows:
            return {}
        return {"indexer_loss": kl / rows, "indexer_recall": recall / recall_rows if recall_rows else None}


class StepStats:
    """Sums of one step's (or one evaluation's) micro-batch outputs on this rank: LM and per-depth MTP loss
    sums, balance loss, target counts, expert loads, MTP depth-1 top-1 hits (eval) and the indexers' figures.
    `weight` 0 on ranks whose numbers are a copy of another rank's; `indexer_weight` likewise for the
    indexers' (sequence-parallel ranks compute them for whole rows alike)."""

    def __init__(
        self, depth: int, device: torch.device, weight: float, indexer_weight: float | None = None
    ) -> None:
        f64 = dict(dtype=torch.float64, device=device)
        self.lm, self.mtp, self.aux = (
            torch.zeros((), **f64),
            torch.zeros(depth, **f64),
            torch.zeros((), **f64),
        )
        self.counts = torch.zeros(1 + depth, dtype=torch.int64, device=device)
        self.hits = torch.zeros((), **f64)
        self.load: torch.Tensor | None = None
        self.indexer = torch.zeros(4, **f64)
        self.weight, self.seen = weight, 0
        self.indexer_weight = weight if indexer_weight is None else indexer_weight

    def add(self, out: Any) -> None:
        self.seen += 1
        self.lm += out.lm_loss_sum.detach().double()
        self.counts[0] += out.lm_tokens.detach().to(torch.int64)
        if self.mtp.numel() and out.mtp_loss_sum is not None:
            self.mtp += out.mtp_loss_sum.detach().double()
            self.counts[1:] += out.mtp_tokens.detach().to(torch.int64)
        if out.aux_loss is not None:
            self.aux += out.aux_loss.detach().double()
        if out.mtp_hits is not None:
            self.hits += out.mtp_hits.double()
        if out.expert_load is not None:
            load = out.expert_load.detach().double()
            self.load = load if self.load is None else self.load + load
        self.add_indexer(out.indexer_stats)

    def add_indexer(self, stats: torch.Tensor | None) -> None:
        """Sparse-attention indexer figures (a pipeline stage reports its own apart from the outputs)."""
        if stats is not None:
            self.indexer += stats.to(self.indexer.device)

    def all_reduced(
        self, moe_layers: list[int], experts: int | None, extra: torch.Tensor | None = None
    ) -> Reduced:
        """The sums over the world, in one all-reduce (every rank takes part, with zeros where it saw no
        outputs); `extra` (float64 values of every rank, unweighted) is summed in the same all-reduce."""
        w, depth = self.weight, self.mtp.numel()
        load = self.load
        if load is None and moe_layers:
            load = torch.zeros(len(moe_layers), experts, dtype=torch.float64, device=self.lm.device)
        counts = self.counts.to(self.lm.dtype)
        parts = [self.lm.view(1), self.mtp, self.aux.view(1), counts, self.hits.view(1)]
        if load is not None:
            parts.append(load.flatten())
        parts = [x * w for x in parts]
        parts.insert(0, self.indexer * self.indexer_weight)
        more = 0 if extra is None else extra.numel()
        if extra is not None:
            parts.append(host_to_device(extra.to(torch.float64), self.lm.device))
        stats = dist.all_reduce(torch.cat(parts))
        indexer, lm, mtp, aux, counts, hits, g_load, summed = stats.split(
            [4, 1, depth, 1, 1 + depth, 1, stats.numel() - 8 - 2 * depth - more, more]
        )
        g_load = g_load.view(load.shape) if load is not None else None
        return Reduced(
            lm[0], mtp, aux[0], g_load, counts, hits[0], indexer, summed if extra is not None else None
        )


def read_once(device: torch.device, **parts: torch.Tensor | None) -> dict[str, list[float]]:
    """The step's figures in one device-to-host read (one host sync): each part's values as floats (float64
    holds the counts exactly), [] for a part that is None."""
    flat = {k: v.detach().reshape(-1).to(device, torch.float64) for k, v in parts.items() if v is not None}
    values = torch.cat(list(flat.values())).tolist() if flat else []
    out, at = {}, 0
    for k, v in parts.items():
        size = flat[k].numel() if v is not None else 0
        out[k], at = values[at : at + size], at + size
    return out
