"""Quantization-aware training (`--qat`): every weight the source folder stores quantized is used, in the forward,
as the export will write it: quantized in the source's blocks with the export's rounding and scale rule
(hf/quantize.py, `SourceForms.quantize`: round to nearest even, the source's scale kept per block where the
weights are still on its grid, else the release's scale rule) and dequantized again; the gradient passes straight
through (the straight-through estimator) to the master weights, or under LoRA to the adapters of the merged
weight W + (alpha / r) B A, which is what the export quantizes. So the quantized export computes what trained.

Each quantizer holds the source's scales (integer buffers, like stored.py's: no cast, no ZeRO, no checkpoint) and
quantizes one weight (a routed experts' stack: expert by expert). The fake-quantized weight lives for its layer's
forward and is kept for backward like any weight a layer computes (one layer's at a time under activation
checkpointing); the GPU path is torch's, not yet fused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .stored import cut_range


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, quantizer):  # noqa: ANN001, ANN205
        return quantizer.round_trip(w)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad, None


class Quantizer(nn.Module):
    """The export's quantization of one weight (or each of a stack of experts' weights), as the source stored it:
    `round_trip(w, keep)` (hf/quantize.py's, given by the caller: this floor reads no checkpoint format) with the
    source's scales `keep` (..., blocks)."""

    def __init__(self, round_trip: Any, keep: torch.Tensor) -> None:
        super().__init__()
        self.fn, self.scale_dtype, self.keep_shape = round_trip, keep.dtype, tuple(keep.shape)
        self.register_buffer("keep", keep.contiguous().view(torch.uint8), persistent=False)

    def scales(self) -> torch.Tensor:
        return self.keep.view(self.scale_dtype).view(self.keep_shape)

    def tp_slice(self, dim: int, rank: int, size: int, logical: int, what: str) -> Quantizer:
        """The quantizer of a tensor-parallel rank's slice of the weight along `dim` (`logical` rows or columns
        whole): its blocks' scales (ValueError naming `what` where the slice would cut a block)."""
        keep = self.scales()
        lo, hi = cut_range(keep.shape[dim], logical, rank, size, what)
        return Quantizer(self.fn, keep.narrow(dim, lo, hi - lo).clone())

    def experts(self, first: int, n: int) -> Quantizer:
        """The quantizer of experts first .. first + n of a stack (an expert-parallel rank's)."""
        return Quantizer(self.fn, self.scales()[first : first + n].clone())

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        """`w` fake-quantized, differentiable straight through."""
        return _StraightThrough.apply(w, self)

    @torch.no_grad()
    def round_trip(self, w: torch.Tensor) -> torch.Tensor:
        """dequantize(quantize(w)) in w's dtype: the weight the export writes, as transformers reads it back."""
        keep = self.scales()
        if w.dim() == 3:  # a stack of experts: one weight each
            return torch.stack([self.fn(w[e].float(), keep[e]).to(w.dtype) for e in range(w.shape[0])])
        return self.fn(w.float(), keep).to(w.dtype)


def qat_experts(
    qat: nn.ModuleDict, gate_up: torch.Tensor, down: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed experts' fused weights fake-quantized: gate and up each in its own blocks (the folder's
    tensors), down in its own."""
    gate, up = gate_up.chunk(2, dim=1)
    return torch.cat([qat["gate"](gate), qat["up"](up)], dim=1), qat["down"](down)
