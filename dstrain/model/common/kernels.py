"""Device-specific kernel choices that keep the math of the plain ops (and nothing else), decided here.

CPUs without bf16 instructions (no AVX512-BF16 / AMX) run bf16 GEMMs and attention several times slower than
fp32 ones. There, bf16 linears and attention compute in fp32 and round their outputs to bf16: the semantics of
bf16 kernels with fp32 accumulation, at fp32 speed. GPUs and bf16-capable CPUs use native bf16.

`DSTRAIN_CPU_BF16=native|emulated` forces either CPU bf16 path whatever the CPU has (`auto`, the default, asks
the CPU), so one machine tests both: native bf16 kernels still run on a CPU without bf16 units, only slower.

`DSTRAIN_KERNEL_POLICY=cuda` makes every such decision take its CUDA branch on the CPU wherever the operation
exists there (the varlen attention kernels are replaced by a CPU reference of the same signature), so the
tests run the GPU-side logic on a machine without a GPU; `auto` (the default) follows the tensors' device.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
import torch.nn.functional as F
from torch import nn

CPU_HAS_BF16 = bool(
    getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    or getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
)
CPU_BF16 = os.environ.get("DSTRAIN_CPU_BF16", "auto")
if CPU_BF16 not in ("auto", "native", "emulated"):
    raise ValueError(f"DSTRAIN_CPU_BF16={CPU_BF16!r}: expected auto, native or emulated")
CPU_NATIVE_BF16 = CPU_HAS_BF16 if CPU_BF16 == "auto" else CPU_BF16 == "native"
"""Whether bf16 work on the CPU runs torch's bf16 kernels (else fp32 compute with bf16 outputs)."""


def cpu_bf16_path() -> str:
    """The CPU bf16 kernel path in words, and why it was taken (`dstrain env`, the benchmarks)."""
    path = "native bf16 kernels" if CPU_NATIVE_BF16 else "emulated: fp32 compute, bf16 outputs"
    units = "AVX512-BF16/AMX" if CPU_HAS_BF16 else "no bf16 units"
    why = f"forced by DSTRAIN_CPU_BF16={CPU_BF16}" if CPU_BF16 != "auto" else "auto"
    return f"{path} ({units}; {why})"


KERNEL_POLICY = os.environ.get("DSTRAIN_KERNEL_POLICY", "auto")
if KERNEL_POLICY not in ("auto", "cuda"):
    raise ValueError(f"DSTRAIN_KERNEL_POLICY={KERNEL_POLICY!r}: expected auto or cuda")
# Compute capabilities whose grouped GEMM is torch's fast CUTLASS kernel (elsewhere: a per-group loop)
FAST_GROUPED_GEMM = ((9, 0), (10, 0))


def gpu_kernels(device: torch.device) -> bool:
    """Whether work on `device` takes the CUDA branch of a kernel choice (see the top)."""
    return device.type == "cuda" or KERNEL_POLICY == "cuda"


@functools.cache
def _triton_runs(device_type: str) -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    return device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def triton_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether work on `device` at `dtype` runs dstrain's Triton kernels (dsa_kernels.py, index_kernels.py):
    the CUDA branch, Triton installed, and a GPU or Triton's CPU interpreter (TRITON_INTERPRET=1, the tests);
    float64 (gradient checks) stays on torch."""
    return gpu_kernels(device) and dtype != torch.float64 and _triton_runs(device.type)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """The GPU's compute capability; under the CUDA policy on the CPU, a GPU with every fast kernel."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)
    return FAST_GROUPED_GEMM[0]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    if x.dtype == torch.bfloat16 and not gpu_kernels(x.device) and not CPU_NATIVE_BF16:
        return torch.float32
    return x.dtype


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor):  # a frozen base weight in its stored form (stored.StoredWeight)
        return weight.linear(x, bias)
    dtype = compute_dtype(x)
    if dtype == x.dtype:
        return F.linear(x, weight, bias)
    out = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    return out.to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict, still an nn.Linear for peft) that uses `linear` above; under
    QAT (`qat`, set by model/quantized.apply_qat) its weight fake-quantized as the export writes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qat = self._modules.get("qat")  # a submodule when set (a dict lookup: no AttributeError per call)
        if qat is not None:
            return linear(x, qat(self.weight).to(x.dtype), self.bias)
        return linear(x, self.weight, self.bias)
