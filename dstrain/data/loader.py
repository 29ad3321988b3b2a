"""`build_loader` and `Loader`: the infinite, resumable batch iterator the trainer consumes.

The order of rows is global (see `Loader`): the same global batches on any number of ranks, so a run may
continue on another world size or layout. With `num_workers = W >= 1` each rank runs W DataLoader processes
that share its streams; `num_workers` 0 and any W give the same rows. Workers attach a snapshot of a
stream's state to every `SNAPSHOT_EVERY`-th row of it; the loader's state is, per stream, the last snapshot it
has *consumed* plus the rows consumed since, so rows prefetched but not yet handed to the trainer are never
lost or repeated. On resume a stream restores its snapshot and replays those rows.

Workers and stop signals: scancel, a time limit and SLURM's --signal signal every process of the job step,
workers included. Workers ignore SIGTERM and SIGUSR1 (but for their rank's own SIGTERM): the rank decides
(training/preempt.py: stop after the step with a checkpoint). Once the rank has such a signal (`watch_stop`),
a worker that dies anyway (SIGKILLed, or signalled before it could ignore it) is not an error: the rank reads
the rows it still needs itself, from the same position, and the checkpoint saves it exactly.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dstrain.errors import DataError

from .chat import ChatEncoder
from .options import DataOptions
from .pipeline import STAT_KEYS, Stream, first_pass_line
from .sources import Source, resolve_sources
from .tokenizer import special_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("dstrain.data")
FORMAT = "dstrain.data.Loader/2"
SNAPSHOT_EVERY = 8  # rows of one stream between the snapshots a worker sends
WORKER_IGNORED_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")  # the stop signals of training/preempt.py


def _not_stopping() -> bool:
    return False


_stopping: Callable[[], bool] = _not_stopping


def watch_stop(stopping: Callable[[], bool] | None) -> None:
    """`stopping()`: whether this process has a stop signal (the trainer's preemption watch sets it; None: no
    watch). From then on a worker that dies is not an error (see the top)."""
    global _stopping
    _stopping = stopping or _not_stopping


def ignoring_stop_signals(init: Callable[[int], None] | None = None) -> Callable[[int], None]:
    """A DataLoader `worker_init_fn`: WORKER_IGNORED_SIGNALS from anyone but the worker's parent ignored, then
    `init` (a picklable partial, so workers may also be spawned)."""
    return functools.partial(_init_worker, init)


def _init_worker(init: Callable[[int], None] | None, worker_id: int) -> None:
    _leave_stop_signals_to_parent()
    if init is not None:
        init(worker_id)


def _leave_stop_signals_to_parent() -> None:
    # Not SIG_IGN: the parent's own SIGTERM must still end a worker (torch's last resort for a worker that does
    # not stop when told, multiprocessing's for daemonic children at exit; without it, an iterator that the
    # garbage collector finalizes after its queues leaves workers behind, and the exit waits for them forever).
    # torch's worker handler exits on the parent's SIGTERM and dies of anyone else's; this thread does the
    # same, but ignores anyone else's.
    if not hasattr(signal, "sigwaitinfo"):  # macOS: torch's handlers stay
        return
    sigs = {getattr(signal, name) for name in WORKER_IGNORED_SIGNALS}
    # Blocked in this thread, so in every thread the worker starts from here (a fresh worker runs no other):
    # they wait for the one thread that takes them, and sees who sent them.
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    threading.Thread(
        target=_take_stop_signals, args=(os.getppid(), sigs), name="dstrain-stop-signals", daemon=True
    ).start()


def _take_stop_signals(parent: int, sigs: set[signal.Signals]) -> None:
    while True:
        info = signal.sigwaitinfo(sigs)
        if info.si_signo == signal.SIGTERM and info.si_pid == parent:
            os._exit(0)


def _report_dead_workers_late() -> None:
    """torch reports a dead worker from its SIGCHLD handler, that is at whatever line the rank runs (a
    collective, a save): once the rank is stopping, the report waits for the next fetch instead."""
    sig = getattr(signal, "SIGCHLD", None)
    if sig is None or threading.current_thread() is not threading.main_thread():
        return
    torch_handler = signal.getsignal(sig)
    if not callable(torch_handler) or getattr(torch_handler, "dstrain_late", False):
        return

    def handler(signum: int, frame: object) -> None:
        if not _stopping():
            torch_handler(signum, frame)

    handler.dstrain_late = True  # type: ignore[attr-defined]
    signal.signal(sig, handler)


def default_streams(dp_world: int, workers: int) -> int:
    """The smallest multiple of the readers (ranks x workers) that is at least 8."""
    readers = dp_world * max(1, workers)
    return readers * max(1, -(-8 // readers))


def merge_states(states: list[dict]) -> dict:
    """One state holding every stream of the given ranks' loader states (all saved at the same step): what a
    run on another number of ranks resumes from, each rank taking its own streams."""
    first = states[0]
    for other in states[1:]:
        if other.get("global_rows") != first.get("global_rows"):
            raise DataError(
                f"data: loader states of one checkpoint disagree on the rows consumed "
                f"({other.get('global_rows')} vs {first.get('global_rows')})"
            )
    merged: dict = {}
    for state in states:
        merged.update(state.get("stream_states", {}))
    return {**first, "stream_states": merged}


def _row_tensors(rows: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.concatenate([r[k] for r in rows])) for k in rows[0]}


@dataclass(frozen=True)
class _Streams:
    """This rank's streams: which one serves a local row, and how to open one from its saved state."""

    sources: list[Source]
    opts: DataOptions
    tok: Any
    streams: int
    seed: int
    mine: list[int]

    def of(self, row: int) -> int:
        return self.mine[row % len(self.mine)]

    def open(self, s: int, saved: dict) -> Stream:
        stream = Stream(self.sources, self.opts, self.tok, 1, s, self.streams, self.seed, saved["stream"])
        stream.skip_rows(saved["replay"])
        return stream


