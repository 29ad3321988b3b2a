"""`dstrain data audit`: show what is trained on.

Prints the first `--n` samples as the model sees them (rendered chat template, special tokens included)
with the trained tokens marked (green when stdout is a terminal, else between `[[` and `]]`; a preference pair
shows its chosen and rejected documents, the completion tokens that make each log-probability marked), then label-mask
statistics over up to `--max_docs` samples. A chat without an assistant turn, a chat the template cannot
render, and a sample with no trained token are errors here (training skips them with a count).
"""

from __future__ import annotations

import sys
from collections import Counter

import numpy as np

from dstrain.batch import IGNORE_INDEX
from dstrain.errors import DataError

from .bench import no_usable_sample, read_docs
from .formats import Skip
from .options import DataOptions
from .pipeline import make_sample_encoder
from .tokenizer import PretrainEncoder

FATAL = {"skipped_no_assistant"}
NOTES = {"chosen": " (preference pairs read for SFT: the prompt and the chosen completion)"}
CHUNK = 256


def marked(text: str, offsets: list, labels: np.ndarray, color: bool) -> str:
    """`text` with the characters of trained tokens wrapped in markers."""
    trained = np.zeros(len(text) + 1, dtype=bool)
    for (start, end), label in zip(offsets, labels):
        if label != IGNORE_INDEX:
            trained[start:end] = True
    on, off = ("\x1b[1;32m", "\x1b[0m") if color else ("[[", "]]")
    out, inside = [], False
    for i, ch in enumerate(text):
        if trained[i] != inside:
            out.append(on if trained[i] else off)
            inside = bool(trained[i])
        out.append(ch)
    if inside:
        out.append(off)
    return "".join(out)


def run_audit(
    opts: DataOptions,
    tok,
    n: int = 3,
    max_docs: int = 1000,
    color: bool | None = None,
    out=None,
    objective: str | None = None,
) -> dict:
    out = out or sys.stdout
    color = out.isatty() if color is None else color

    def fatal(skip: Skip, where: str) -> None:
        if skip.reason in FATAL:
            raise DataError(f"data: {skip} in {where}")

    sources, docs, skipped = read_docs(opts, max_docs, fatal, objective)
    if not docs:
        raise no_usable_sample(opts, max_docs, 0, skipped)
    sft = sources[0].fmt != "text"
    stats: Counter = Counter(samples=len(docs))
    lengths = []
    legend = "green" if color else "[[between double brackets]]"
    print(
        f"# {opts.data}: format {sources[0].fmt}{NOTES.get(sources[0].fmt, '')}, seq_len {opts.seq_len}; "
        f"trained tokens are {legend}",
        file=out,
    )
    if sft:
        encoder = make_sample_encoder(sources[0].fmt, tok, opts)
        for lo in range(0, len(docs), CHUNK):
            chunk = docs[lo : lo + CHUNK]
            for k, ((chat, origin), enc) in enumerate(
                zip(chunk, encoder.encode([d for d, _ in chunk], keep_text=True))
            ):
                where = sources[origin[0]].where(origin[1], origin[2])
                if isinstance(enc, Skip):
                    raise DataError(f"data: {enc} in {where}")
                targets = enc.n_targets()
                if targets == 0:
                    raise DataError(
                        f"data: sample has no trained token (empty assistant replies?) in {where}"
                    )
                lengths.append(len(enc.ids))
                stats["tokens"] += len(enc.ids)
                stats["targets"] += targets
                turns = chat["chosen"] + chat["rejected"] if isinstance(chat, dict) else chat
                stats["assistant_turns"] += sum(m["role"] == "assistant" for m in turns)
                if len(enc.ids) > opts.seq_len:
                    stats["over_seq_len"] += 1
                    if not enc.truncated(opts.seq_len).targets:
                        stats["no_target_after_truncation"] += 1
                if lo + k < n:
                    print(
                        f"\n## sample {lo + k + 1}: {where}: {len(enc.ids)} tokens, {targets} trained",
                        file=out,
                    )
                    sides = (
                        (("chosen", enc.chosen), ("rejected", enc.rejected)) if isinstance(chat, dict) else ()
                    )
                    for name, side in sides:  # a preference pair: both documents, their completions marked
                        print(
                            f"### {name}: {len(side.ids)} tokens, {side.n_targets()} in the log-probability",
                            file=out,
                        )
                        print(marked(side.text, side.offsets, side.labels, color), file=out)
                    if not sides:
                        print(marked(enc.text, enc.offsets, enc.labels, color), file=out)
    else:
        encoder = PretrainEncoder(tok, opts.add_bos)
        for lo in range(0, len(docs), CHUNK):
            chunk = docs[lo : lo + CHUNK]
            for k, ((_, origin), ids) in enumerate(zip(chunk, encoder.encode([d for d, _ in chunk]))):
                lengths.append(len(ids))
                stats["tokens"] += len(ids)
                stats["targets"] += len(ids) - 1
                if lo + k < n:
                    where = sources[origin[0]].where(origin[1], origin[2])
                    print(
                        f"\n## document {lo + k + 1}: {where}: {len(ids)} tokens (EOS appended; all but the first token are targets)",
                        file=out,
                    )
                    print(tok.decode(ids.tolist()), file=out)
    stats.update(skipped)
    summary = {
        **{k: int(v) for k, v in stats.items()},
        "trained_fraction": round(stats["targets"] / max(1, stats["tokens"]), 4),
        "mean_tokens": round(float(np.mean(lengths)), 1),
        "max_tokens": int(max(lengths)),
    }
    print(f"\n# label mask statistics over {len(docs)} samples", file=out)
    for key, value in summary.items():
        print(f"{key}: {value}", file=out)
    if sft and stats["over_seq_len"]:
        print(
            f"note: {stats['over_seq_len']} samples exceed seq_len {opts.seq_len}; training will {opts.overlong} them",
            file=out,
        )
    return summary
