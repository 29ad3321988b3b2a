"""The true global gradient norm in every layout, computed inside DeepSpeed's ZeRO-1/2 optimizer.

DeepSpeed's own norm is wrong in three layouts (measured): pipeline + ZeRO-0 uses one stage's norm, expert
groups are averaged instead of summed across expert-parallel ranks, and tensor parallel + expert parallel
double counts. dstrain replaces the optimizer's `scaled_global_norm` (the one value it clips with and reports)
by a sum of squares over this rank's gradient partition, each parameter counted once in the whole world:
ZeRO partitions are disjoint within a data-parallel (or expert-data-parallel) group, pipeline stages hold
disjoint layers, tensor-sharded and expert-sharded parameters are disjoint slices, and a parameter replicated
across the tensor-parallel ranks is counted on tensor-parallel rank 0 only. One all-reduce over the world.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist

from .dims import Groups


def counted_here(param: torch.Tensor, g: Groups) -> bool:
    return g.tp_rank == 0 or hasattr(param, "tp_shard")


# Elements per block of a gradient reduced in fp32: fp32 sums over whole million-element tensors are 1e-4 off
# (a CPU's vectorized reduction adds each lane's elements in sequence), blocks of 2048 ~1e-7.
NORM_BLOCK = 2048


def sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """Σ‖g‖² in float64 without a float64 (or fp32) copy of any gradient: each tensor read once in its own dtype,
    blocks of NORM_BLOCK elements accumulated in fp32, only the per-block norms combined in float64."""
    parts = []
    for grad in grads:
        flat = grad.detach().reshape(-1)
        whole = flat.numel() - flat.numel() % NORM_BLOCK
        if whole:
            blocks = flat[:whole].view(-1, NORM_BLOCK)
            parts.append(torch.linalg.vector_norm(blocks, dim=1, dtype=torch.float32))
        if whole < flat.numel():
            parts.append(torch.linalg.vector_norm(flat[whole:], dtype=torch.float32).reshape(1))
    if not parts:
        return torch.zeros((), dtype=torch.float64)
    return torch.cat([p.to(parts[0].device) for p in parts]).double().square().sum()


def local_sum_of_squares(optimizer: Any, g: Groups) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64, device=optimizer.device)
    for i in range(len(optimizer.bit16_groups)):
        grads = (
            optimizer.averaged_gradients.get(i) if isinstance(optimizer.averaged_gradients, dict) else None
        )
        if grads is None:
            continue
        # DeepSpeed pads partitions with zero tensors that belong to no parameter: marked, except the last
        # partition's tail padding without round-robin padding (0.19.8's _get_flat_partition_unpadded; seen
        # with DeepSeek-V4's small mHC vectors ending a group), which can only come after the parameters.
        grads = [x for x in grads if not getattr(x, "_zero_padding", False)]
        params = optimizer.params_in_partition[i]
        assert len(grads) in (len(params), len(params) + 1), (len(grads), len(params))
        counted = [grad for grad, param in zip(grads, params, strict=False) if counted_here(param, g)]
        total += sum_of_squares(counted).to(total.device)
    return total


def install_global_grad_norm(engine: Any, g: Groups) -> None:
    """Make the ZeRO-1/2 optimizer clip with (and report) the true global norm."""
    opt = engine.optimizer
    if not hasattr(opt, "scaled_global_norm") or not hasattr(opt, "averaged_gradients"):
        raise RuntimeError(f"{type(opt).__name__}: dstrain's global grad norm needs the ZeRO-1/2 optimizer")
    if getattr(opt, "cpu_offload", False):
        raise RuntimeError("offload_optimizer: not supported with pipeline/tensor/expert parallelism")

    def scaled_global_norm(norm_type: int = 2) -> torch.Tensor:
        assert norm_type == 2
        total = local_sum_of_squares(opt, g)
        tdist.all_reduce(total)
        norm = total.sqrt().float()
        # DeepSpeed's convention: an invalid norm is reported as -1, which its step treats as overflow.
        return torch.where(torch.isfinite(norm), norm, torch.full_like(norm, -1.0))

    opt.scaled_global_norm = scaled_global_norm
