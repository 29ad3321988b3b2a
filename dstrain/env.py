"""`dstrain env`: what this machine can run, the first command on a new machine. It prints the software
(torch and its CUDA build, DeepSpeed, transformers, Triton, flash-attn; any outside the versions dstrain is
tested on), whether CUDA starts (and why not where a GPU is present but it does not: a wheel built for a newer
driver, a CPU wheel), the GPUs with their compute capability and native bf16, NCCL, the kernels dstrain will
use at each precision, DeepSpeed's ops, and the matmul peak MFU is measured against. Exit 0 when a run can
start, 1 with the reason when it cannot."""

from __future__ import annotations

import argparse
import importlib.metadata
import os

import torch

from dstrain.cmdline import command_parser
from dstrain.dist import cuda_problem, driver_version
from dstrain.errors import UserError
from dstrain.versions import outside_tested


class CannotRun(UserError):
    exit_code = 1


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _deepspeed_ops() -> str:
    try:
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
    except Exception as exc:  # an accelerator DeepSpeed cannot set up
        return f"cannot list ({type(exc).__name__}: {exc})"
    ok = []
    for name, builder in sorted(ALL_OPS.items()):
        try:
            if builder.is_compatible(verbose=False):
                ok.append(name)
        except Exception:  # a builder that cannot even check on this machine
            continue
    return f"{len(ok)} of {len(ALL_OPS)} compatible (built on first use): {', '.join(ok)}"


def report() -> tuple[list[str], str | None]:
    """(the lines to print, the reason a run cannot start or None)."""
    from dstrain.model import get_config, kernel_paths
    from dstrain.model.common.attention import varlen_kernels
    from dstrain.model.common.dsa import kernel_path as dsa_kernel_path
    from dstrain.model.common.kda import kernel_path as kda_kernel_path
    from dstrain.model.common.kernels import cpu_bf16_path

    lines = [
        f"python {'.'.join(map(str, __import__('sys').version_info[:3]))}, torch {torch.__version__} "
        f"(CUDA build {torch.version.cuda or 'none'}), deepspeed {_version('deepspeed')}, "
        f"transformers {_version('transformers')}, triton {_version('triton')}, dstrain {_version('dstrain')}",
        f"NVIDIA driver: {driver_version() or 'none found'}",
    ]
    # A warning, not a refusal: outside its tested range a dependency may still work (docs/training.md)
    outside = outside_tested()
    lines += [f"untested: {line}" for line in outside] or ["versions: each in its tested range"]
    problem = cuda_problem()
    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu"
    devices = []
    if cuda:
        lines.append(
            f"CUDA starts: {torch.cuda.device_count()} GPU(s), NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
        )
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            native = torch.cuda.is_bf16_supported(including_emulation=False)
            lines.append(f"  cuda:{i} {p.name}, sm{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, "
                         f"bf16 {'native' if native else 'emulated: training runs fp32'}")  # fmt: skip
            devices.append(torch.device("cuda", i))
    else:
        lines.append(f"CUDA: {problem or 'no GPU: runs on the CPU (gloo)'}")
        lines.append(f"  CPU: {os.cpu_count()} cores, bf16 path: {cpu_bf16_path()}")
    flash_attn_varlen, torch_varlen = varlen_kernels()
    flash = "installed" if flash_attn_varlen is not None else _version("flash-attn")
    lines.append(f"flash-attn: {flash}; torch varlen_attn: {'yes' if torch_varlen is not None else 'no'}")
    device = devices[0] if devices else torch.device("cpu")
    cfg = get_config("tiny")
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        paths = kernel_paths(cfg, device, dtype)
        lines.append(f"kernels, {name} on {device.type}: " + "; ".join(f"{k}: {v}" for k, v in paths.items()))
        lines.append(f"  sparse attention (V3.2, GLM-5), {name}: {dsa_kernel_path(device, dtype)}")
    lines.append(
        f"linear attention (KDA: Kimi Linear, GLM-5.3-Flash) on {device.type}: {kda_kernel_path(device)}"
    )
    lines.append(f"DeepSpeed ops: {_deepspeed_ops()}")
    from dstrain.training.metrics import device_peak_tflops

    peak, source = device_peak_tflops(device, "bf16" if cuda else "fp32", None)
    lines.append(f"MFU peak per device: {peak:.3g} TFLOP/s ({source}; --peak_tflops to set it)")
    return lines, problem


def parse(argv: list[str]) -> argparse.Namespace:
    return command_parser("dstrain env", __doc__.split("\n\n")[0]).parse_args(argv)


def run(args: argparse.Namespace) -> int:
    lines, problem = report()
    print("\n".join(lines), flush=True)
    if problem:
        raise CannotRun(problem)
    print("dstrain env: a run can start", flush=True)
    return 0
