"""Packing documents into rows of `seq_len` tokens, and assembling rows into batch arrays.

Row layout (the contract in docs/interfaces.md):
- `position_ids` restart at 0 at every document start inside a row; a document that does not fit in the
  rest of a row (pretraining only) continues at the start of the next row, where its positions restart at 0.
- `labels` are the input ids, not shifted, with -100 on every token at position 0 (a document's or a
  continuation's first token is never a target, so nothing ever learns to predict it from the previous
  document), on padding and, for SFT, on every token that is not part of a trained assistant reply.
- Pretraining documents end with EOS, which is a target (the last token predicts EOS).
- Padding appears only when a row cannot be filled (SFT, or packing off): the pad id (EOS when the tokenizer
  has no pad token), labels -100 and position id PAD_POSITION (-1): no token, which no router counts.

Pretraining rows are filled completely: documents are concatenated and split at row boundaries.
SFT rows hold whole samples, packed by best-fit decreasing over a pool of up to `pack_buffer` distinct
samples: each round sorts the pool by length, puts every sample in the fullest row that still has room (never
two copies of one sample in a row), and emits the rows in a seeded random order. Rows filled below
`CARRY_BELOW` go back into the pool and are packed first in the next round (at most `MAX_AGE` times per
sample), so the infinite loader never emits the half-empty tail row of an epoch: a data set smaller than the
pool cycles, one epoch per round, and its leftovers fill the next epoch's rows. Samples are never split; a
preference pair is one sample of two documents, placed side by side (preference.py).
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left, insort
from collections import Counter, deque
from collections.abc import Callable

import numpy as np

from dstrain.batch import IGNORE_INDEX, PAD_POSITION
from dstrain.errors import DataError

from .formats import Skip

MAX_AGE = 2
CARRY_BELOW = 0.99
PULL_CHUNK = 128
Piece = tuple  # (ids, targets): targets None = every token, else half-open token ranges


def assemble(rows: list[list[Piece]], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """Rows of pieces -> int64 arrays `input_ids`, `labels`, `position_ids` of shape (len(rows), seq_len)."""
    n = len(rows)
    ids = np.full((n, seq_len), pad_id, dtype=np.int64)
    pos = np.empty((n, seq_len), dtype=np.int64)
    ar = np.arange(seq_len, dtype=np.int64)
    trained = np.zeros((n, seq_len), dtype=bool)
    for r, pieces in enumerate(rows):
        p = 0
        for piece_ids, targets in pieces:
            k = len(piece_ids)
            ids[r, p : p + k] = piece_ids
            pos[r, p : p + k] = ar[:k]
            if targets is None:
                trained[r, p : p + k] = True
            else:
                for a, b in targets:
                    trained[r, p + a : p + b] = True
            p += k
        pos[r, p:] = PAD_POSITION
    trained &= pos > 0
    return {"input_ids": ids, "labels": np.where(trained, ids, IGNORE_INDEX), "position_ids": pos}


def best_fit_decreasing(
    lengths: list[int], capacity: int, keys: list | None = None, first: list[int] | None = None
) -> list[list[int]]:
    """Bins of item indices: items in decreasing (`first`, length) order, each into the bin with the least
    room that still fits it and does not already hold an item with the same key (a sample's copies)."""
    bins: list[list[int]] = []
    held: list[set] = []
    room: list[tuple[int, int]] = []  # sorted (remaining capacity, bin index)
    rank = first or [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-rank[i], -lengths[i])):
        need = lengths[i]
        key = None if keys is None else keys[i]
        j = bisect_left(room, (need, -1))
        while j < len(room) and key is not None and key in held[room[j][1]]:
            j += 1
        if j < len(room):
            left, b = room.pop(j)
            bins[b].append(i)
            insort(room, (left - need, b))
        else:
            bins.append([i])
            held.append(set())
            b = len(bins) - 1
            insort(room, (capacity - need, b))
        if key is not None:
            held[b].add(key)
    return bins


Pull = Callable[[int], list]  # n -> up to n (doc, origin) pairs; [] only when a finite stream is exhausted


