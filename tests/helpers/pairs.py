"""Preference batches for the DPO tests, shaped as dstrain/data/preference.py packs them: each row holds whole
pairs, chosen then rejected, every document a masked prompt and a completion of targets. The preference is
learnable: the chosen completion repeats its prompt, the rejected one is random."""

from __future__ import annotations

import torch

from tests.helpers.tiny import VOCAB
from tests.helpers.trainer import SEQ, GlobalRows, stack

PROMPT, COMPLETION = 4, 4  # tokens per document: SEQ // 8 pairs' worth, two pairs per row of 32


def pair_row(index: int, seq: int = SEQ) -> dict[str, torch.Tensor]:
    """Row `index`: seq // (2 * (PROMPT + COMPLETION)) pairs, each pair's chosen and rejected adjacent."""
    g = torch.Generator().manual_seed(20_000 + index)
    ids, labels, pos = [], [], []
    doc = PROMPT + COMPLETION
    for _ in range(seq // (2 * doc)):
        prompt = torch.randint(2, VOCAB, (PROMPT,), generator=g)
        chosen = prompt[:COMPLETION]
        rejected = torch.randint(2, VOCAB, (COMPLETION,), generator=g)
        for completion in (chosen, rejected):
            ids.append(torch.cat([prompt, completion]))
            labels.append(torch.cat([torch.full((PROMPT,), -100), completion]))
            pos.append(torch.arange(doc))
    return {"input_ids": torch.cat(ids), "labels": torch.cat(labels), "position_ids": torch.cat(pos)}


def pair_eval_rows(n: int = 5) -> dict[str, torch.Tensor]:
    """A global eval set of `n` pair rows apart from the training rows (5: a padding row in the last micro
    batch of 2)."""
    return stack([pair_row(10_000 + i) for i in range(n)])


class PairRows(GlobalRows):
    """Loader of micro batches of pair rows: step s's global batch is rows [s*G, (s+1)*G), G =
    micro*GA*world, as GlobalRows."""

    def __init__(self, micro: int, ga: int, rank: int, world: int, cycle: int = 0) -> None:
        """`cycle` > 0: a data set of that many rows, repeated (epochs)."""
        super().__init__(micro, ga, rank, world)
        self.cycle = cycle

    def row(self, index: int) -> dict[str, torch.Tensor]:
        return pair_row(index % self.cycle if self.cycle else index)
