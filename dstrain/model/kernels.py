"""Device-specific kernel choices that keep the math of the plain ops (and nothing else).

CPUs without bf16 instructions (no AVX512-BF16 / AMX) run bf16 GEMMs and attention several times slower than
fp32 ones. There, bf16 linears and attention compute in fp32 and round their outputs to bf16: the semantics of
bf16 kernels with fp32 accumulation, at fp32 speed. GPUs and bf16-capable CPUs use native bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CPU_NATIVE_BF16 = bool(
    getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    or getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and not CPU_NATIVE_BF16:
        return torch.float32
    return x.dtype


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    dtype = compute_dtype(x)
    if dtype == x.dtype:
        return F.linear(x, weight, bias)
    out = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    return out.to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict, still an nn.Linear for peft) that uses `linear` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