class PretrainPacker:
    """Concatenate tokenized documents (EOS appended) and cut rows of exactly `seq_len` tokens."""

    def __init__(self, seq_len: int, encoder, pull: Pull, stats: dict, packing: bool = True, on_sample=None):
        self.seq_len, self.encoder, self.pull = seq_len, encoder, pull
        self.stats, self.packing = stats, packing
        self.on_sample = on_sample  # (origin, kept) -> None, once per document that reaches the packer
        self.pending: deque = deque()  # [doc, origin, ids]
        self.head = 0  # tokens of pending[0] already emitted
        self.avg = 256.0

    def _refill(self, want_tokens: int) -> bool:
        docs = self.pull(max(4, min(1024, math.ceil(want_tokens / self.avg) + 1)))
        if not docs:
            return False
        encoded = self.encoder.encode([d for d, _ in docs])
        self.avg = 0.8 * self.avg + 0.2 * (sum(len(e) for e in encoded) / len(encoded))
        self.stats["documents"] += len(docs)
        for _, origin in docs if self.on_sample is not None else ():
            self.on_sample(origin, True)
        self.pending.extend([d, o, e] for (d, o), e in zip(docs, encoded))
        return True

    def rows(self, n: int) -> list[list[Piece]]:
        """Up to `n` rows (fewer only when a finite stream runs dry; the last row may then be partial)."""
        out: list[list[Piece]] = []
        while len(out) < n:
            row: list[Piece] = []
            space = self.seq_len
            while space:
                if not self.pending and not self._refill(space + (n - len(out) - 1) * self.seq_len):
                    break
                ids = self.pending[0][2]
                take = min(len(ids) - self.head, space)
                row.append((ids[self.head : self.head + take], None))
                self.head += take
                space -= take
                if self.head == len(ids):
                    self.pending.popleft()
                    self.head = 0
                    if not self.packing:
                        break
                elif not self.packing:
                    break
            if not row:
                break
            out.append(row)
        return out

    def state_dict(self) -> dict:
        return {"pending": [[d, o] for d, o, _ in self.pending], "head": self.head, "avg": self.avg}

    def load_state_dict(self, state: dict) -> None:
        docs = state["pending"]
        encoded = self.encoder.encode([d for d, _ in docs]) if docs else []
        self.pending = deque([d, o, e] for (d, o), e in zip(docs, encoded))
        self.head, self.avg = state["head"], state["avg"]


