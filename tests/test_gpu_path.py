"""The GPU-side decisions outside the model, on a machine without a GPU: torch.cuda and DeepSpeed's init
monkeypatched to describe one. A CPU run never touches CUDA (DS_ACCELERATOR=cpu resolves the same plan with
GPUs visible); rank to device under every launcher; the NCCL environment; the CUDA RNG state in checkpoints;
bf16 only where the GPU has it natively; the MFU peak table."""

from __future__ import annotations

import math

import pytest
import torch

from dstrain import dist
from dstrain.errors import UserError


@pytest.fixture
def gpus(monkeypatch):
    """torch.cuda describing `n` visible GPUs (8 unless the test sets gpus.count); set_device recorded."""

    class Visible:
        count = 8
        current: list[torch.device] = []

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: Visible.count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: Visible.current.append(torch.device(d)))
    return Visible


def test_a_cpu_run_resolves_the_same_plan_with_gpus_visible(gpus, monkeypatch):
    """DS_ACCELERATOR=cpu is honoured before CUDA is touched: precision, overlap_comm, pinning and the
    device are those of a machine without a GPU (gpu_readiness N1)."""
    from dstrain.config.plan import prepare
    from tests.helpers.tiny import tiny_config
    from tests.helpers.trainer import make_options

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    opts = make_options(["--config", "zero3_offload"])
    with_gpus = prepare(opts, 2, model=tiny_config())
    assert gpus.current == []  # no set_device: CUDA untouched
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    without = prepare(opts, 2, model=tiny_config())
    assert with_gpus.ds == without.ds and with_gpus.device_type == without.device_type == "cpu"
    assert with_gpus.precision == "fp32" and with_gpus.ds["zero_optimization"]["overlap_comm"] is False
    assert with_gpus.ds["zero_optimization"]["offload_optimizer"]["pin_memory"] is False


def test_a_gpu_plan_overlaps_pins_and_trains_bf16(gpus, monkeypatch):
    from dstrain.config.plan import prepare
    from tests.helpers.tiny import tiny_config
    from tests.helpers.trainer import make_options

    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: not including_emulation or True
    )
    plan = prepare(make_options(["--config", "zero3_offload"]), 2, device_type="cuda", model=tiny_config())
    zero = plan.ds["zero_optimization"]
    assert (
        plan.precision == "bf16" and zero["overlap_comm"] is True and zero["offload_optimizer"]["pin_memory"]
    )


@pytest.mark.parametrize(("native", "want"), [(True, "bf16"), (False, "fp32")])
def test_bf16_only_where_the_gpu_has_it_natively(native, want, gpus, monkeypatch):
    """V100 / T4 emulate bf16 (is_bf16_supported() says yes): auto trains fp32 there (N8)."""
    from dstrain.config.ds_config import resolve_precision

    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation or native
    )
    assert resolve_precision("auto", {}, "cuda") == want


def test_rank_to_device_under_every_launcher(gpus, monkeypatch):
    for key in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert dist.local_cuda_device() == torch.device("cuda", 3) and gpus.current[-1] == torch.device("cuda", 3)
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("SLURM_LOCALID", "5")  # srun without torchrun
    assert dist.local_cuda_device() == torch.device("cuda", 5)
    gpus.count = 1  # srun binding one GPU per task: each task sees its own as cuda:0 (N13)
    assert dist.local_cuda_device() == torch.device("cuda", 0)
    assert dist.env_local_rank() == 0  # LOCAL_RANK set for DeepSpeed's own device choice
    monkeypatch.delenv("SLURM_LOCALID")
    monkeypatch.setenv("LOCAL_RANK", "2")
    gpus.count = 2
    with pytest.raises(UserError, match="local rank 2 but 2 visible GPU"):
        dist.local_cuda_device()


