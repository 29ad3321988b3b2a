"""`dstrain data stats`: counts, row fill and tokenize+pack throughput against the raw tokenizer.

Throughput is measured A/B interleaved in one process (raw, ours, ours, raw, ... : ABBA), on the same
documents held in memory (repeated up to 200k tokens per run for small data sets), and the median of each
side is reported:
- raw (A): plain batched `tokenizer(texts)` over the documents (for chats: the already-rendered chat texts),
  1000 texts per call;
- ours (B): dstrain's encoder + packer + batch assembly over the same documents (for chats this includes
  rendering, label masks and best-fit packing), counted in real tokens placed in rows.
`fill` is the steady-state fill of the infinite training loader (real tokens / row capacity over the rows of
one epoch, at least 100 rows); `fill_one_pass` is a single finite pass whose last rows are flushed partly
empty; `naive_fill` is one sample per row padded to seq_len.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter

from dstrain.batch import IGNORE_INDEX
from dstrain.errors import DataError

from .formats import Skip
from .options import DataOptions
from .packing import BestFitPacker, PretrainPacker, assemble
from .pipeline import SourceReader, Stream, make_sample_encoder, skip_summary
from .sources import resolve_sources
from .tokenizer import PretrainEncoder, special_ids

RAW_BATCH = 1000
STEADY_ROWS = 100
MIN_TIMED_TOKENS = 200_000


def read_docs(
    opts: DataOptions, max_docs: int | None, on_skip=None, objective: str | None = None
) -> tuple[list, list, Counter]:
    """(sources, [(doc, origin)], skip counts) of one pass over every source in order, at most `max_docs`
    documents. `on_skip(skip, where)` may raise to turn a skip into an error; `objective`: read as a run of
    that --objective would (sources.resolve_sources)."""
    sources = resolve_sources(opts, objective)
    counts: Counter = Counter()

    def count(skip: Skip, origin) -> None:
        where = "" if origin is None else sources[origin[0]].where(origin[1], origin[2])
        if opts.strict and skip.reason != "skipped_files":
            raise DataError(f"data: {skip} in {where}")
        if on_skip is not None:
            on_skip(skip, where)
        counts[skip.reason] += 1

    docs: list = []
    for i, src in enumerate(sources):
        reader = SourceReader(src, i, opts, 0, 1, 0, count, epochs=1)
        while max_docs is None or len(docs) < max_docs:
            item = reader.next()
            if item is None:
                break
            docs.append(item)
    return sources, docs, counts


def no_usable_sample(opts: DataOptions, max_docs: int | None, n_docs: int, skipped) -> DataError:
    """The one-line error for data of which nothing can be trained on, naming the reasons."""
    what = (
        f"the first {max_docs} documents" if max_docs is not None and n_docs >= max_docs else "a whole epoch"
    )
    summary = skip_summary(skipped, opts.seq_len)
    return DataError(f"data: no usable sample in {what} of {opts.data} (skipped: {summary})")


def make_encoder(opts: DataOptions, tok, fmt: str):
    return make_sample_encoder(fmt, tok, opts) if fmt != "text" else PretrainEncoder(tok, opts.add_bos)


def pack_all(opts: DataOptions, tok, docs: list, encoder, rows_per_batch: int = 8) -> Counter:
    """One finite pass: encode + pack + assemble every document; returns the counters."""
    stats: Counter = Counter()
    it = iter(docs)

    def pull(n: int) -> list:
        return [d for _, d in zip(range(n), it)]

    if not isinstance(encoder, PretrainEncoder):
        packer = BestFitPacker(
            opts.seq_len,
            encoder,
            pull,
            stats,
            pack_buffer=opts.pack_buffer,
            packing=opts.packing,
            overlong=opts.overlong,
            on_skip=lambda skip, origin: stats.update([skip.reason]),
            seed=0,
        )
    else:
        packer = PretrainPacker(opts.seq_len, encoder, pull, stats, opts.packing)
    _, pad = special_ids(tok)
    while True:
        rows = packer.rows(rows_per_batch)
        if not rows:
            return stats
        batch = assemble(rows, opts.seq_len, pad)
        stats["rows"] += len(rows)
        stats["tokens"] += sum(len(ids) for row in rows for ids, _ in row)
        stats["targets"] += int((batch["labels"] != IGNORE_INDEX).sum())


def raw_texts(opts: DataOptions, tok, docs: list, fmt: str) -> list[str]:
    if fmt == "text":
        return [d for d, _ in docs]
    encoder, texts = make_sample_encoder(fmt, tok, opts), []
    for doc, _ in docs:
        try:
            texts.append(encoder.render(doc))
        except Exception:  # a chat the template cannot render: ours skips it too
            continue
    return texts


def raw_tokenize(tok, texts: list[str]) -> int:
    n = 0
    for i in range(0, len(texts), RAW_BATCH):
        n += sum(len(x) for x in tok(texts[i : i + RAW_BATCH], add_special_tokens=False)["input_ids"])
    return n


def steady_fill(opts: DataOptions, tok, sources: list, tokens: int) -> float:
    """Fill of the infinite training loader over as many rows as one epoch of `tokens` needs (at least
    STEADY_ROWS, so that small data sets are measured over several epochs)."""
    stream = Stream(sources, opts, tok, 8, 0, 1, 0)
    want = max(STEADY_ROWS, math.ceil(tokens / opts.seq_len))
    rows = real = 0
    while rows < want:
        got = stream.rows(min(8, want - rows))
        if not got:  # cannot happen for an infinite stream; never spin on it
            break
        rows += len(got)
        real += sum(len(ids) for row in got for ids, _ in row)
    return real / max(1, rows * opts.seq_len)


def naive_fill(opts: DataOptions, tok, docs: list, fmt: str) -> float:
    """One sample per row, padded to seq_len (pretraining: each document alone, split over whole rows)."""
    if fmt != "text":
        lengths = [
            len(e.ids)
            for e in make_sample_encoder(fmt, tok, opts).encode([d for d, _ in docs])
            if not isinstance(e, Skip)
        ]
        kept = [min(n, opts.seq_len) for n in lengths if n <= opts.seq_len or opts.overlong == "truncate"]
        return sum(kept) / max(1, len(kept) * opts.seq_len)
    lengths = [len(ids) for ids in PretrainEncoder(tok, opts.add_bos).encode([d for d, _ in docs])]
    return sum(lengths) / max(1, sum(math.ceil(n / opts.seq_len) for n in lengths) * opts.seq_len)


def run_stats(
    opts: DataOptions, tok, max_docs: int | None = None, rounds: int = 3, objective: str | None = None
) -> dict:
    t0 = time.perf_counter()
    sources, docs, skipped = read_docs(opts, max_docs, objective=objective)
    read_s = time.perf_counter() - t0
    fmt = sources[0].fmt
    encoder = make_encoder(opts, tok, fmt) if docs else None  # built once, as each loader stream does
    result = pack_all(opts, tok, docs, encoder) if docs else Counter()  # also warms caches, cross-checks
    if not result["documents"]:  # nothing to time (and timing nothing would never end)
        raise no_usable_sample(opts, max_docs, len(docs), skipped + result)
    texts = raw_texts(opts, tok, docs, fmt)
    # small data sets are repeated (as distinct documents) so that every timed run is long enough to time
    reps = max(1, math.ceil(MIN_TIMED_TOKENS / max(1, result["tokens"])))
    timed_docs = [(d, [*origin, r]) for r in range(reps) for d, origin in docs]
    ours_rates, raw_rates = [], []
    for r in range(2 * rounds):
        for side in "AB" if r % 2 == 0 else "BA":
            t = time.perf_counter()
            if side == "A":
                n = sum(raw_tokenize(tok, texts) for _ in range(reps))
                raw_rates.append(n / (time.perf_counter() - t))
            else:
                n = pack_all(opts, tok, timed_docs, encoder)["tokens"]
                ours_rates.append(n / (time.perf_counter() - t))
    ours, raw = statistics.median(ours_rates), statistics.median(raw_rates)
    stream = Stream(sources, opts, tok, 8, 0, 1, 0, epochs=1)
    t = time.perf_counter()
    while stream.next_batch() is not None:
        pass
    loader_rate = stream.stats["tokens"] / (time.perf_counter() - t)
    skipped.update({k: v for k, v in result.items() if k.startswith("skipped")})
    return {
        "data": opts.data,
        "format": sources[0].fmt,
        "seq_len": opts.seq_len,
        "documents": int(result["documents"]),
        "tokens": int(result["tokens"]),
        "targets": int(result["targets"]),
        "rows": int(result["rows"]),
        "fill": round(steady_fill(opts, tok, sources, result["tokens"]), 5),
        "fill_one_pass": round(result["tokens"] / max(1, result["rows"] * opts.seq_len), 5),
        "naive_fill": round(naive_fill(opts, tok, docs, fmt), 5),
        "dropped": int(result["dropped"]),
        "truncated": int(result["truncated"]),
        "skipped": dict(sorted(skipped.items())),
        "tokens_per_s": round(ours),
        "raw_tokens_per_s": round(raw),
        "speed_vs_raw": round(ours / raw, 3),
        "loader_tokens_per_s": round(loader_rate),
        "read_s": round(read_s, 3),
        "ab_runs": 2 * rounds,
        "timed_tokens_per_run": int(result["tokens"]) * reps,
    }
