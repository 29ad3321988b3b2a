"""DPO's precomputed reference (`--dpo_reference precomputed`, the default of a full fine-tune): each completion's
log-probability under the initial model, computed in a first pass over the data before the first update and
stored with the run, so no second copy of the weights is kept and no reference forward runs per step.

A completion is found by its content, not its place: the key of a document is a hash of its tokens and of which
of them are targets (`document_keys`, on whole rows before any sequence-parallel slice). The table therefore
serves any layout, any batch composition and any later epoch (a pair re-packed into another row is the same
document), and a resumed run reads it back from the run folder (`FILE`) whatever its layout. The pass reads
exactly the rows the run will read (its loader, read ahead over every step and rewound: the shuffle and the
packing need not be predicted) and runs a reference forward only for steps holding a completion not seen
before (a later epoch costs reading, not forwards); the ranks' tables are joined and rank 0 writes the file.
Evaluation pairs are added by the same pass. The table records the steps its pass covered: a run resumed with
more steps extends it before its checkpoint loads, while the engine still holds the initial model.

TRL's `precompute_ref_log_probs` does the same per dataset row; dstrain keys by content because its rows are
packed and re-sharded.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from dstrain import dist
from dstrain.atomic import write_atomic
from dstrain.batch import IGNORE_INDEX, document_index, to_device
from dstrain.errors import CheckpointError, DataError

from .metrics import plural

FILE = "dpo_reference.safetensors"


def document_keys(batch: dict[str, torch.Tensor]) -> list[bytes]:
    """A key per document of a whole-rows batch, in `document_index` order (its `documents` where DPO.number
    put them there): a hash of its token ids and of which of them are targets."""
    docs = batch.get("documents")
    docs = (document_index(batch["labels"], batch.get("position_ids")) if docs is None else docs).flatten()
    keep = docs >= 0
    order = docs[keep].argsort(stable=True)
    ids = batch["input_ids"].flatten()[keep][order].to(torch.int64)
    target = (batch["labels"].flatten()[keep][order] != IGNORE_INDEX).to(torch.int64)
    counts = torch.bincount(docs[keep]).tolist() if keep.any() else []
    keys = []
    for tok, tgt in zip(ids.split(counts), target.split(counts), strict=True):
        h = hashlib.blake2b(tok.numpy().tobytes(), digest_size=16)
        h.update(tgt.to(torch.uint8).numpy().tobytes())
        keys.append(h.digest())
    return keys


class Table:
    """Completion key -> its reference log-probability (summed over its target tokens)."""

    def __init__(self, logps: dict[bytes, float] | None = None, steps: int | None = None) -> None:
        self.logps: dict[bytes, float] = dict(logps or {})
        # the --max_steps its first pass covered (None: a table written before that was kept)
        self.steps = steps

    def __len__(self) -> int:
        return len(self.logps)

    def add(self, keys: list[bytes], logps: torch.Tensor) -> None:
        self.logps.update(zip(keys, logps.double().tolist(), strict=True))

    def lookup(self, keys: list[bytes], device: torch.device) -> torch.Tensor:
        """(n,) fp32 on `device` for `keys` in order; a key the first pass never saw is an error."""
        try:
            values = [self.logps[k] for k in keys]
        except KeyError:
            covered = f"the run's first {self.steps} steps" if self.steps is not None else "the run's steps"
            raise DataError(
                "data: a preference pair the DPO reference pass never saw: it read the data of "
                f"{covered} with the initial model (the reference, {FILE} in the run folder), and this run "
                "reads others: the data changed since (or the table predates the extension of a resumed run "
                "with a larger --max_steps). To train on them: a new run (another --output_dir) with the same "
                "--model and this --data, whose pass covers them; or `dstrain export` this run and fine-tune "
                "that folder as --model (the trained model is then the reference)"
            ) from None
        return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)

    def joined(self) -> Table:
        """Every rank's entries (one all-gather over the world)."""
        if not (tdist.is_initialized() and tdist.get_world_size() > 1):
            return self
        parts: list[Any] = [None] * tdist.get_world_size()
        tdist.all_gather_object(parts, self.logps)
        out = Table(steps=self.steps)
        for p in parts:
            out.logps.update(p)
        return out

    def save(self, path: str | os.PathLike) -> None:
        from safetensors.torch import save

        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

        keys = sorted(self.logps)
        tensors = {
            "keys": torch.frombuffer(bytearray(b"".join(keys)), dtype=torch.uint8).view(len(keys), 16)
            if keys
            else torch.zeros(0, 16, dtype=torch.uint8),
            "logps": torch.tensor([self.logps[k] for k in keys], dtype=torch.float64),
        }
        metadata = {"format": "dstrain-dpo-reference-1"}
        if self.steps is not None:
            metadata["steps"] = str(self.steps)
        write_atomic(str(path), save(tensors, metadata=metadata))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Table:
        from safetensors import safe_open
        from safetensors.torch import load_file

        t = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            steps = (f.metadata() or {}).get("steps")
        keys = [bytes(row) for row in t["keys"].numpy()]
        return cls(dict(zip(keys, t["logps"].tolist(), strict=True)), int(steps) if steps else None)


