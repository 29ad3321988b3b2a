"""One data stream: read -> mix -> shuffle -> tokenize -> pack.

Streams (consumers) are numbered 0 .. n-1 (`--data_streams`; loader.py deals them out to ranks and workers). A source with at least as
many shards as consumers is split by shard (shard i goes to consumer i mod n); otherwise every consumer reads
every shard and keeps the records whose row index is its own modulo n. Either way consumers read disjoint
records and together cover the whole source. Each consumer cycles through its part forever; each source keeps
its own epoch counter, and the shard order is reshuffled every epoch from (seed, source, epoch).

Randomness is counter-based (a hash of seed, consumer and step), so the stream's state is plain counters plus
the buffered documents: `state_dict()` is JSON and small, and restoring it reproduces exactly the rows the
uninterrupted stream would have produced. Buffers hold documents (text or chats), not tokens; restoring
re-tokenizes them, which is deterministic.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections import Counter

from dstrain.batch import IGNORE_INDEX
from dstrain.errors import DataError

from .chat import ChatEncoder
from .formats import Normalizer, Skip, needed_columns
from .options import DataOptions
from .packing import BestFitPacker, PretrainPacker, assemble
from .sources import ShardReadError, Source, read_shard, table_columns
from .tokenizer import PretrainEncoder, special_ids

log = logging.getLogger("dstrain.data")
STATE_VERSION = 1
STAT_KEYS = (
    "documents",
    "tokens",
    "targets",
    "rows",
    "padding",
    "dropped",
    "truncated",
    "skipped_empty",
    "skipped_missing_field",
    "skipped_undecodable",
    "skipped_no_assistant",
    "skipped_no_target",
    "skipped_template",
    "skipped_non_text",
    "skipped_tools",
    "skipped_bad_tool_call",
    "skipped_files",
    "held_out",
)
_M64 = (1 << 64) - 1
_WARNED: set = set()  # (skip reason, source) said in this process
_START = {"epoch": 0, "pos": 0, "row": 0, "sub": 0, "rows": 0, "docs": 0}  # a reader's state at the start
RECOUNT_DOCS = 100_000  # records read again to name the skip reasons when nothing is usable
# what a bare counter name does not say
_NOTES = {
    "dropped": "longer than --seq_len {seq_len}",
    "skipped_no_target": "no assistant token left to train on",
    "skipped_template": "the chat template cannot render them",
    "skipped_non_text": "images, audio or video: dstrain trains text-only models",
    "skipped_tools": "the chat template does not render their tool calls or tools",
    "skipped_bad_tool_call": "malformed tool calls or tools",
    "skipped_files": "unreadable files",
}


def skip_summary(counts, seq_len: int) -> str:
    """`3 skipped_no_assistant, 2 dropped (longer than --seq_len 64)`: the nonzero skip counters."""
    # in the order records fall out: while reading, then after tokenizing
    order = {
        k: i
        for i, k in enumerate([k for k in STAT_KEYS if k.startswith("skipped")] + ["dropped", "held_out"])
    }
    keys = [k for k in counts if counts[k] and (k.startswith("skipped") or k in ("dropped", "held_out"))]
    parts = []
    for k in sorted(keys, key=lambda k: (order.get(k, len(order)), k)):
        note = _NOTES.get(k, "").format(seq_len=seq_len)
        parts.append(f"{counts[k]} {k}{f' ({note})' if note else ''}")
    return ", ".join(parts) or "nothing"


def first_pass_line(spec: str, counts: dict, seq_len: int, share: str = "") -> tuple[bool, str]:
    """(whether anything was skipped, dropped or truncated; the line that says a source's first pass)."""
    rest = Counter(counts)
    records, samples, truncated = rest.pop("records", 0), rest.pop("samples", 0), rest.pop("truncated", 0)
    rest.pop("whole", None)
    cut = f", {truncated} truncated (to --seq_len {seq_len})" if truncated else ""
    lost = truncated or any(v and (k.startswith("skipped") or k == "dropped") for k, v in rest.items())
    return bool(lost), (
        f"data: first pass over {spec}{share}: {records} records -> {samples} samples; skipped: "
        f"{skip_summary(rest, seq_len)}{cut}"
    )


def mix64(*keys: int) -> int:
    """splitmix64 over the keys: a cheap, stateless, platform-independent random 64-bit integer."""
    h = 0x9E3779B97F4A7C15
    for k in keys:
        h = (h ^ (k & _M64)) + 0x9E3779B97F4A7C15 & _M64
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & _M64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _M64
        h ^= h >> 31
    return h


def held_out(doc, fraction: float) -> bool:  # noqa: ANN001 - a text or a chat
    """Whether `doc` belongs to the eval split of size `fraction`: a hash of its content alone, so the split is
    the same for every seed, rank count and restart, and duplicates of a document fall on the same side."""
    blob = doc if isinstance(doc, str) else json.dumps(doc, sort_keys=True, ensure_ascii=False)
    digest = hashlib.blake2b(blob.encode("utf-8", "surrogatepass"), digest_size=8, person=b"dstrain-eval")
    return int.from_bytes(digest.digest(), "little") < fraction * 2.0**64


def make_sample_encoder(fmt: str, tok, opts: DataOptions):  # noqa: ANN001, ANN201
    """The encoder of whole samples packed best-fit: chats (SFT) or preference pairs (DPO)."""
    if fmt == "preference":
        from .preference import PreferenceEncoder

        return PreferenceEncoder(tok, opts.think)
    return ChatEncoder(tok, opts.sft_turns, opts.think)


class SourceReader:
    """Documents of one source for one consumer, forever (or `epochs` passes), with a resumable position."""

    def __init__(
        self,
        src: Source,
        index: int,
        opts: DataOptions,
        consumer: int,
        n_consumers: int,
        seed: int,
        on_skip,
        state: dict | None = None,
        epochs: int | None = None,
        split: str = "train",
    ):
        self.src, self.index, self.opts, self.seed = src, index, opts, seed
        self.report, self.epochs = on_skip, epochs
        # With --eval_split, "train" readers drop the held-out documents and "eval" readers keep only them.
        self.split = split if opts.eval_split > 0 else None
        self.consumer, self.n_consumers = consumer, n_consumers
        self.normalize = Normalizer(src.fmt, opts)
        self.columns = needed_columns(src.fmt, src.columns, opts.text_field)
        shards = list(range(src.n_shards))
        if src.n_shards >= n_consumers:
            self.mine, self.stride, self.offset = shards[consumer::n_consumers], 1, 0
        else:
            self.mine, self.stride, self.offset = shards, n_consumers, consumer
        st = state or _START
        # A pass over this stream's share that gave no document (a source with fewer usable records than
        # streams): from then on the stream reads the whole source, rather than failing while other streams
        # have documents. Such small sources repeat across streams.
        self.whole = bool(st.get("whole"))
        if self.whole:
            self.mine, self.stride, self.offset = shards, 1, 0
        self.epoch, self.pos, self.row, self.sub = st["epoch"], st["pos"], st["row"], st["sub"]
        self.epoch_rows, self.epoch_docs = st["rows"], st["docs"]
        self.epoch_skips = Counter(st.get("skips", {}))  # this epoch's, to name them if nothing is left
        self.first: dict | None = st.get("first")  # epoch 0's records, documents and skips, once it ended
        self.read_error = ""
        self._gen = None
        self._datasets: dict = {}

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "pos": self.pos,
            "row": self.row,
            "sub": self.sub,
            "rows": self.epoch_rows,
            "docs": self.epoch_docs,
            "skips": dict(self.epoch_skips),
            "whole": self.whole,
            "first": self.first,
        }

    def order(self, epoch: int) -> list[int]:
        order = list(self.mine)
        if self.opts.shuffle:
            random.Random(mix64(self.seed, self.index, epoch)).shuffle(order)
        return order

    def next(self):
        """(document, origin) or None when a finite reader is done; origin = [source, shard, row, sub]."""
        if self._gen is None:
            self._gen = self._iterate()
        return next(self._gen, None)

    def _iterate(self):
        while self.epochs is None or self.epoch < self.epochs:
            order = self.order(self.epoch)
            while self.pos < len(order):
                yield from self._read(order[self.pos])
                self.pos, self.row, self.sub = self.pos + 1, 0, 0
            if self.epoch_docs == 0 and not self.read_error and self.n_consumers > 1 and not self.whole:
                self._whole()
                continue  # the same epoch again, over the whole source
            self._check_epoch()
            if self.epoch == 0:
                self.first = {
                    "records": self.epoch_rows,
                    "docs": self.epoch_docs,
                    "skips": dict(self.epoch_skips),
                }
            self.epoch, self.pos, self.epoch_rows, self.epoch_docs = self.epoch + 1, 0, 0, 0
            self.epoch_skips, self.read_error = Counter(), ""

    def _whole(self) -> None:
        self.whole, self.mine, self.stride, self.offset = True, list(range(self.src.n_shards)), 1, 0
        self.pos, self.row, self.sub, self.epoch_rows, self.epoch_docs = 0, 0, 0, 0, 0
        self.epoch_skips = Counter()

    def read_whole(self) -> None:
        """From now on read the whole source, starting this epoch again."""
        if not self.whole:
            self._whole()
            self._gen = None

    def on_skip(self, skip: Skip, origin) -> None:
        self.epoch_skips[skip.reason] += 1
        skip.source = self.index  # a record's skip, counted in this reader's epoch (not the packer's)
        self.report(skip, origin)

    def _check_epoch(self) -> None:
        """An epoch that gave nothing is an error (an infinite reader would spin on it forever)."""
        spec = self.src.spec
        if self.epoch_rows == 0 and self.read_error:
            raise DataError(f"data: no record of source {spec} could be read ({self.read_error})")
        if self.epoch_rows == 0:
            raise DataError(
                f"data: source {spec!r} has no records for data stream {self.consumer} of "
                f"{self.n_consumers}: it has fewer records than streams (lower --data_streams)"
            )
        if self.epoch_docs == 0 and self.split != "eval":  # a source may hold out nothing
            summary = skip_summary(self.epoch_skips, self.opts.seq_len)
            raise DataError(
                f"data: every record of source {spec} was skipped in a whole epoch (skipped: {summary})"
            )

    def _read(self, shard: int):
        src, start = self.src, self.row
        row = start
        try:
            for table in read_shard(src, shard, start, self.opts, self._datasets):
                cols = table_columns(table, self.columns)
                for k in range(table.num_rows):
                    r = row + k
                    if r % self.stride != self.offset:
                        continue
                    if self.sub == 0 or r != self.row:
                        self.epoch_rows += 1
                    try:
                        docs = self.normalize(
                            {c: v[k] for c, v in cols.items()}, lambda r=r: src.where(shard, r)
                        )
                    except Skip as e:
                        self.on_skip(e, [self.index, shard, r])
                        continue
                    first = self.sub if r == self.row else 0
                    for j in range(first, len(docs)):
                        self.row, self.sub = (r, j + 1) if j + 1 < len(docs) else (r + 1, 0)
                        if self.split and held_out(docs[j], self.opts.eval_split) != (self.split == "eval"):
                            self.on_skip(Skip("held_out", "not in this split"), None)
                            continue
                        self.epoch_docs += 1
                        yield docs[j], [self.index, shard, r, j]
                row += table.num_rows
        except ShardReadError as e:
            if self.opts.strict:
                raise DataError(f"data: {e}") from None
            self.read_error = str(e)
            self.on_skip(Skip("skipped_files", str(e)), None)


