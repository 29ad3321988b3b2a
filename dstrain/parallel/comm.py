"""Differentiable collectives. A group of None means "this dimension has size 1": every function is then the
identity (never torch.distributed's default group)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist


class _CopyToGroup(torch.autograd.Function):
    """Forward identity, backward all-reduce: a replicated tensor entering rank-local (sharded) work."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        grad = grad.contiguous()
        tdist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Forward all-reduce (sum of rank-local partial results), backward identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:  # noqa: ANN001
        x = x.contiguous().clone()
        tdist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return grad, None


class _SyncGradTail(torch.autograd.Function):
    """Forward identity; backward all-reduces only the last `n` features of the gradient (MLA's rotary key,
    shared by every head, is used by each rank's heads only)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int, group: Any) -> torch.Tensor:  # noqa: ANN001
        ctx.n, ctx.group = n, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        head, tail = grad.split([grad.shape[-1] - ctx.n, ctx.n], dim=-1)
        tail = tail.contiguous()
        tdist.all_reduce(tail, group=ctx.group)
        return torch.cat([head, tail], dim=-1), None, None


@torch.no_grad()
def reduce_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """A copy of `x` summed over the group (no gradient)."""
    out = x.contiguous().clone()
    tdist.all_reduce(out, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows of `x` split by `send` counts go to each rank of the group; returns the rows received, ordered by
    source rank. Backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:  # noqa: ANN001
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        tdist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        tdist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def copy_to_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if group is None else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if group is None else _ReduceFromGroup.apply(x, group)


def sync_grad_tail(x: torch.Tensor, n: int, group: Any) -> torch.Tensor:
    return x if group is None else _SyncGradTail.apply(x, n, group)


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    return x if group is None else _AllToAll.apply(x, send, recv, group)


def exchange_counts(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """counts (G, n) int64, row j for rank j of the group -> (G, n): row j as rank j sent it to this rank."""
    if group is None:
        return counts
    out = torch.empty_like(counts)
    tdist.all_to_all_single(out, counts.contiguous(), group=group)
    return out
