"""Scenarios that check the pool of ranks itself (tests/test_pool.py): a collective, a rank that raises while
the others wait in a collective, a scenario that outlives its timeout, an engine left for the reset."""

from __future__ import annotations

import os
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


def engine_with_a_group(info) -> int:  # noqa: ANN001
    """A ZeRO-3 DeepSpeed engine holding a process group of its own (as a layout's do), left for the pool's reset
    to end -> this rank's thread count before it was built (gloo keeps threads for each group while it lives)."""
    import deepspeed
    import torch.distributed as tdist

    threads = len(os.listdir("/proc/self/task"))
    model = torch.nn.Linear(4, 4)
    config = {"train_batch_size": info.world_size, "zero_optimization": {"stage": 3}}
    optimizer = torch.optim.AdamW(model.parameters())
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    engine.probe_group = tdist.new_group(list(range(info.world_size)))
    return threads
