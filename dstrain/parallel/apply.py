"""`parallelize`: the single-device model -> what deepspeed.initialize gets, in a fixed order."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import torch
from torch import nn

from dstrain.model import DeepSeekLM
from dstrain.model.build import materialize

from .dims import Groups, ParallelDims
from .ep import apply_expert_parallel, create_deepspeed_expert_groups
from .pipe import Objective, build_pipeline
from .tp import apply_tensor_parallel


def parallelize(
    model: DeepSeekLM,
    dims: ParallelDims,
    g: Groups,
    *,
    partition: str = "parameters",
    seed: int = 0,
    objective: Objective | None = None,
    device: str | torch.device = "cpu",
    quiet: bool = True,
) -> tuple[nn.Module, Any]:
    """Tensor parallel, then expert parallel (both swap modules in place), then pipeline stages.
    `model` may be on the meta device: only what this rank keeps then gets memory (uninitialised, for the
    caller to fill), so no rank ever holds the whole model.
    `objective` (pipelining only): the last stage's loss from the model output and the step's target counts.
    -> (module, mpu): the module for deepspeed.initialize, and the grid DeepSpeed reads the data-parallel
    and model-parallel groups from (the PipelineModule's own under pipelining)."""
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

    apply_tensor_parallel(model, g)
    apply_expert_parallel(model, g)
    # DeepSpeed prints its topology and stage table on rank 0; dstrain reports the layout itself.
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        if dims.pp > 1:
            assert objective is not None, "a pipeline computes its loss on the last stage"
            module: nn.Module = build_pipeline(model, dims, partition, seed, objective, device)
            mpu = module.mpu()
        else:
            module = model
            materialize(module, device)
            mpu = PipelineParallelGrid(
                topology=PipeModelDataParallelTopology(num_pp=1, num_mp=dims.tp, num_dp=dims.dp)
            )
    if dims.ep > 1:
        create_deepspeed_expert_groups(g, mpu)
    return module, mpu