class _Workers(torch.utils.data.IterableDataset):
    """DataLoader worker i yields local rows first + i, first + i + W, ... (one row per item, so torch's
    round-robin over workers hands them out in row order); those rows come from the fixed subset of this
    rank's streams that W divides out. It holds what the workers need, not the Loader: a Loader whose
    workers' dataset pointed back at it would be a reference cycle, freed by the garbage collector too late
    (Loader.close)."""

    def __init__(self, loader: Loader):
        self.layout, self.workers = loader._layout, loader._workers
        self.first = loader._rows_done
        self.states = {s: dict(st) for s, st in loader._states.items()}

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        ld, n = self.layout, self.workers
        i = info.id if info else 0
        streams: dict[int, Stream] = {}
        since: dict[int, int] = {}
        try:
            row = self.first + i
            while True:
                s = ld.of(row)
                if s not in streams:
                    streams[s] = ld.open(s, self.states[s])
                    since[s] = 0
                stream = streams[s]
                batch = stream.next_batch()
                since[s] += 1
                snap = None
                if since[s] >= SNAPSHOT_EVERY:
                    snap, since[s] = stream.state_dict(), 0
                yield {
                    "stream": s,
                    "row": batch,
                    "snapshot": snap,
                    "stats": dict(stream.stats),
                    "epoch": stream.epoch,
                    "first_pass": stream.first_pass,
                }
                row += n
        except DataError as e:  # re-raised in the training process with the same one-line message
            yield {"stream": -1, "error": str(e)}


