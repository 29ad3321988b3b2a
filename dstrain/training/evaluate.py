"""Evaluation on the eval set, in every layout: no gradients, no balance loss, no expert-bias update.

Every rank holds the whole eval set (dstrain.data.build_eval_rows) and evaluates rows dp_rank, dp_rank + dp,
... of it; ranks of one pipeline / tensor-parallel group evaluate the same rows, as they train on the same
batches. Every data-parallel rank runs the same number of micro batches (collectives inside the forward:
ZeRO-3 gathers, expert all-to-all, pipeline sends), so the last ones are padded with rows without targets.
The figures are sums over the world divided by global counts, so they are the same in every layout (up to
summation order): the token-mean LM loss over the eval set, its perplexity, the token-mean MTP loss of each
depth and MTP depth 1's draft acceptance (the share of its targets that its top-1 token hits); with sparse
attention the indexers' dense KL against the main attention and their recall (the main attention's mass inside
the chosen keys). Under --objective dpo also DPO's figures over the eval set's pairs (dpo.py, the adapters-off
reference run beside each policy forward; a pipeline runs a reference pass first): `eval_dpo_loss`,
`eval_pairs` and TRL's `eval_rewards/...`, `eval_logps/...`.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from dstrain.batch import IGNORE_INDEX

from .dpo import DPO, Pairs
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
        dpo: DPO | None = None,
        pairs: Pairs | None = None,
    ) -> None:
        """`dpo`: a DPO run's objective, the `batches` numbered by dpo.number on whole rows (`pairs`)."""
        self.batches, self.depth, self.device = batches, mtp_depth, device
        self.weight, self.indexer_weight = weight, indexer_weight
        self.dpo, self.pairs = dpo, pairs

    def run(
        self, engine: Any, moe_layers: list[int], experts: int | None, pipe: bool, model: Any = None
    ) -> dict[str, Any]:
        """The eval figures; `model` (the engine's model, its adapters switched off for DPO's reference)."""
        t0 = time.perf_counter()
        stats = StepStats(self.depth, self.device, self.weight, self.indexer_weight)
        dev = self.device
        dpo = self.dpo
        if dpo is not None:
            dpo.begin_eval(self.pairs, dev)
        ones = torch.ones(1 + self.depth, device=dev)  # the objective's counts: unused without backward
        if pipe:

            def feed(b: dict[str, torch.Tensor]) -> tuple:
                return (b["input_ids"].to(dev), b["position_ids"].to(dev)), (b["labels"].to(dev), ones)

            data = [feed(b) for b in self.batches]
            if dpo is not None:  # the reference pass; each target's document travels with the labels
                data = dpo.pipe_reference(engine, model, self.batches, data, len(data))
            engine.eval_batch(
                iter(data),
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
                    for i, b in enumerate(self.batches):
                        b = {k: v.to(dev) for k, v in b.items()}
                        if dpo is not None:
                            out, _ = dpo.micro(engine, model, b, i, ones)
                        else:
                            out = engine(**b)
                        stats.add(out)
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
            **(dpo.eval_figures() if dpo is not None else {}),
        }


def eval_line(rec: dict[str, Any]) -> str:
    """The console line of an eval record."""
    mtp = (
        f", mtp loss {rec['eval_mtp_loss'][0]:.4f}, mtp acc {100 * rec['eval_mtp_acc']:.1f}%"
        if rec["eval_mtp_loss"]
        else ""
    )
    if rec.get("eval_rewards/margins") is not None:
        mtp += f", margin {rec['eval_rewards/margins']:.4f}, acc {100 * rec['eval_rewards/accuracies']:.1f}%"
    return (
        f"eval step {rec['step']}: loss {rec['eval_loss']:.4f}, ppl {rec['eval_ppl']:.2f}{mtp} "
        f"({rec['eval_tokens']} tokens, {rec['eval_time_s']:.1f} s)"
    )
