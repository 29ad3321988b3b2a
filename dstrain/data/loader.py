"""`build_loader` and `Loader`: the infinite, resumable batch iterator the trainer consumes.

With `num_workers = W >= 1` each rank runs W DataLoader processes, each one consumer stream (see
pipeline.py); torch hands their batches out round-robin, so the batch sequence is fixed by (data, seed,
dp_world, W). `num_workers` 0 and 1 give the same batches. Workers attach a snapshot of their stream state to
every `SNAPSHOT_EVERY`-th batch; the loader's state is, per worker, the last snapshot it has *consumed* plus
the number of rows consumed since, so batches prefetched but not yet handed to the trainer are never lost or
repeated. On resume a worker restores its snapshot and replays those rows (at most SNAPSHOT_EVERY - 1
batches of work).
"""

from __future__ import annotations

import os
from collections import Counter
from typing import TYPE_CHECKING

import torch

from dstrain.errors import DataError

from .chat import ChatEncoder
from .options import DataOptions
from .pipeline import STAT_KEYS, Stream
from .sources import Source, resolve_sources
from .tokenizer import special_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FORMAT = "dstrain.data.Loader/1"
SNAPSHOT_EVERY = 8


def _tensors(batch: dict) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in batch.items()}


class _Workers(torch.utils.data.IterableDataset):
    def __init__(self, loader: Loader):
        self.sources, self.opts, self.tok = loader._sources, loader.opts, loader._tok
        self.rows, self.dp_rank, self.workers = loader.micro_batch_size, loader.dp_rank, loader._workers
        self.n_consumers, self.seed = loader.dp_world * loader._workers, loader.seed
        self.states, self.rotate = [dict(s) for s in loader._states], loader._next

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        logical = ((info.id if info else 0) + self.rotate) % self.workers
        try:
            saved = self.states[logical]
            stream = Stream(
                self.sources,
                self.opts,
                self.tok,
                self.rows,
                self.dp_rank * self.workers + logical,
                self.n_consumers,
                self.seed,
                saved["stream"],
            )
            stream.skip_rows(saved["replay"])
            since = 0
            while True:
                batch = stream.next_batch()
                since += 1
                snap = None
                if since >= SNAPSHOT_EVERY:
                    snap, since = stream.state_dict(), 0
                yield {
                    "worker": logical,
                    "batch": _tensors(batch),
                    "snapshot": snap,
                    "stats": dict(stream.stats),
                    "epoch": stream.epoch,
                }
        except DataError as e:  # re-raised in the training process with the same one-line message
            yield {"worker": logical, "error": str(e)}


