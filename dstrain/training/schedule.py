"""Learning-rate schedule: linear warmup, then cosine/linear/constant decay to min_lr at max_steps.

dstrain owns the schedule (DeepSpeed's WarmupCosineLR runs its first step at lr 0 and needs >= 2 warmup
steps); the optimizer comes from the DeepSpeed config and this LambdaLR is handed to deepspeed.initialize.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dstrain.config.options import ScheduleOptions


def lr_at(step: int, s: ScheduleOptions) -> float:
    """Learning rate of optimizer step `step` (1-based)."""
    if s.warmup_steps > 0 and step <= s.warmup_steps:
        return s.lr * step / s.warmup_steps
    if s.lr_schedule == "constant":
        return s.lr
    progress = min(1.0, max(0.0, (step - s.warmup_steps) / max(1, s.max_steps - s.warmup_steps)))
    if s.lr_schedule == "linear":
        return s.lr - (s.lr - s.min_lr) * progress
    return s.min_lr + (s.lr - s.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler_factory(
    s: ScheduleOptions,
) -> Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LambdaLR]:
    """A callable deepspeed.initialize accepts as lr_scheduler: optimizer -> LambdaLR. LambdaLR's counter is
    the number of steps already taken, so the factor it returns is that of step counter + 1."""

    def factor(done: int) -> float:
        return lr_at(done + 1, s) / s.lr

    def build(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    return build
