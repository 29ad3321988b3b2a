"""The evaluation set: rows packed from --eval_data, or from the documents --eval_split holds out of --data.

Every rank builds the same rows, in the same order (one reader over the whole eval data, one pass, no shuffle,
fixed seed), and evaluates its share of them: the set, and so the eval loss, does not depend on the rank
count, the layout, the run's seed or a restart. Rows are packed like training rows (same format, chat
template, masks and packing), so eval loss and training loss measure the same thing.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from dstrain.errors import DataError

from .options import DataOptions
from .pipeline import Stream
from .sources import resolve_sources

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def build_eval_rows(
    opts: DataOptions, tokenizer: PreTrainedTokenizerBase, objective: str | None = None
) -> dict[str, torch.Tensor] | None:
    """(N, seq_len) LongTensors `input_ids`, `labels`, `position_ids` of the whole eval set (the first rows
    holding --eval_tokens tokens), or None when the options define no eval set. `objective`: as
    `build_loader`'s."""
    if not opts.evaluates:
        return None
    fixed = dict(shuffle=False, num_workers=0)
    if opts.eval_data:
        what = f"--eval_data {opts.eval_data}"
        read = dataclasses.replace(opts, data=opts.eval_data, eval_data=None, **fixed)
    else:
        what = f"--eval_split {opts.eval_split} of --data {opts.data}"
        read = dataclasses.replace(opts, **fixed)
    stream = Stream(resolve_sources(read, objective), read, tokenizer, 1, epochs=1, split="eval")
    rows: list[dict[str, np.ndarray]] = []
    while not opts.eval_tokens or stream.stats["tokens"] < opts.eval_tokens:
        batch = stream.next_batch()
        if batch is None:
            break
        rows.append(batch)
    if not rows or stream.stats["targets"] == 0:
        raise DataError(f"eval: {what} gives no row with a target (stats: {dict(stream.stats)})")
    return {k: torch.from_numpy(np.concatenate([r[k] for r in rows])) for k in rows[0]}
