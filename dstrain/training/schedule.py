"""Learning-rate schedule: linear warmup, then cosine/linear/constant decay to min_lr at max_steps.

dstrain owns the schedule (DeepSpeed's WarmupCosineLR runs its first step at lr 0 and needs >= 2 warmup
steps); the optimizer comes from the DeepSpeed config and this LambdaLR is handed to deepspeed.initialize.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

# DeepSpeed scheduler names that a ds config's "scheduler.type" may use, and the dstrain shape each one means.
DS_SCHEDULER_TYPES = {"WarmupCosineLR": "cosine", "WarmupDecayLR": "linear", "WarmupLR": "constant"}


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int, schedule: str) -> float:
    """Learning rate of optimizer step `step` (1-based)."""
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, max_steps - warmup_steps)))
    if schedule == "linear":
        return lr - (lr - min_lr) * progress
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler_factory(
    *, lr: float, min_lr: float, warmup_steps: int, max_steps: int, schedule: str
) -> Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LambdaLR]:
    """A callable deepspeed.initialize accepts as lr_scheduler: optimizer -> LambdaLR. LambdaLR's counter is
    the number of steps already taken, so the factor it returns is that of step counter + 1."""

    def factor(done: int) -> float:
        kw = dict(lr=lr, min_lr=min_lr, warmup_steps=warmup_steps, max_steps=max_steps, schedule=schedule)
        return lr_at(done + 1, **kw) / lr

    def build(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    return build
