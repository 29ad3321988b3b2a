"""Scenarios that check the pool of ranks itself (tests/test_pool.py): a collective, a rank that raises while
the others wait in a collective, a scenario that outlives its timeout."""

from __future__ import annotations

import time

import torch


def rank_sum(info, value: int) -> int:  # noqa: ANN001
    """All-reduce of value + rank over the ranks."""
    from dstrain import dist

    return int(dist.all_reduce(torch.tensor(value + info.rank)))


def raises_on(info, rank: int, message: str) -> int:  # noqa: ANN001
    """Rank `rank` raises ValueError(message); the others wait for it in an all-reduce."""
    if info.rank == rank:
        raise ValueError(message)
    return rank_sum(info, 0)


def sleeps(info, seconds: float) -> float:  # noqa: ANN001
    time.sleep(seconds)
    return seconds
