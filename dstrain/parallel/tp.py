"""Megatron-style tensor parallelism, applied to a built single-device model by swapping its linears.

Attention: q_b_proj (or q_proj) and kv_b_proj keep the rows of this rank's heads (the model reads heads off
the projections by reshape, so fewer rows mean fewer local heads); o_proj keeps the matching input columns and
its output is all-reduced. q_a_proj, kv_a_proj_with_mqa and the norms stay replicated. The gradient reaching
them must be the sum over every head, so it is all-reduced where replicated tensors enter head-local work: the
inputs of q_b/kv_b, and the shared rotary key k_rope, which leaves kv_a_proj_with_mqa beside the latent and is
used by every head (DeepSpeed's AutoTP misses this one and trains with wrong gradients).
MLPs (dense layers and shared experts): gate/up keep rows, down keeps columns, output all-reduced. Routed
experts and the router stay replicated (shard them with expert parallelism).

Sharded parameters carry `tp_shard = (dim, rank, size)`: how checkpoints reassemble them and how the global
grad norm counts them (replicated parameters are counted once, sharded ones on every rank).
"""

from __future__ import annotations

import torch
from torch import nn

from dstrain.model.kernels import Linear, linear
from dstrain.model.model import MLA, MLP

from .comm import copy_to_group, reduce_from_group, sync_grad_tail
from .dims import Groups


class ColumnParallelLinear(Linear):
    """Output features split across ranks; the replicated input's gradient is summed over them."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(copy_to_group(x, self.tp_group), self.weight, self.bias)


class RowParallelLinear(Linear):
    """Input features split across ranks; partial outputs summed (bias added once, after the sum)."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_from_group(linear(x, self.weight), self.tp_group)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class RopeKeySyncLinear(Linear):
    """kv_a_proj_with_mqa: replicated, but the gradient of its last `rope_dim` outputs (k_rope) is summed over
    the tensor-parallel ranks, each of which used it for its own heads only."""

    tp_group = None
    rope_dim = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sync_grad_tail(linear(x, self.weight, self.bias), self.rope_dim, self.tp_group)


def _swap(old: nn.Linear, cls: type, dim: int | None, g: Groups) -> Linear:
    """A `cls` holding this rank's slice of `old` along weight dim `dim` (None: the whole weight)."""
    size, rank = g.dims.tp, g.tp_rank
    w = old.weight.detach()
    bias = old.bias.detach() if old.bias is not None else None
    if dim is not None:
        w = w.chunk(size, dim=dim)[rank]
        if bias is not None and dim == 0:
            bias = bias.chunk(size)[rank]
    new = cls(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
    new.weight = nn.Parameter(w.clone(), requires_grad=old.weight.requires_grad)
    if bias is not None:
        new.bias = nn.Parameter(bias.clone(), requires_grad=old.bias.requires_grad)
    new.tp_group = g.tp
    if dim is not None:
        new.weight.tp_shard = (dim, rank, size)
        new.weight.tensor_model_parallel = True  # DeepSpeed's marker, for its own bookkeeping
        if bias is not None and dim == 0:
            new.bias.tp_shard = (0, rank, size)
            new.bias.tensor_model_parallel = True
    return new


def apply_tensor_parallel(model: nn.Module, g: Groups) -> None:
    if g.dims.tp == 1:
        return
    for module in list(model.modules()):
        if isinstance(module, MLA):
            cfg = module.cfg
            if cfg.q_lora_rank is None:
                module.q_proj = _swap(module.q_proj, ColumnParallelLinear, 0, g)
            else:
                module.q_b_proj = _swap(module.q_b_proj, ColumnParallelLinear, 0, g)
            module.kv_b_proj = _swap(module.kv_b_proj, ColumnParallelLinear, 0, g)
            module.o_proj = _swap(module.o_proj, RowParallelLinear, 1, g)
            kv_a = _swap(module.kv_a_proj_with_mqa, RopeKeySyncLinear, None, g)
            kv_a.rope_dim = cfg.qk_rope_head_dim
            module.kv_a_proj_with_mqa = kv_a
        elif isinstance(module, MLP):
            module.gate_proj = _swap(module.gate_proj, ColumnParallelLinear, 0, g)
            module.up_proj = _swap(module.up_proj, ColumnParallelLinear, 0, g)
            module.down_proj = _swap(module.down_proj, RowParallelLinear, 1, g)