def find(output_dir: str, resume_path: str | None) -> Path | None:
    """The table of a resumed run: in its run folder, or in the folder of the checkpoint it resumes from."""
    places = [Path(output_dir) / FILE]
    if resume_path is not None:  # RUN/checkpoints/step_N
        places.append(Path(resume_path).resolve().parent.parent / FILE)
    return next((p for p in places if p.is_file()), None)


def open_table(trainer: Any) -> Table:
    """The run's reference table: read back on resume, else computed by the first pass and written. Called
    before a resumed run loads its checkpoint: the engine still holds the initial model, so a run resumed with
    a larger --max_steps than its pass covered extends the table with the steps past them."""
    path = Path(trainer.output_dir) / FILE
    end = trainer.opts.schedule.max_steps
    known = None
    if trainer.resume_path is not None:
        found = find(trainer.output_dir, trainer.resume_path)
        if found is None:
            raise CheckpointError(
                f"resume {trainer.resume_path}: --objective dpo with a precomputed reference needs its {FILE}, "
                "found neither in the run folder nor beside the checkpoint"
            )
        known = Table.load(found)
        if known.steps is None or end <= known.steps:  # (a table without its steps: as it is)
            if trainer.info.is_main and found != path:  # the run folder keeps its own copy for later resumes
                known.save(path)
            return known
    t0 = time.perf_counter()
    if trainer.verbose:
        what = plural(end, "step")
        if known is None:
            print(f"dstrain: DPO reference: a first pass over the run's {what} of data with the initial model",
                  flush=True)  # fmt: skip
        else:
            print(f"dstrain: DPO reference: its pass covered {plural(known.steps, 'step')}, the run goes to "
                  f"{end}: extending it with the initial model, before the checkpoint loads", flush=True)  # fmt: skip
    table, steps = first_pass(trainer, known)
    table.steps = end
    table = table.joined()
    if known is not None:
        table.logps = known.logps | table.logps
    if trainer.info.is_main:
        table.save(path)
    dist.barrier()
    if trainer.verbose:
        print(
            f"dstrain: DPO reference: {len(table)} completions' log-probabilities from the initial model "
            f"(forwards for {plural(steps, 'step')}{' and the eval set' if trainer.evaluator else ''}, "
            f"{time.perf_counter() - t0:.1f} s), in {path}",
            flush=True,
        )
    return table


@torch.no_grad()
def first_pass(trainer: Any, known: Table | None = None) -> tuple[Table, int]:
    """This rank's entries: every step of the run's data (its loader, read ahead and rewound), a reference
    forward for each step holding a completion not seen before on some rank (nor in `known`, a table being
    extended), then the eval set. -> (the entries, the steps that ran a forward)."""
    dpo, table, loader = trainer.dpo, Table(), trainer.loader
    start = loader.state_dict()
    # this rank's completions (a pipeline's first stages compute no log-probability), and the known ones
    seen: set[bytes] = set(known.logps) if known is not None else set()
    forwards = 0
    try:
        for _ in range(trainer.opts.schedule.max_steps):
            batches = [next(loader) for _ in range(trainer.ga)]
            numbered, pairs = dpo.number(batches, keys=True)
            new = torch.tensor([float(any(k not in seen for keys in pairs.keys for k in keys))])
            if not dist.all_reduce(new.to(trainer.info.device), tdist.ReduceOp.MAX).item():
                continue  # a later epoch's step: every rank knows its completions (the ranks agree: collectives)
            forwards += 1
            logps = reference_logps(trainer, [trainer._shard(b) for b in numbered], pairs)
            for keys, lp in zip(pairs.keys, logps, strict=True):
                seen.update(keys)
                if lp is not None:
                    table.add(keys, lp)
    finally:
        loader.load_state_dict(start)
    if trainer.evaluator is not None:
        ev = trainer.evaluator
        for keys, lp in zip(ev.pairs.keys, reference_logps(trainer, ev.batches, ev.pairs), strict=True):
            if lp is not None:
                table.add(keys, lp)
    return table, forwards


def reference_logps(trainer: Any, batches: list, pairs: Any) -> list[torch.Tensor | None]:
    """The reference log-probabilities of each micro batch's documents (`batches` this rank's slices of whole
    rows numbered into `pairs`); None on pipeline stages before the last."""
    dpo = trainer.dpo
    dpo.pairs, dpo.ref, dpo.done = pairs, [], 0
    if not trainer.pipe:
        dev = trainer.info.device
        return [
            dpo.reference(trainer.engine, trainer.model, to_device(b, dev), i) for i, b in enumerate(batches)
        ]
    data = trainer._pipe_data(batches, torch.ones(1 + trainer.mtp_depth))
    dpo.pipe_reference(trainer.engine, trainer.model, batches, data, len(batches))
    return list(dpo.ref) if trainer.engine.is_last_stage() else [None] * len(batches)
