"""Direct Preference Optimization (`--objective dpo`): the loss of preference pairs, a mean over the global batch.

A batch of preference data (dstrain/data/preference.py) holds whole pairs, each pair's chosen and rejected
completions side by side in one row, chosen first: `dstrain.batch.document_index` numbers the documents that
hold targets, and document 2k / 2k + 1 is pair k's chosen / rejected. A sequence's log-probability is the sum
of its completion tokens' log-probabilities: the model's per-position cross-entropy (`token_losses=True`, no
logits kept) summed by document. The reference (`--dpo_reference`): under LoRA, the same model with its adapters
off (`lora.adapters_disabled`), run under no_grad in the same step: no second copy of the weights; or, the
default of a full fine-tune, the initial model's log-probabilities computed by a first pass over the data and
stored with the run (reference.py), looked up by each completion's content.

Per pair, with d = (policy_c - ref_c) - (policy_r - ref_r) (TRL's DPOTrainer, f-divergence reverse KL):
- sigmoid (DPO): -log sigmoid(beta * d);
- ipo (IPO): ((policy_c - ref_c) / n_c - (policy_r - ref_r) / n_r - 1 / (2 beta))^2, n the completions'
  token counts (TRL normalises IPO's log-ratios per token).
The objective is their mean over the step's pairs on every rank: each micro batch contributes
scale * (its pairs' loss sum) / (global pair count), as objective.micro_loss does for tokens.

Layouts: expert and tensor parallelism change nothing here (the head is replicated under TP: each token's
log-probability is exact on every rank). Sequence parallelism: documents are numbered on whole rows and the
numbering is sliced with them; each rank's per-document sums are summed over its group before the loss. A
pipeline: the last stage computes the loss (`pipe_loss`, the pipeline's objective) after a reference pass
through the whole pipeline with the adapters off (`pipe_reference`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dstrain import dist
from dstrain.batch import document_index, host_to_device, target_mask
from dstrain.config.options import ObjectiveOptions
from dstrain.errors import DataError
from dstrain.model import ModelOutput
from dstrain.model.common.lora import adapters_disabled
from dstrain.parallel.comm import reduce_from_group

from . import objective
from .metrics import finite_or_none
from .reference import Table, document_keys

# TRL's metric names; each a mean over the step's pairs (accuracies: the share where chosen's reward is higher)
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


def sequence_logps(
    token_loss: torch.Tensor, documents: torch.Tensor, valid: torch.Tensor, n_docs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each document's summed log-probability of its targets (n_docs,) fp32, its target count) from the
    model's (B, n) per-position cross-entropy; `documents` (B, n) the document of each position's target
    (the batch's document_index shifted by one), `valid` the positions the model counts."""
    keep = valid & (documents >= 0)
    idx = documents[keep]
    logps = torch.zeros(n_docs, dtype=torch.float32, device=token_loss.device)
    logps = logps.index_add(0, idx, -token_loss[keep].float())
    counts = torch.zeros(n_docs, dtype=torch.float32, device=token_loss.device)
    return logps, counts.index_add(0, idx, torch.ones_like(idx, dtype=torch.float32))