class BestFitPacker:
    """Whole SFT samples into rows by best-fit decreasing over a pool (see the module docstring)."""

    def __init__(
        self,
        seq_len,
        encoder,
        pull: Pull,
        stats: dict,
        *,
        pack_buffer,
        packing,
        overlong,
        on_skip,
        seed,
        on_sample=None,
    ):
        self.seq_len, self.encoder, self.pull, self.stats = seq_len, encoder, pull, stats
        self.pack_buffer, self.packing, self.overlong = pack_buffer, packing, overlong
        self.on_skip = on_skip  # (Skip, origin) -> None: counts it, or raises under --strict
        self.on_sample = on_sample  # (origin, kept) -> None, once per sample checked (after its notes)
        self.seed = seed
        self.pool: list[list] = []  # [doc, origin, age, Encoded]
        self.queue: deque = deque()  # rows, each a list of pool items
        self.round = 0
        self.exhausted = False
        self.deferred: list = []  # (doc, origin) pulled while a copy was in the pool: next round

    def _check(self, enc) -> tuple:
        """(the sample as it is packed, or None; what to count: Skips and counter names)."""
        if isinstance(enc, Skip):
            return None, [enc]
        notes: list = []
        if len(enc.ids) > self.seq_len:
            n, what = len(enc.ids), "pair" if hasattr(enc, "pieces") else "sample"
            if self.overlong == "drop":
                return None, [
                    Skip("dropped", f"a {what} of {n} tokens, longer than --seq_len {self.seq_len}")
                ]
            enc = enc.truncated(self.seq_len)
            notes.append(Skip("truncated", f"a {what} of {n} tokens cut to --seq_len {self.seq_len}"))
        if not enc.targets:
            return None, [*notes, Skip("skipped_no_target", "no assistant token to train on")]
        return enc, notes

    def _accept(self, docs: list, count: bool = True) -> list[list]:
        items = []
        for (doc, origin), enc in zip(docs, self.encoder.encode([d for d, _ in docs])):
            enc, notes = self._check(enc)
            for note in notes if count else ():
                self.on_skip(note, origin)
            if enc is not None:
                if count:
                    self.stats["documents"] += 1
                items.append([doc, origin, 0, enc])
            if count and self.on_sample is not None:
                self.on_sample(origin, enc is not None)
        return items

    def rejections(self, docs: list) -> Counter:
        """Counter name -> how many of `docs` (doc, origin) would not be packed, and why; changes nothing."""
        out: Counter = Counter()
        for enc in self.encoder.encode([d for d, _ in docs]) if docs else ():
            enc, notes = self._check(enc)
            if enc is None:
                out[notes[-1].reason] += 1
        return out

    def holds_samples(self) -> bool:
        """Whether accepted samples wait to be placed in rows (they will be, within MAX_AGE rounds)."""
        return bool(self.pool or self.queue)

    def _fill(self) -> None:
        """Top the pool up to `pack_buffer` distinct samples. A pulled copy of a sample already in the pool
        (the data set is smaller than the pool, or the shuffle buffer spans epochs) waits for a later round,
        and filling stops once a pulled chunk is mostly such copies: rounds then span about one epoch of
        distinct samples, so rows never repeat a sample and best-fit keeps finding small samples to fill the
        gaps. Beyond `pack_buffer` waiting copies, copies enter the pool (best-fit keeps them in different
        rows), which bounds the state."""
        keys = {_key(it[1]) for it in self.pool}
        pending, self.deferred = self.deferred, []
        pulled = stop = False
        while len(self.pool) < self.pack_buffer and not self.exhausted:
            if not pending:
                if stop:
                    break
                pending = self.pull(min(PULL_CHUNK, self.pack_buffer - len(self.pool)))
                self.exhausted, pulled = not pending, True
            fresh, chunk = [], set()
            for doc, origin in pending:
                key = _key(origin)
                if (key in keys or key in chunk) and len(self.deferred) < self.pack_buffer:
                    self.deferred.append((doc, origin))
                else:
                    chunk.add(key)
                    fresh.append((doc, origin))
            stop = pulled and 2 * len(fresh) < len(pending)
            pending = []
            accepted = self._accept(fresh)
            self.pool += accepted
            keys.update(_key(it[1]) for it in accepted)

    def _round(self) -> None:
        self._fill()
        if not self.pool:
            return
        if self.packing:
            lengths = [len(it[3].ids) for it in self.pool]
            keys = [_key(it[1]) for it in self.pool]
            # samples carried over from earlier rounds go first, so they land in full rows this time
            ages = [it[2] for it in self.pool]
            bins = [[self.pool[i] for i in b] for b in best_fit_decreasing(lengths, self.seq_len, keys, ages)]
        else:
            bins = [[it] for it in self.pool]
        carry: list[list] = []
        if self.packing and not self.exhausted:
            keep = []
            for b in bins:
                fill = sum(len(it[3].ids) for it in b)
                if fill < CARRY_BELOW * self.seq_len and all(it[2] < MAX_AGE for it in b):
                    for it in b:
                        it[2] += 1
                    carry += b
                else:
                    keep.append(b)
            bins = keep
        random.Random(f"{self.seed}/{self.round}").shuffle(bins)
        self.queue.extend(bins)
        self.pool = carry
        self.round += 1

    def rows(self, n: int) -> list[list[Piece]]:
        while len(self.queue) < n:
            before = len(self.queue)
            self._round()
            if len(self.queue) == before and self.exhausted:
                break
        out = []
        while self.queue and len(out) < n:
            out.append([piece for it in self.queue.popleft() for piece in _pieces(it[3])])
        return out

    def state_dict(self) -> dict:
        return {
            "pool": [[d, o, a] for d, o, a, _ in self.pool],
            "queue": [[[d, o, a] for d, o, a, _ in row] for row in self.queue],
            "deferred": [list(x) for x in self.deferred],
            "round": self.round,
        }

    def load_state_dict(self, state: dict) -> None:
        flat = [(d, o) for d, o, _ in state["pool"]] + [(d, o) for row in state["queue"] for d, o, _ in row]
        items = self._accept(flat, count=False)
        if len(items) != len(flat):
            raise DataError(
                "data: the saved packing buffer no longer encodes the same (tokenizer or options changed)"
            )
        it = iter(items)
        self.pool = []
        for _, _, age in state["pool"]:
            item = next(it)
            item[2] = age
            self.pool.append(item)
        self.queue = deque()
        for row in state["queue"]:
            items_row = []
            for _, _, age in row:
                item = next(it)
                item[2] = age
                items_row.append(item)
            self.queue.append(items_row)
        self.round = state["round"]
        self.deferred = [tuple(x) for x in state["deferred"]]


def _pieces(enc) -> list[Piece]:  # noqa: ANN001 - an Encoded, or a PairEncoded (two documents)
    return enc.pieces() if hasattr(enc, "pieces") else [(enc.ids, enc.targets)]


def _key(origin) -> tuple | None:
    return None if origin is None else tuple(origin)
