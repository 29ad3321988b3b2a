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

from ..hf.quant import QUANTIZED
from ..hf.quantize import quantize_fp4, quantize_fp8, quantize_packed


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, quantizer):  # noqa: ANN001, ANN205
        return quantizer.round_trip(w)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad, None


class Quantizer(nn.Module):
    """The export's quantization of one weight (or each of a stack of experts' weights), as the source stored it:
    `form` (a QUANTIZED marker), the source's scales `keep` (..., blocks) and, for packed integers, the bits."""

    def __init__(self, form: str, keep: torch.Tensor, fp4: bool = False, bits: int = 0) -> None:
        super().__init__()
        self.form, self.fp4, self.bits, self.scale_dtype = form, fp4, bits, keep.dtype
        self.keep_shape = tuple(keep.shape)
        self.register_buffer("keep", keep.contiguous().view(torch.uint8), persistent=False)

    def scales(self) -> torch.Tensor:
        return self.keep.view(self.scale_dtype).view(self.keep_shape)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        """`w` fake-quantized, differentiable straight through."""
        return _StraightThrough.apply(w, self)

    @torch.no_grad()
    def round_trip(self, w: torch.Tensor) -> torch.Tensor:
        """dequantize(quantize(w)) in w's dtype: the weight the export writes, as transformers reads it back."""
        keep = self.scales()
        if w.dim() == 3:  # a stack of experts: one weight each
            return torch.stack([self._one(w[e], keep[e]) for e in range(w.shape[0])])
        return self._one(w, keep)

    def _one(self, w: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        form = QUANTIZED[self.form]
        x = w.float()
        if self.form == "weight_packed":
            parts = quantize_packed(x, self.bits, keep.shape[-1], self.scale_dtype, keep=keep)
            back = form.dequantize(*parts, torch.tensor(w.shape))
        elif self.fp4:
            back = form.dequantize(*quantize_fp4(x, keep=keep))
        else:
            back = form.dequantize(*quantize_fp8(x, self.scale_dtype, keep=keep))
        return back.to(w.dtype)


def quantizer_for(reader: Any, key: str, half: int | None = None) -> Quantizer:
    """The quantizer of dstrain weight `key` (of fused experts: one `half`, all experts stacked): the folder's
    scales, read; its codes' dtype and width, from the headers."""
    form = reader.stored_form(key)
    layout = reader.stored_layout(key, half)  # dtypes and shapes: the scales alone are read
    if form == "weight_packed":
        if "weight_zero_point" in layout:
            raise ValueError(
                f"{key}: QAT of asymmetric packed integers (a zero point) is not built; --qat off"
            )
        parts = reader.read_stored(key, half, only=("weight_scale", "weight_shape"))
        words, cols = layout["weight_packed"][1][-1], int(parts["weight_shape"].reshape(-1, 2)[0, 1])
        return Quantizer(form, parts["weight_scale"], bits=32 * words // cols)
    marker = "weight_scale_inv" if form == "weight_scale_inv" else "scale"
    keep = reader.read_stored(key, half, only=(marker,))[marker]
    return Quantizer(form, keep, fp4=layout["weight"][0] == torch.int8)


def apply_qat(model: nn.Module, reader: Any) -> int:
    """Give every Linear and routed experts that trains (its weights, or LoRA adapters on them) and whose weight
    the folder stores quantized its quantizer(s) (`qat`, read in their forward); a frozen weight is exported as
    loaded, so it computes as it is. -> how many weights will train fake-quantized."""
    from .layers import Experts

    def trains(m: nn.Module) -> bool:
        return any(p.requires_grad for p in m.parameters(recurse=False))

    count = 0
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and trains(m) and reader.stored_form(f"{name}.weight"):
            m.qat = quantizer_for(reader, f"{name}.weight")
            count += 1
        elif isinstance(m, Experts) and trains(m) and reader.stored_form(f"{name}.gate_up_proj"):
            key = f"{name}.gate_up_proj"
            m.qat = nn.ModuleDict(
                {"gate": quantizer_for(reader, key, 0), "up": quantizer_for(reader, key, 1),
                 "down": quantizer_for(reader, f"{name}.down_proj")}
            )  # fmt: skip
            count += 3
    return count


def qat_experts(
    qat: nn.ModuleDict, gate_up: torch.Tensor, down: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed experts' fused weights fake-quantized: gate and up each in its own blocks (the folder's
    tensors), down in its own."""
    gate, up = gate_up.chunk(2, dim=1)
    return torch.cat([qat["gate"](gate), qat["up"](up)], dim=1), qat["down"](down)