def pair_losses(
    policy: torch.Tensor, ref: torch.Tensor, counts: torch.Tensor, beta: float, loss: str
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per pair: (its loss, the figures METRICS average (per pair, detached)) from per-document policy and
    reference log-probabilities and target counts, chosen at even indices."""
    chosen_ratio, rejected_ratio = policy[0::2] - ref[0::2], policy[1::2] - ref[1::2]
    if loss == "sigmoid":
        losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    else:
        delta = chosen_ratio / counts[0::2].clamp(min=1) - rejected_ratio / counts[1::2].clamp(min=1)
        losses = (delta - 1 / (2 * beta)) ** 2
    rc, rr = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    figures = {
        "rewards/chosen": rc,
        "rewards/rejected": rr,
        "rewards/margins": rc - rr,
        "rewards/accuracies": (rc > rr).float(),
        "logps/chosen": policy[0::2].detach(),
        "logps/rejected": policy[1::2].detach(),
    }
    return losses, figures


@dataclass
class Pairs:
    """The documents of a list of whole-rows batches: each batch's document count and, for a precomputed
    reference, each document's key (reference.document_keys)."""

    n_docs: list[int]
    keys: list[list[bytes]] | None = None


class DPO:
    """The trainer's DPO step: `begin_step` counts the step's pairs over the data-parallel group, `micro`
    runs one micro batch (reference and policy forwards) and returns its loss, `end_step` the step's figures."""

    def __init__(
        self,
        opts: ObjectiveOptions,
        scale: float,
        weights: objective.LossWeights,
        sp_rank: int = 0,
        tp_rank: int = 0,
    ) -> None:
        self.beta, self.loss = float(opts.dpo_beta), opts.dpo_loss
        self.precomputed = opts.dpo_reference == "precomputed"
        self.table: Table | None = None  # the precomputed reference, once read or computed (reference.py)
        self.scale, self.weights = scale, weights
        # sequence-parallel peers hold the same pairs: only the first counts them; tensor-parallel peers
        # compute the same figures: only the first reports them (summed over the world: pipeline stages
        # before the last hold zeros)
        self.share = 1.0 if sp_rank == 0 else 0.0
        self.figure_weight = self.share if tp_rank == 0 else 0.0
        self.pairs = Pairs([])
        # a pipeline's last stage: the reference pass's per-document log-probabilities, per micro batch
        self.ref: list[torch.Tensor] = []
        self.reference_pass, self.done = False, 0
        self.n_pairs: torch.Tensor | None = None
        self.sums: torch.Tensor | None = None  # [loss, *METRICS, pairs] over this rank's micro batches

    def number(
        self, batches: list[dict[str, torch.Tensor]], keys: bool | None = None
    ) -> tuple[list[dict[str, torch.Tensor]], Pairs]:
        """(the batches with their document numbering `documents` (on whole rows: before a sequence-parallel
        slice is cut), their Pairs: with `keys` (default: where the reference is precomputed) the documents'
        keys)."""
        out, n_docs = [], []
        for b in batches:
            docs = document_index(b["labels"], b.get("position_ids"))
            n = int(docs.max()) + 1
            if n % 2:
                raise DataError(
                    "data: --objective dpo needs preference pairs (`chosen` / `rejected` records, "
                    "--data_format preference): a batch holds an odd number of completions"
                )
            n_docs.append(n)
            out.append({**b, "documents": docs})
        with_keys = self.precomputed if keys is None else keys
        return out, Pairs(n_docs, [document_keys(b) for b in out] if with_keys else None)

    def begin_step(
        self, batches: list[dict[str, torch.Tensor]], dp_sum: Any, device: torch.device
    ) -> list[dict[str, torch.Tensor]]:
        """The whole rows' batches with their document numbering (`documents`, on the host: numbered before a
        sequence-parallel slice is cut, then sliced with it), and the global pair count (one all-reduce)."""
        out, self.pairs = self.number(batches)
        local = sum(self.pairs.n_docs) // 2
        self.n_pairs = dp_sum(torch.tensor(float(local) * self.share, dtype=torch.float64, device=device))
        self.sums = torch.zeros(2 + len(METRICS), dtype=torch.float64, device=device)
        self.ref, self.done = [], 0
        return out

    # ------------------------------------------------------------------ evaluation (between steps)
    def begin_eval(self, pairs: Pairs, device: torch.device) -> None:
        """Evaluation reuses the step's state (free between steps): `micro` / `pipe_loss` then add the eval
        micro batches' figures; `pairs` from `number` on the eval batches' whole rows."""
        self.pairs, self.ref, self.done = pairs, [], 0
        self.n_pairs = torch.ones((), dtype=torch.float64, device=device)  # the losses' scale: not read
        self.sums = torch.zeros(2 + len(METRICS), dtype=torch.float64, device=device)

    def eval_figures(self) -> dict[str, float | None]:
        """`eval_dpo_loss`, `eval_pairs` and METRICS prefixed `eval_`: means over the eval set's pairs."""
        step = self.end_step(0.0)
        return {f"eval_{k}": step[k] for k in ("dpo_loss", "pairs", *METRICS)}

    def _logps(self, out: ModelOutput, batch: dict[str, torch.Tensor], i: int) -> tuple:
        """(this rank's part of each document's log-probability, of its target count) in micro batch `i`."""
        docs = batch["documents"].to(out.lm_token_loss.device)
        n = out.lm_token_loss.shape[1]
        valid = target_mask(batch["labels"], batch.get("position_ids"), 1)[:, :n]
        return sequence_logps(out.lm_token_loss, docs[:, 1 : 1 + n], valid, self.pairs.n_docs[i])

    @staticmethod
    def _inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        return dict(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), labels=batch["labels"],
                    token_losses=True)  # fmt: skip

    @torch.no_grad()
    def reference(
        self, engine: Any, model: torch.nn.Module, batch: dict[str, torch.Tensor], i: int
    ) -> torch.Tensor:
        """Micro batch `i`'s documents' reference log-probabilities (whole documents under sequence
        parallelism): from the table where precomputed, else a forward with the adapters off."""
        if self.table is not None:
            return self.table.lookup(self.pairs.keys[i], batch["input_ids"].device)
        with adapters_disabled(model):
            ref, _ = self._logps(engine(**self._inputs(batch)), batch, i)
        sp = getattr(model, "seq_parallel", None)
        return sp.sum(ref) if sp is not None else ref

    def micro(self, engine: Any, model: torch.nn.Module, batch: dict[str, torch.Tensor], i: int, n_global):
        """(the model's output, the loss to hand engine.backward) for micro batch `i` (on the device)."""
        ref = self.reference(engine, model, batch, i)
        out = engine(**self._inputs(batch))
        policy, counts = self._logps(out, batch, i)
        # A sequence-parallel slice holds part of each document: the sums over the group are the documents'.
        # Every rank then computes the same loss; its gradient reaches each rank's own part (the sum's backward
        # is the identity), which the data-parallel reduction over the group adds up.
        sp = getattr(model, "seq_parallel", None)
        if sp is not None:
            policy, counts = reduce_from_group(policy, sp.group), sp.sum(counts)
        return out, self._loss(out, policy, ref, counts, n_global)

    def _loss(
        self, out: ModelOutput, policy: torch.Tensor, ref: torch.Tensor, counts: torch.Tensor, n_global
    ) -> torch.Tensor:
        """The micro batch's loss from its pairs' whole log-probabilities; its figures added to the step's."""
        losses, figures = pair_losses(policy, ref, counts, self.beta, self.loss)
        part = [losses.detach().sum()] + [figures[k].sum() for k in METRICS]
        counted = torch.stack([*part, losses.new_tensor(float(losses.numel()))]).double()
        self.sums += counted.to(self.sums.device) * self.figure_weight
        dpo = losses.sum() * (self.scale / self.n_pairs.clamp(min=1).to(losses.device, torch.float32))
        # MTP and the balance loss as in SFT (off by default under DPO): the token-mean terms without the LM's
        rest = objective.micro_loss(ModelOutput({**out, "lm_loss_sum": out.lm_loss_sum * 0}), n_global,
                                    self.scale, self.weights)  # fmt: skip
        return dpo + rest

    # ------------------------------------------------------------------ a pipeline (the last stage's loss)
    def pipe_reference(
        self, engine: Any, model: torch.nn.Module, batches: list, data: list, micro_batches: int | None = None
    ) -> list:
        """The reference pass: the step's micro batches through the pipeline with the adapters off (DeepSpeed's
        eval_batch: forward only, no gradient); the last stage keeps each micro batch's log-probabilities.
        `data`: the pipeline's (inputs, labels) per micro batch -> the same with each target's document
        (B, T-1) beside the labels (-1 where a position has no target), which the last stage reads.
        `micro_batches`: their count where it is not the step's (evaluation)."""
        out = []
        for b, (inputs, labels) in zip(batches, data, strict=True):
            docs = torch.where(target_mask(b["labels"], b.get("position_ids"), 1), b["documents"][:, 1:], -1)
            out.append((inputs, (*labels, host_to_device(docs, labels[0].device))))
        if self.table is not None:  # the last stage reads the table; no reference pass
            dev = out[0][1][0].device
            self.ref = [self.table.lookup(keys, dev) for keys in self.pairs.keys[: len(out)]]
            return out
        self.reference_pass = True
        try:
            with adapters_disabled(model):
                engine.eval_batch(
                    iter(out), compute_loss=True, bcast_loss=False, num_micro_batches=micro_batches
                )
        finally:
            self.reference_pass = False
            model.train()  # eval_batch left the last stage's model in eval mode (activation checkpointing off)
        engine.module.take_outputs()  # the step's figures are the policy pass's
        engine.module.take_indexer_stats()
        return out

    def pipe_loss(self, out: ModelOutput, n_global: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The pipeline's objective on the last stage (after `pipe_reference`, micro batches in order)."""
        n = out.lm_token_loss.shape[1]
        targets = targets[:, :n]
        i = len(self.ref) if self.reference_pass else self.done
        logps, counts = sequence_logps(out.lm_token_loss, targets, targets >= 0, self.pairs.n_docs[i])
        if self.reference_pass:
            self.ref.append(logps.detach())
            return logps.sum().detach()
        self.done += 1
        return self._loss(out, logps, self.ref[i], counts, n_global)

    def end_step(self, rest: float) -> dict[str, float | None]:
        """The step's `loss` (DPO's plus `rest`, the weighted MTP and balance losses), `dpo_loss` and METRICS,
        means over the step's pairs on every rank (one all-reduce over the world, one read)."""
        sums = dist.all_reduce(self.sums).tolist()
        pairs = max(sums[-1], 1.0)
        out = {"loss": finite_or_none(sums[0] / pairs + rest), "dpo_loss": finite_or_none(sums[0] / pairs)}
        out["pairs"] = int(sums[-1])
        out.update({k: finite_or_none(v / pairs) for k, v in zip(METRICS, sums[1:-1], strict=True)})
        return out
