"""Parallelism applied to the built single-device model, in a fixed order (see `parallelize`): tensor
parallel (tp.py), expert parallel (ep.py), then pipeline stages (pipe.py); gradnorm.py makes DeepSpeed clip
with the true global norm. Submodules that need DeepSpeed import it themselves."""

from .dims import Groups, ParallelDims, build_groups

__all__ = ["Groups", "ParallelDims", "build_groups"]