class DocStream:
    """Weighted mix of the source readers, then a shuffle buffer."""

    def __init__(
        self,
        readers: list[SourceReader],
        weights: list[float],
        seed: int,
        consumer: int,
        buffer_size: int,
        state: dict | None = None,
    ):
        self.readers, self.seed, self.consumer, self.buffer_size = readers, seed, consumer, buffer_size
        total = sum(weights)
        self.cum = [sum(weights[: i + 1]) / total for i in range(len(weights))]
        st = state or {"mix": 0, "shuffle": 0, "buffer": [], "size": buffer_size}
        self.mix_step, self.shuffle_step = st["mix"], st["shuffle"]
        self.buffer, self.buffer_size = [tuple(x) for x in st["buffer"]], st["size"]

    def state_dict(self) -> dict:
        return {
            "mix": self.mix_step,
            "shuffle": self.shuffle_step,
            "size": self.buffer_size,
            "buffer": [list(x) for x in self.buffer],
        }

    def _mixed(self):
        if len(self.readers) == 1:
            return self.readers[0].next()
        u = mix64(self.seed, self.consumer, 1, self.mix_step) / 2.0**64
        self.mix_step += 1
        i = next((i for i, c in enumerate(self.cum) if u < c), len(self.cum) - 1)
        doc = self.readers[i].next()
        # A finite reader (evaluation) that is done: the others may still have documents.
        return (
            doc if doc is not None else next((d for r in self.readers if (d := r.next()) is not None), None)
        )

    def next(self):
        if self.buffer_size == 0:
            return self._mixed()
        if len(self.buffer) < self.buffer_size:
            start = [r.epoch for r in self.readers]
            while len(self.buffer) < self.buffer_size:
                doc = self._mixed()
                if doc is None:
                    break
                self.buffer.append(doc)
                if all(r.epoch > e for r, e in zip(self.readers, start)):
                    # the buffer holds all the data already: more would only be copies of it
                    self.buffer_size = len(self.buffer)
        if not self.buffer:
            return None
        i = mix64(self.seed, self.consumer, 2, self.shuffle_step) % len(self.buffer)
        self.shuffle_step += 1
        out = self.buffer[i]
        new = self._mixed() if len(self.buffer) >= self.buffer_size else None
        if new is None:
            self.buffer.pop(i)
        else:
            self.buffer[i] = new
        return out

    def pull(self, n: int) -> list:
        out = []
        for _ in range(n):
            doc = self.next()
            if doc is None:
                break
            out.append(doc)
        return out


