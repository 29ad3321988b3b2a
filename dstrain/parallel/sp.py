"""Sequence parallelism (Ulysses) for MLA: `sp` consecutive data-parallel ranks share one data rank's rows,
each holding a contiguous seq_len / sp slice of every row (`dstrain.batch.sequence_shard`, with a halo of the
tokens that its last positions' LM and MTP targets need).

Everything but attention is token-wise and runs on the local slice. Sparse attention's indexer needs every key
of a row: its q, k and weights are gathered to whole rows, every rank of the group selects the same keys, and
the KL's target sums the attention probabilities over the group's heads. In each MLA layer q, k and v are built
locally (up-projections, RoPE at the tokens' own positions, the shared rotary key expanded to every head),
then one all-to-all per tensor trades the sequence split for a head split: every rank attends over the
whole sequence for heads/sp heads, with the document mask of the whole rows (position ids gathered once per
forward), and a last all-to-all brings the output back to the local tokens. The MoE sequence-balance loss
uses the expert loads of whole rows (summed over the group) with each rank's local mean affinities, whose
average over the group is the row's loss; expert loads for bias balancing stay local (the trainer sums them
over all ranks). DeepSpeed sees the group as data parallel: ZeRO partitions and gradients reduce over it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from dstrain.model.common.attention import AttentionLayout, attend

from .comm import all_to_all
from .dims import Groups


class SequenceParallel:
    """The model's `seq_parallel` hook (see DeepSeekLM): this rank's place in its sequence-parallel group."""

    def __init__(self, group: Any, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, layout: AttentionLayout
    ) -> torch.Tensor:
        """Local (B, T/sp, H, d) -> attention over the whole sequence -> local (B, T/sp, H, dv)."""
        return self.to_tokens(attend(self.to_heads(q), self.to_heads(k), self.to_heads(v), scale, layout))

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, c, H, d) -> (B, sp * c, H / sp, d): head block j goes to rank j, sequence slices come back."""
        b, c, h, d = x.shape
        n = self.size
        rows = x.reshape(b, c, n, h // n, d).permute(2, 0, 1, 3, 4).reshape(n * b * c, -1)
        got = all_to_all(rows, [b * c] * n, [b * c] * n, self.group)
        return got.view(n, b, c, h // n, d).permute(1, 0, 2, 3, 4).reshape(b, n * c, h // n, d)

    def to_tokens(self, y: torch.Tensor) -> torch.Tensor:
        """(B, sp * c, H / sp, d) -> (B, c, H, d): the inverse of `to_heads`."""
        b, t, hl, d = y.shape
        n = self.size
        c = t // n
        rows = y.reshape(b, n, c, hl, d).permute(1, 0, 2, 3, 4).reshape(n * b * c, -1)
        got = all_to_all(rows, [b * c] * n, [b * c] * n, self.group)
        return got.view(n, b, c, hl, d).permute(1, 2, 0, 3, 4).reshape(b, c, n * hl, d)

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(B, c, ...) slices -> (B, sp * c, ...) whole rows, for work every rank repeats alike on them (the
        sparse-attention indexer): the gradient of its own slice is this rank's part, not a sum."""
        return _GatherRows.apply(x, self)

    def gather_rows_summed(self, x: torch.Tensor) -> torch.Tensor:
        """(B, c, ...) slices -> (B, sp * c, ...) whole rows, for work each rank does for its own tokens over
        the whole rows (DeepSeek-V4's keys and compressors): the gradient of each slice sums every rank's."""
        return _GatherRowsSummed.apply(x, self)

    @torch.no_grad()
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The group's (B, c) slices side by side: (B, sp * c), in sequence order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        tdist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)

    @torch.no_grad()
    def sum(self, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        tdist.all_reduce(out, group=self.group)
        return out


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:  # noqa: ANN001
        ctx.rank, ctx.size = sp.rank, sp.size
        parts = [torch.empty_like(x) for _ in range(sp.size)]
        tdist.all_gather(parts, x.contiguous(), group=sp.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return grad.chunk(ctx.size, dim=1)[ctx.rank].contiguous(), None


class _GatherRowsSummed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:  # noqa: ANN001
        ctx.sp = sp
        parts = [torch.empty_like(x) for _ in range(sp.size)]
        tdist.all_gather(parts, x.contiguous(), group=sp.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        grad = grad.contiguous()
        tdist.all_reduce(grad, group=ctx.sp.group)
        return grad.chunk(ctx.sp.size, dim=1)[ctx.sp.rank].contiguous(), None


def apply_sequence_parallel(model: nn.Module, g: Groups) -> None:
    """Hook to the group every module that takes sequence parallelism (its class declares `seq_parallel`: the
    models, their attention and MoE layers, whatever the family); a no-op for sp 1."""
    if g.dims.sp == 1:
        return
    hook = SequenceParallel(g.sp, g.dims.sp, g.dp_rank % g.dims.sp)
    for m in model.modules():
        if hasattr(type(m), "seq_parallel"):
            m.seq_parallel = hook