class Loader:
    """Infinite iterator of batches: dicts of LongTensors `input_ids`, `labels`, `position_ids`, each of shape
    (micro_batch_size, seq_len). `state_dict()` / `load_state_dict()` resume it exactly, on the same or
    another number of ranks (see `merge_states`); `stats` counts.

    Rows: the data is split into `streams` streams (pipeline.Stream, consumer s of `streams`); global row g is
    stream g mod streams's next row. Rank r of dp takes global rows r, r + dp, r + 2 dp, ..., that is its local
    row l is global row r + dp * l, read from stream r + dp * (l mod streams/dp). Each global batch (micro x
    GA x dp consecutive global rows) is therefore the same set of rows for any dp, micro and GA that multiply
    to it, and a checkpoint's position is one number, the global rows consumed."""

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
        self._set_streams(opts.data_streams or default_streams(dp_world, opts.num_workers))
        self._rows_done = 0  # this rank's rows handed out
        self._it = None
        self._in_process = opts.num_workers == 0  # or since a worker died while stopping
        self._live: dict[int, Stream] = {}  # read in this process: the streams

    def _set_streams(self, n: int) -> None:
        readers = self.dp_world * self._workers
        if n % readers:
            raise DataError(
                f"data: {n} data streams cannot be shared by {self.dp_world} data-parallel rank(s) x "
                f"{self._workers} worker(s): the streams must be a multiple of {readers} "
                "(--data_streams, or a resumed checkpoint's; change --num_workers or the rank count)"
            )
        self.streams = n
        self._mine = list(range(self.dp_rank, n, self.dp_world))
        self._layout = _Streams(self._sources, self.opts, self._tok, n, self.seed, self._mine)
        self._states: dict[int, dict] = {s: {"stream": None, "replay": 0} for s in self._mine}
        self._stats: dict[int, dict] = {s: {} for s in self._mine}
        self._epochs: dict[int, int] = dict.fromkeys(self._mine, 0)
        self._first: dict[int, list] = {s: [None] * len(self._sources) for s in self._mine}
        self._said: set[int] = set()  # sources whose first pass this rank has said

    @property
    def sft(self) -> bool:
        return self._sources[0].fmt != "text"

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        rows = [self._next_row() for _ in range(self.micro_batch_size)]
        return _row_tensors(rows)

    def _next_row(self) -> dict:
        s = self._layout.of(self._rows_done)
        row = None if self._in_process else self._row_from_workers(s)
        if row is None:
            if s not in self._live:
                self._live[s] = self._layout.open(s, self._states[s])
            stream = self._live[s]
            row = stream.next_batch()
            self._stats[s], self._epochs[s] = stream.stats, stream.epoch
            self._first[s] = stream.first_pass
        self._rows_done += 1
        self._say_first_passes()
        return row

    def _say_first_passes(self) -> None:
        """A line per source once each of this rank's streams has passed over its share of it: records,
        samples, and what was skipped, dropped or truncated, by reason (data-parallel rank 0 says its own)."""
        if self.dp_rank != 0 or len(self._said) == len(self._sources):
            return
        share = f" (this rank's {len(self._mine)} of {self.streams} streams)" if self.dp_world > 1 else ""
        for i, src in enumerate(self._sources):
            passes = [self._first[s][i] for s in self._mine]
            if i in self._said or any(p is None for p in passes):
                continue
            self._said.add(i)
            # a tiny source that some stream read whole (its share held no sample): that stream saw each record
            whole = next((p for p in passes if p.get("whole")), None)
            counts = Counter(whole) if whole else sum(map(Counter, passes), Counter())
            lost, line = first_pass_line(src.spec, counts, self.opts.seq_len, "" if whole else share)
            log.log(logging.WARNING if lost else logging.INFO, "%s", line)

    def _row_from_workers(self, s: int) -> dict | None:
        """Stream `s`'s next row from the workers; None when one died while this process is stopping."""
        if self._it is None:
            loader = torch.utils.data.DataLoader(
                _Workers(self),
                batch_size=None,
                num_workers=self._workers,
                prefetch_factor=16,
                worker_init_fn=ignoring_stop_signals(),
            )
            self._it = iter(loader)
            _report_dead_workers_late()
        try:
            item = next(self._it)
        except (RuntimeError, OSError, EOFError):
            # A worker that dies shows as torch's "DataLoader worker (pid ...) exited unexpectedly / is
            # killed", or, when it dies holding a row this process is receiving, as the pipe's EOFError or
            # the reset connection that would have passed the row's shared memory (measured: ~1 in 3 kills).
            if not _stopping():
                raise
            self.close()
            self._in_process = True  # same rows (any num_workers gives the same), from the consumed position
            return None
        if "error" in item:
            self.close()
            raise DataError(item["error"])
        assert item["stream"] == s, (item["stream"], s)
        state = self._states[s]
        if item["snapshot"] is not None:
            self._states[s] = {"stream": item["snapshot"], "replay": 0}
        else:
            self._states[s] = {**state, "replay": state["replay"] + 1}
        self._stats[s], self._epochs[s] = item["stats"], item["epoch"]
        self._first[s] = item["first_pass"]
        return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in item["row"].items()}

    @property
    def stats(self) -> dict[str, int]:
        """Counters summed over this rank's streams: documents, tokens, targets, rows, padding, dropped,
        truncated, skipped_* ... plus `epoch` (complete passes over the least-advanced source)."""
        stats: Counter = Counter(dict.fromkeys(STAT_KEYS, 0))
        for s in self._stats.values():
            stats.update(s)
        return {**{k: int(v) for k, v in sorted(stats.items())}, "epoch": min(self._epochs.values())}

    @property
    def epoch(self) -> int:
        return self.stats["epoch"]

    def _identity(self) -> dict:
        return {"seed": self.seed, "data": self.opts.data, "seq_len": self.opts.seq_len}

    def state_dict(self) -> dict:
        """JSON-serialisable: the global rows consumed and, per stream of this rank, its state (source
        positions, epochs, shuffle buffer, packing buffer, counters) and the rows consumed since it."""
        states = dict(self._states)
        for s, stream in self._live.items():
            states[s] = {"stream": stream.state_dict(), "replay": 0}
        return {
            "format": FORMAT,
            **self._identity(),
            "streams": self.streams,
            "global_rows": self._rows_done * self.dp_world,
            "stream_states": {str(s): st for s, st in states.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from this rank's own state, or from `merge_states` of another layout's ranks."""
        if state.get("format") != FORMAT:
            raise DataError(f"data: not a dstrain loader state (format {state.get('format')!r})")
        now = self._identity()
        diff = [f"{k}={state.get(k)!r} (now {v!r})" for k, v in now.items() if state.get(k) != v]
        if diff:
            raise DataError(f"data: loader state does not match this run: saved with {', '.join(diff)}")
        self.close()
        self._set_streams(int(state["streams"]))
        rows = int(state["global_rows"])
        if rows % self.dp_world:
            raise DataError(
                f"data: the checkpoint consumed {rows} rows, which {self.dp_world} data-parallel ranks cannot "
                "share evenly (keep a global batch that is a multiple of the rank count)"
            )
        saved = state["stream_states"]
        missing = [s for s in self._mine if str(s) not in saved]
        if missing:
            raise DataError(f"data: loader state lacks stream(s) {missing} of {self.streams}")
        self._rows_done = rows // self.dp_world
        for s in self._mine:
            self._states[s] = dict(saved[str(s)])
            stream = self._states[s]["stream"] or {}
            self._stats[s] = dict(stream.get("stats", {}))
            self._epochs[s] = min((r["epoch"] for r in stream.get("readers", [])), default=0)
            self._first[s] = stream.get("first_pass") or [None] * len(self._sources)

    def close(self) -> None:
        """Stop the worker processes (a later `next()` restarts them from the current state). Whoever is done
        with a loader calls it: a loader the garbage collector finds in a reference cycle has its workers'
        queues closed by multiprocessing's finalizers before torch's iterator can tell the workers to stop, and
        torch then waits 5 s (MP_STATUS_CHECK_INTERVAL) per worker before killing it."""
        for s, stream in self._live.items():
            self._states[s] = {"stream": stream.state_dict(), "replay": 0}
        self._live = {}
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
    objective: str | None = None,
) -> Loader:
    """Resolve and check the data and tokenizer up front (errors surface here, in the training process, as
    one-line `DataError`s), then return this rank's `Loader`. `objective`: the run's --objective (sources.
    resolve_sources: `dpo` needs pairs, `sft` reads pairs' chosen side)."""
    if micro_batch_size < 1:
        raise DataError(f"micro_batch_size must be >= 1 (got {micro_batch_size})")
    if not (0 <= dp_rank < dp_world):
        raise DataError(f"dp_rank must be in [0, dp_world) (got dp_rank={dp_rank}, dp_world={dp_world})")
    special_ids(tokenizer)
    sources = resolve_sources(opts, objective)
    if sources[0].fmt != "text":
        ChatEncoder(
            tokenizer, opts.sft_turns, opts.think
        )  # no chat template -> DataError now, not in a worker
    if opts.num_workers > 0:
        # tokenizers' own thread pool cannot survive fork; workers are the parallelism instead
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return Loader(opts, tokenizer, micro_batch_size, sources, dp_rank=dp_rank, dp_world=dp_world, seed=seed)


def epoch_rows(opts: DataOptions, tokenizer: PreTrainedTokenizerBase, objective: str | None = None) -> int:
    """Packed rows of one pass over the training data, counted by reading, tokenizing and packing it all as
    the loader does (one stream; the last rows flushed partly filled): what `--epochs` turns into steps."""
    stream = Stream(resolve_sources(opts, objective), opts, tokenizer, 8, 0, 1, 0, epochs=1)
    n = 0
    while rows := stream.rows(64):
        n += len(rows)
    for src, first in zip(stream.sources, stream.first_passes()):
        if first is not None:
            lost, line = first_pass_line(src.spec, first, opts.seq_len)
            log.log(logging.WARNING if lost else logging.INFO, "%s", line)
    if not n:
        raise DataError(f"data: no usable sample in a whole epoch of {opts.data}")
    return n