class Stream:
    """Batches (dicts of int64 arrays) for one consumer, with an exact, JSON-serialisable state."""

    def __init__(
        self,
        sources: list[Source],
        opts: DataOptions,
        tok,
        rows_per_batch: int,
        consumer: int = 0,
        n_consumers: int = 1,
        seed: int = 0,
        state: dict | None = None,
        epochs: int | None = None,
        split: str = "train",
    ):
        self.sources, self.opts, self.rows_per_batch = sources, opts, rows_per_batch
        self.consumer, self.n_consumers, self.seed = consumer, n_consumers, seed
        st = state or {}
        if st and (st.get("version") != STATE_VERSION or st.get("consumers") != [consumer, n_consumers]):
            raise DataError("data: loader state was saved for another --data_streams or version")
        self.stats: Counter = Counter(st.get("stats", {}))
        # Per source: what the packer made of the documents of its first pass (checked, kept, notes by reason)
        # and, once it has checked them all, the pass's summary (`first_pass_line`; the loader says it).
        self.packed = [Counter(c) for c in st.get("packed") or [{}] * len(sources)]
        self.first_pass: list[dict | None] = list(st.get("first_pass") or [None] * len(sources))
        readers_state = st.get("readers") or [None] * len(sources)
        self.readers = [
            SourceReader(
                src, i, opts, consumer, n_consumers, seed, self._on_skip, readers_state[i], epochs, split
            )
            for i, src in enumerate(sources)
        ]
        buffer = opts.shuffle_buffer if opts.shuffle and epochs is None else 0
        self.docs = DocStream(
            self.readers, [s.weight for s in sources], seed, consumer, buffer, st.get("docs")
        )
        _, self.pad_id = special_ids(tok)
        self.sft = sources[0].fmt != "text"
        if self.sft:
            encoder = make_sample_encoder(sources[0].fmt, tok, opts)
            self.packer = BestFitPacker(
                opts.seq_len,
                encoder,
                self._pull,
                self.stats,
                pack_buffer=opts.pack_buffer,
                packing=opts.packing,
                overlong=opts.overlong,
                on_skip=self._on_skip,
                seed=mix64(seed, consumer, 3),
                on_sample=self._on_sample,
            )
        else:
            encoder = PretrainEncoder(tok, opts.add_bos)
            self.packer = PretrainPacker(
                opts.seq_len, encoder, self._pull, self.stats, opts.packing, on_sample=self._on_sample
            )
        if st.get("packer"):
            self.packer.load_state_dict(st["packer"])
        self._progress = (self.stats["documents"], [r.epoch for r in self.readers])

    def where(self, origin) -> str:
        return "" if origin is None else self.sources[origin[0]].where(origin[1], origin[2])

    def _on_skip(self, skip: Skip, origin) -> None:
        if skip.reason == "held_out":  # by design, not a data problem
            self.stats[skip.reason] += 1
            return
        message = f"{skip}{' in ' + self.where(origin) if origin is not None else ''}"
        # a bad record; not an over-long sample, which --overlong decides about
        if self.opts.strict and skip.reason.startswith("skipped_") and skip.reason != "skipped_files":
            raise DataError(f"data: {message} (skipped without --strict)")
        self.stats[skip.reason] += 1
        if skip.source is None and origin is not None and self.first_pass[origin[0]] is None:
            self.packed[origin[0]][skip.reason] += 1  # the packer's note on a sample of the first pass
        # once per process (a worker's streams, or a tiny source that several streams read whole)
        source = skip.source if skip.source is not None else origin[0] if origin is not None else None
        said = (skip.reason, None if source is None else self.sources[source].spec)
        if said not in _WARNED:
            _WARNED.add(said)
            verb = {"dropped": "dropping", "truncated": "truncating"}.get(skip.reason, "skipping")
            hint = {"dropped": "--overlong truncate keeps them; "}.get(skip.reason, "")
            log.warning(
                "data: %s: %s (%sfurther ones are counted: a line per source at the end of its first pass)",
                verb,
                message,
                hint,
            )

    def _on_sample(self, origin, kept: bool) -> None:
        if origin is not None and self.first_pass[origin[0]] is None:
            self.packed[origin[0]].update(checked=1, kept=int(kept))
            self._close_first_pass(origin[0])

    def first_passes(self) -> list[dict | None]:
        """Per source, its first pass's summary (`first_pass_line`), or None while the pass goes on."""
        for i in range(len(self.readers)):
            self._close_first_pass(i)
        return self.first_pass

    def _close_first_pass(self, i: int) -> None:
        """Source `i`'s first pass summed up once its reader has ended the pass and the packer has checked as
        many of its samples as the pass gave (the shuffle buffer may swap a few for the next pass's copies)."""
        first = self.readers[i].first
        if self.first_pass[i] is not None or first is None or self.packed[i]["checked"] < first["docs"]:
            return
        notes = {k: v for k, v in self.packed[i].items() if k not in ("checked", "kept")}
        summary = Counter(first["skips"]) + Counter(notes)
        self.first_pass[i] = {"records": first["records"], "samples": self.packed[i]["kept"], **summary}
        if self.readers[i].whole:  # every record of the source, not this stream's share (the loader's sum)
            self.first_pass[i]["whole"] = 1

    def _pull(self, n: int) -> list:
        # Guard against spinning forever when every sample is rejected after tokenization. Samples the
        # packer holds are progress too: a data set smaller than its pool is accepted once, and its copies
        # wait (uncounted) until the pooled ones are placed in rows.
        self.first_passes()
        epochs = [r.epoch for r in self.readers]
        if self.stats["documents"] != self._progress[0] or (self.sft and self.packer.holds_samples()):
            self._progress = (self.stats["documents"], epochs)
        elif all(e >= e0 + 2 for e, e0 in zip(epochs, self._progress[1])):
            if all(r.whole for r in self.readers) or self.n_consumers == 1:
                raise DataError(self._nothing_usable())
            for r in self.readers:  # this stream's share is unusable (overlong, say): read everything
                r.read_whole()
            self._progress = (self.stats["documents"], [r.epoch for r in self.readers])
        return self.docs.pull(n)

    def _nothing_usable(self) -> str:
        """The error for data of which nothing is usable, with the exact skip counts of one more pass over
        (at most RECOUNT_DOCS of) this consumer's records: the running counters span several epochs."""
        counts: Counter = Counter()
        chunk: list = []
        seen = 0
        for i, (src, reader) in enumerate(zip(self.sources, self.readers)):
            again = SourceReader(
                src, i, self.opts, self.consumer, self.n_consumers, self.seed,
                lambda skip, origin: counts.update([skip.reason]), {"whole": reader.whole, **_START}, epochs=1,
                split=reader.split or "train",
            )  # fmt: skip
            while seen < RECOUNT_DOCS and (item := again.next()) is not None:
                chunk.append(item)
                seen += 1
                if len(chunk) == 256:
                    counts.update(self._rejections(chunk))
                    chunk = []
        counts.update(self._rejections(chunk))
        what = f"the first {RECOUNT_DOCS} records" if seen >= RECOUNT_DOCS else "a whole epoch"
        names = ", ".join(s.spec for s in self.sources)
        summary = skip_summary(counts, self.opts.seq_len)
        return f"data: no usable sample in {what} of {names} (skipped: {summary})"

    def _rejections(self, docs: list) -> Counter:
        # pretraining packs every document it reads
        return self.packer.rejections(docs) if self.sft else Counter()

    def rows(self, n: int) -> list:
        rows = self.packer.rows(n)
        for row in rows:
            real = sum(len(ids) for ids, _ in row)
            self.stats["rows"] += 1
            self.stats["tokens"] += real
            self.stats["padding"] += self.opts.seq_len - real
        return rows

    def next_batch(self) -> dict | None:
        rows = self.rows(self.rows_per_batch)
        if not rows:
            return None
        batch = assemble(rows, self.opts.seq_len, self.pad_id)
        self.stats["targets"] += int((batch["labels"] != IGNORE_INDEX).sum())
        return batch

    def skip_rows(self, n: int) -> None:
        """Advance by `n` rows exactly as producing them would (used to replay after a snapshot)."""
        while n > 0:
            batch_rows = self.rows(min(n, self.rows_per_batch))
            if not batch_rows:
                return
            batch = assemble(batch_rows, self.opts.seq_len, self.pad_id)
            self.stats["targets"] += int((batch["labels"] != IGNORE_INDEX).sum())
            n -= len(batch_rows)

    @property
    def epoch(self) -> int:
        return min(r.epoch for r in self.readers)

    def state_dict(self) -> dict:
        stats = dict(self.stats)
        return {
            "version": STATE_VERSION,
            "consumers": [self.consumer, self.n_consumers],
            "readers": [r.state_dict() for r in self.readers],
            "docs": self.docs.state_dict(),
            "packer": self.packer.state_dict(),
            "stats": stats,
            "packed": [dict(c) for c in self.packed],
            "first_pass": self.first_pass,
        }