def test_nccl_process_group_environment(gpus, monkeypatch):
    """nccl, TF32 for fp32 matmuls, the NCCL watchdog ending a timed-out process, timeouts for later groups."""
    import deepspeed
    import torch.distributed as tdist

    seen = {}
    monkeypatch.setattr(dist, "pick_accelerator", lambda: "cuda")
    monkeypatch.setattr(dist, "local_cuda_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: seen.update(kw))
    monkeypatch.setattr(tdist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "keep_freed_memory", lambda: seen.setdefault("keep_freed", True))
    for key in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    precision = torch.get_float32_matmul_precision()
    try:
        info = dist.init_distributed(123.0)
        assert (
            info.backend == "nccl"
            and info.device == torch.device("cuda", 0)
            and seen["dist_backend"] == "nccl"
        )
        assert seen["timeout"].total_seconds() == 123.0
        assert tdist.distributed_c10d.default_pg_nccl_timeout.total_seconds() == 123.0
        assert torch.get_float32_matmul_precision() == "high"
        import os

        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and "keep_freed" not in seen
    finally:
        torch.set_float32_matmul_precision(precision)


def test_checkpoints_save_and_restore_this_devices_cuda_rng(gpus, monkeypatch):
    from dstrain.checkpoint import store

    state = torch.arange(16, dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: restored.append(s))
    saved = store.rng_state()
    assert "cuda" in saved
    store.set_rng_state(saved)
    assert torch.equal(restored[-1], state)


@pytest.mark.parametrize(
    ("name", "precision", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H100 NVL", "fp32", 835.0 / 2),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.0),
    ],
)
def test_mfu_peak_table(name, precision, peak, monkeypatch):
    from dstrain.training.metrics import device_peak_tflops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    got, source = device_peak_tflops(torch.device("cuda", 0), precision, None)
    assert got == peak and name in source


def test_an_unknown_gpu_asks_for_its_peak(monkeypatch):
    from dstrain.training.metrics import device_peak_tflops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Future GPU 9000")
    got, source = device_peak_tflops(torch.device("cuda", 0), "bf16", None)
    assert math.isnan(got) and "--peak_tflops" in source


def test_env_says_a_run_can_start(capsys):
    from dstrain.cli import main

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and "kernels, bf16 on cpu" in out
    assert "linear attention (KDA: Kimi Linear, GLM-5.3-Flash) on cpu: dstrain's chunked delta rule" in out
    assert "versions: each in its tested range" in out and out.rstrip().endswith("a run can start")


def test_env_names_a_dependency_outside_its_tested_range(monkeypatch, capsys):
    """A warning only: a run still starts."""
    import dstrain.versions
    from dstrain.cli import main

    real = dstrain.versions.installed
    monkeypatch.setattr(dstrain.versions, "installed", lambda p: "5.30.1" if p == "transformers" else real(p))
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    low, high = dstrain.versions.TESTED["transformers"]
    assert f"untested: transformers 5.30.1 is outside the tested range >={low},<{high}" in out, out
    assert "versions: each" not in out and out.rstrip().endswith("a run can start")


@pytest.mark.parametrize(("build", "message"), [(None, "is a CPU build"), ("13.0", "does not start")])
def test_env_says_why_cuda_does_not_start_where_a_gpu_is(build, message, monkeypatch, capsys):
    """A GPU present (a device node, a driver) but no CUDA: a CPU wheel, or a CUDA 13 wheel on an older
    driver. dstrain would train on the CPU without a word; `dstrain env` exits 1 naming the cause (N2)."""
    from dstrain.cli import main

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(dist, "gpu_present", lambda: True)
    monkeypatch.setattr(dist, "driver_version", lambda: "535.104.05")
    monkeypatch.setattr(torch.version, "cuda", build)
    assert main(["env"]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("dstrain: error: an NVIDIA GPU is present") and message in err and err.count("\n") == 1
    )


def test_smoke_trains_packed_rows_on_the_cuda_branch(monkeypatch, capsys):
    import dstrain.model.common.kernels as kernels
    from dstrain.cli import main

    monkeypatch.setattr(kernels, "KERNEL_POLICY", "cuda")
    assert main(["smoke", "--device", "cpu", "--precision", "bf16", "--steps", "2", "--seq_len", "32"]) == 0
    out = capsys.readouterr().out
    assert "CPU reference of the varlen kernels" in out and out.count("step ") == 2


def test_training_on_a_gpu_machine_where_cuda_does_not_start_stops_in_one_line(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(dist, "gpu_present", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(UserError, match="does not start.*DS_ACCELERATOR=cpu runs on the CPU on purpose"):
        dist.pick_accelerator()