class Loader:
    """Infinite iterator of batches: dicts of LongTensors `input_ids`, `labels`, `position_ids`, each of shape
    (micro_batch_size, seq_len). `state_dict()` / `load_state_dict()` resume it exactly; `stats` counts."""

    def __init__(
        self,
        opts: DataOptions,
        tok,
        micro_batch_size: int,
        sources: list[Source],
        *,
        dp_rank: int = 0,
        dp_world: int = 1,
        seed: int = 0,
    ):
        self.opts, self._tok, self._sources = opts, tok, sources
        self.micro_batch_size, self.seed = micro_batch_size, seed
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self._workers = max(1, opts.num_workers)
        self._states: list[dict] = [{"stream": None, "replay": 0} for _ in range(self._workers)]
        self._stats: list[dict] = [{} for _ in range(self._workers)]
        self._epochs = [0] * self._workers
        self._next = 0
        self._it = None
        self._stream: Stream | None = None

    @property
    def sft(self) -> bool:
        return self._sources[0].fmt != "text"

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.opts.num_workers == 0:
            if self._stream is None:
                saved = self._states[0]
                self._stream = Stream(
                    self._sources,
                    self.opts,
                    self._tok,
                    self.micro_batch_size,
                    self.dp_rank,
                    self.dp_world,
                    self.seed,
                    saved["stream"],
                )
                self._stream.skip_rows(saved["replay"])
                self._stats[0] = self._stream.stats
            batch = self._stream.next_batch()
            self._epochs[0] = self._stream.epoch
            return _tensors(batch)
        if self._it is None:
            self._it = iter(
                torch.utils.data.DataLoader(
                    _Workers(self), batch_size=None, num_workers=self._workers, prefetch_factor=4
                )
            )
        item = next(self._it)
        w = item["worker"]
        if "error" in item:
            self.close()
            raise DataError(item["error"])
        if item["snapshot"] is not None:
            self._states[w] = {"stream": item["snapshot"], "replay": 0}
        else:
            self._states[w] = {**self._states[w], "replay": self._states[w]["replay"] + self.micro_batch_size}
        self._stats[w], self._epochs[w] = item["stats"], item["epoch"]
        self._next = (w + 1) % self._workers
        return item["batch"]

    @property
    def stats(self) -> dict[str, int]:
        """Counters summed over this rank's workers: documents, tokens, targets, rows, padding, dropped,
        truncated, skipped_* ... plus `epoch` (complete passes over the least-advanced source)."""
        stats: Counter = Counter(dict.fromkeys(STAT_KEYS, 0))
        for s in self._stats:
            stats.update(s)
        return {**{k: int(v) for k, v in sorted(stats.items())}, "epoch": min(self._epochs)}

    @property
    def epoch(self) -> int:
        return self.stats["epoch"]

    def _layout(self) -> dict:
        return {
            "dp_rank": self.dp_rank,
            "dp_world": self.dp_world,
            "workers": self._workers,
            "seed": self.seed,
            "data": self.opts.data,
            "seq_len": self.opts.seq_len,
        }

    def state_dict(self) -> dict:
        """JSON-serialisable: per worker the stream state (source positions, epochs, shuffle buffer, packing
        buffer, counters) and the rows consumed since it, plus the next worker to read from."""
        states = self._states
        if self._stream is not None:
            states = [{"stream": self._stream.state_dict(), "replay": 0}]
        return {"format": FORMAT, **self._layout(), "next_worker": self._next, "workers_state": states}

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != FORMAT:
            raise DataError(f"data: not a dstrain loader state (format {state.get('format')!r})")
        layout = self._layout()
        diff = [f"{k}={state.get(k)!r} (now {v!r})" for k, v in layout.items() if state.get(k) != v]
        if diff:
            raise DataError(f"data: loader state does not match this run: saved with {', '.join(diff)}")
        self.close()
        self._states = [dict(s) for s in state["workers_state"]]
        self._next = state["next_worker"]
        for w, saved in enumerate(self._states):
            stream = saved["stream"] or {}
            self._stats[w] = dict(stream.get("stats", {}))
            self._epochs[w] = min((r["epoch"] for r in stream.get("readers", [])), default=0)

    def close(self) -> None:
        """Stop the worker processes (a later `next()` restarts them from the current state)."""
        if self._stream is not None:
            self._states = [{"stream": self._stream.state_dict(), "replay": 0}]
            self._stream = None
        self._it = None

    def __del__(self):
        self._it = None


def build_loader(
    opts: DataOptions,
    tokenizer: PreTrainedTokenizerBase,
    micro_batch_size: int,
    *,
    dp_rank: int = 0,
    dp_world: int = 1,
    seed: int = 0,
) -> Loader:
    """Resolve and check the data and tokenizer up front (errors surface here, in the training process, as
    one-line `DataError`s), then return this rank's `Loader`."""
    if micro_batch_size < 1:
        raise DataError(f"micro_batch_size must be >= 1 (got {micro_batch_size})")
    if not (0 <= dp_rank < dp_world):
        raise DataError(f"dp_rank must be in [0, dp_world) (got dp_rank={dp_rank}, dp_world={dp_world})")
    special_ids(tokenizer)
    sources = resolve_sources(opts)
    if sources[0].fmt != "text":
        ChatEncoder(
            tokenizer, opts.sft_turns, opts.think
        )  # no chat template -> DataError now, not in a worker
    if opts.num_workers > 0:
        # tokenizers' own thread pool cannot survive fork; workers are the parallelism instead
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return Loader(opts, tokenizer, micro_batch_size, sources, dp_rank=dp_rank, dp_world=dp_world, seed=seed)
