"""Evaluation on the eval set, in every layout: no gradients, no balance loss, no expert-bias update.

Every rank holds the whole eval set (dstrain.data.build_eval_rows) and evaluates rows dp_rank, dp_rank + dp,
... of it; ranks of one pipeline / tensor-parallel group evaluate the same rows, as they train on the same
batches. Every data-parallel rank runs the same number of micro batches (collectives inside the forward:
ZeRO-3 gathers, expert all-to-all, pipeline sends), so the last ones are padded with rows without targets.
The figures are sums over the world divided by global counts, so they are the same in every layout (up to
summation order): the token-mean LM loss over the eval set, its perplexity, the token-mean MTP loss of each
depth and MTP depth 1's draft acceptance (the share of its targets that its top-1 token hits); with sparse
attention the indexers' dense KL against the main attention and their recall (the main attention's mass inside
the chosen keys).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from dstrain.batch import IGNORE_INDEX

from .objective import StepStats


def local_batches(
    rows: dict[str, torch.Tensor], micro: int, dp_rank: int, dp: int
) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's share of the global eval `rows`, in micro batches of `micro` rows; the same
    number of micro batches on every rank (padding rows have no target)."""
    n, t = rows["input_ids"].shape
    steps = math.ceil(math.ceil(n / dp) / micro)
    pad = steps * micro * dp - n
    padded = {
        "input_ids": torch.zeros(pad, t, dtype=torch.int64),
        "labels": torch.full((pad, t), IGNORE_INDEX, dtype=torch.int64),
        "position_ids": torch.arange(t).expand(pad, t),
    }
    full = {k: torch.cat([rows[k], padded[k]]) for k in padded}
    mine = torch.arange(dp_rank, steps * micro * dp, dp)
    return [{k: v[mine[i * micro : (i + 1) * micro]] for k, v in full.items()} for i in range(steps)]


class Evaluator:
    """Runs this rank's eval micro batches through the engine and reduces the figures over the world."""

    def __init__(
        self,
        batches: list[dict[str, torch.Tensor]],
        mtp_depth: int,
        device: torch.device,
        weight: float,
        indexer_weight: float,
    ) -> None:
        self.batches, self.depth, self.device = batches, mtp_depth, device
        self.weight, self.indexer_weight = weight, indexer_weight

    def run(self, engine: Any, moe_layers: list[int], experts: int | None, pipe: bool) -> dict[str, Any]:
        t0 = time.perf_counter()
        stats = StepStats(self.depth, self.device, self.weight, self.indexer_weight)
        dev = self.device
        if pipe:
            ones = torch.ones(1 + self.depth, device=dev)  # the objective's counts: unused without backward

            def feed(b: dict[str, torch.Tensor]) -> tuple:
                return (b["input_ids"].to(dev), b["position_ids"].to(dev)), (b["labels"].to(dev), ones)

            engine.eval_batch(
                iter([feed(b) for b in self.batches]),
                compute_loss=True,
                bcast_loss=False,
                reduce_output=None,
                num_micro_batches=len(self.batches),
            )
            for out in engine.module.take_outputs():
                stats.add(out)
            stats.add_indexer(engine.module.take_indexer_stats())
        else:
            engine.eval()
            try:
                with torch.no_grad():
                    for b in self.batches:
                        b = {k: v.to(dev) for k, v in b.items()}
                        stats.add(engine(**b))
            finally:
                engine.train()
        red = stats.all_reduced(moe_layers, experts)
        lm, mtp, counts, hits = red.lm, red.mtp, red.counts, red.hits
        n = counts.clamp(min=1)
        loss = float(lm / n[0])
        indexer = {f"eval_{k}": v for k, v in red.indexer_figures().items()}
        return {
            "eval_loss": loss,
            "eval_ppl": math.exp(min(loss, 700.0)),
            "eval_mtp_loss": [float(x) for x in mtp / n[1:]] if self.depth else None,
            "eval_mtp_acc": float(hits / n[1]) if self.depth else None,
            "eval_tokens": int(counts[0]),
            "eval_time_s": time.perf_counter() - t0,
            **indexer,
        }
