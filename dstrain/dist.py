"""Process group and device: the same code under `deepspeed`, `torchrun`, `accelerate launch`, `srun` and a
plain `python dstrain/train.py` (one rank, no launcher environment), on GPUs (nccl) or CPUs (gloo)."""

from __future__ import annotations

import contextlib
import datetime
import glob
import os
import random
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as tdist

from dstrain.errors import UserError
from dstrain.hostalloc import keep_freed_memory

T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# (rank, world size, local rank) as each launcher names them: torchrun / deepspeed / accelerate, srun, mpirun,
# and MPICH's PMI (no local rank).
LAUNCHER_ENV = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", None),
)


def _launcher_value(column: int) -> int | None:
    for names in LAUNCHER_ENV:
        key = names[column]
        if key and os.environ.get(key):
            return int(os.environ[key])
    return None


def env_rank() -> int:
    """This process's global rank as the launcher announced it (0 without a launcher)."""
    return _launcher_value(0) or 0


def launcher_world_size() -> int:
    """World size as the launcher announced it (1 without a launcher): known before any process group."""
    return _launcher_value(1) or 1


def env_local_rank() -> int:
    """This process's rank on its node as the launcher announced it (0 without a launcher)."""
    return _launcher_value(2) or 0


def group_rank_world() -> tuple[int, int]:
    """(rank, world size) of the process group; (0, 1) before there is one."""
    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


OWN_PORT = "DSTRAIN_OWN_MASTER_PORT"  # set when dstrain chose MASTER_PORT itself (a one-rank run)


def free_port() -> int:
    """A port nobody listens on now, below the kernel's ephemeral range where there is room: outgoing connections
    (gloo's, a launcher's) take ephemeral ports, and one of them can take a port picked from that range before
    the store binds it (EADDRINUSE: the test suite saw it)."""
    low, rng = _ephemeral_low(), random.SystemRandom()
    for _ in range(50 if low > 11024 else 0):
        with contextlib.suppress(OSError), socket.socket() as s:
            s.bind(("127.0.0.1", rng.randrange(low - 10000, low)))
            return s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (0 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _fill_env() -> None:
    """torch.distributed's env:// needs RANK/WORLD_SIZE/MASTER_*; derive them from srun/mpirun or, with no
    launcher at all, make a one-rank group on this machine."""
    env = os.environ
    if "RANK" not in env:
        env.update(
            RANK=str(env_rank()), WORLD_SIZE=str(launcher_world_size()), LOCAL_RANK=str(env_local_rank())
        )
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in env:
        if int(env["WORLD_SIZE"]) > 1:
            raise UserError("MASTER_PORT is not set: launch with deepspeed, torchrun or srun (see launch/)")
        env["MASTER_PORT"] = str(free_port())
        env[OWN_PORT] = env["MASTER_PORT"]


def driver_version() -> str | None:
    """The NVIDIA driver's version, read without CUDA (None where there is no NVIDIA driver)."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            line = f.readline()
        return next((w for w in line.split() if w[:1].isdigit() and "." in w), line.strip())
    except OSError:
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)  # fmt: skip
            return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
        except (OSError, subprocess.TimeoutExpired):
            return None
    return None


def gpu_present() -> bool:
    """An NVIDIA GPU this machine exposes, whatever torch makes of it."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or driver_version() is not None


def cuda_problem() -> str | None:
    """Why CUDA does not start where a GPU is present (gpu_readiness N2); None when it starts or there is no
    GPU."""
    if not gpu_present() or os.environ.get("DS_ACCELERATOR") == "cpu":
        return None
    built = torch.version.cuda
    if built is None:
        return (f"an NVIDIA GPU is present but torch {torch.__version__} is a CPU build: install a CUDA wheel, "
                "e.g. pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128")  # fmt: skip
    if not torch.cuda.is_available():
        return (f"an NVIDIA GPU is present (driver {driver_version() or 'unknown'}) but CUDA {built} of torch "
                f"{torch.__version__} does not start: a wheel for a newer driver (CUDA 13 needs driver >= 580), "
                "or CUDA_VISIBLE_DEVICES hides every GPU; install the wheel of your driver's CUDA "
                "(--index-url https://download.pytorch.org/whl/cu128 or cu126)")  # fmt: skip
    return None


def settle_accelerator_env() -> None:
    """A process's start, before anything imports deepspeed: on a machine that exposes no GPU and where torch
    sees none, DS_ACCELERATOR=cpu (what pick_accelerator sets there anyway), so DeepSpeed's probe does not warn
    "Setting accelerator to CPU" in every command. Where a GPU is exposed nothing is set: pick_accelerator
    still says in one line why CUDA does not start."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available() and not gpu_present():
        os.environ["DS_ACCELERATOR"] = "cpu"


def pick_accelerator() -> str:
    """'cuda' or 'cpu'. DS_ACCELERATOR=cpu is honoured before CUDA is touched at all: a visible GPU changes
    nothing of a CPU run (precision, overlap, pinning, rank to device). Otherwise CUDA when a GPU is visible:
    this rank's GPU becomes the current device here, before anything creates a CUDA context (which would
    otherwise land on GPU 0 for every rank); with none, DS_ACCELERATOR=cpu is set before deepspeed is
    imported, so DeepSpeed never probes for other accelerators."""
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        return "cpu"
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        local_cuda_device()
        return os.environ.get("DS_ACCELERATOR", "cuda")
    problem = cuda_problem()
    if problem:  # training on the CPU of a GPU machine without a word would be worse than stopping
        raise UserError(f"{problem} (DS_ACCELERATOR=cpu runs on the CPU on purpose)")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return "cpu"


def local_cuda_device() -> torch.device:
    """This rank's GPU (LOCAL_RANK, or SLURM's/Open MPI's local id), made current. A task that sees one GPU
    uses it whatever its local rank under srun (binding a GPU per task: each sees its own as cuda:0; DeepSpeed
    then reads LOCAL_RANK 0 too). A UserError when the node runs more ranks than it shows GPUs: two ranks on one
    GPU would fail inside NCCL."""
    env = os.environ
    local = env_local_rank()
    count = torch.cuda.device_count()
    if count == 1 and local > 0 and "SLURM_LOCALID" in env:  # srun gave this task its own GPU
        env["LOCAL_RANK"] = "0"
        local = 0
    if local >= count:
        raise UserError(
            f"local rank {local} but {count} visible GPU(s) (CUDA_VISIBLE_DEVICES="
            f"{env.get('CUDA_VISIBLE_DEVICES', 'unset')}): launch at most {count} rank(s) per node"
        )
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    return device


def use_this_environments_ninja() -> None:
    """torch builds DeepSpeed's JIT ops (the CPU shared-memory collectives, CPU Adam) with the first `ninja` on
    PATH, in one cache per user. With the environment's own ninja (pip's, beside this interpreter) first, a
    run started from an activated environment and one started as .venv/bin/python agree on it: two ninja
    versions take each other's builds for stale and rebuild them (20+ s on a 2-core machine, each switch)."""
    here = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if os.path.isfile(os.path.join(here, "ninja")) and path.split(os.pathsep)[0] != here:
        os.environ["PATH"] = here + os.pathsep + path


def skip_shared_memory_allreduce() -> None:
    """DeepSpeed's CPU backend builds (40 s of C++ once per machine), probes every op's compiler and loads (0.4 s
    of each process's start) a shared-memory all-reduce that only its inference engine calls, printing a line on
    every rank. Training never calls it: its compatibility table (read for that op alone) says no."""
    import deepspeed.ops

    if "__compatible_ops__" not in vars(deepspeed.ops):  # not probed yet (a probe of a caller wins)
        deepspeed.ops.__compatible_ops__ = {}


def init_distributed(timeout_s: float = 600.0) -> DistInfo:
    """The process group, on which every collective (and rendezvous-store wait) gives up after `timeout_s`
    seconds (--collective_timeout) instead of waiting forever for a rank that died or hangs."""
    accel = pick_accelerator()
    _fill_env()
    use_this_environments_ninja()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "0")) or 0) or min(
        world, max(1, torch.cuda.device_count()) if accel == "cuda" else world
    )
    if accel == "cuda":
        device = local_cuda_device()
        backend = "nccl"
        # fp32 matmuls on tensor cores (TF32): what the MFU peak for fp32 runs assumes
        torch.set_float32_matmul_precision("high")
    else:
        device = torch.device("cpu")
        backend = "gloo"
        keep_freed_memory()  # steps re-allocate the same large tensors: no page faults for each (hostalloc.py)
    if "OMP_NUM_THREADS" not in os.environ:
        # Ranks on one host share its cores (GPU ranks too, for host-side work); torch would otherwise give
        # each rank all of them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    timeout = datetime.timedelta(seconds=timeout_s)
    # new_group() without a timeout (DeepSpeed's copy of the world group that ZeRO reduces over, its expert
    # groups, ours) takes torch's per-backend default (30 min for gloo), not the world group's: make it ours.
    tdist.distributed_c10d.default_pg_timeout = timeout
    tdist.distributed_c10d.default_pg_nccl_timeout = timeout
    chosen = any(k.endswith(("NCCL_BLOCKING_WAIT", "NCCL_ASYNC_ERROR_HANDLING")) for k in os.environ)
    if backend == "nccl" and not chosen:
        # torch's NCCL watchdog then ends the process once a collective has timed out (3: without aborting
        # the communicators first, which can hang): torch's default today, pinned so that no rank waits
        # forever. A user's own choice wins (TORCH_NCCL_BLOCKING_WAIT=1 raises in the waiting call instead).
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3"
    import deepspeed

    if backend == "gloo":
        skip_shared_memory_allreduce()
    for attempt in range(3):
        if tdist.is_initialized():
            break
        try:
            deepspeed.init_distributed(
                dist_backend=backend, auto_mpi_discovery=False, verbose=False, timeout=timeout
            )
        except tdist.DistNetworkError as exc:
            # A port this one-rank group picked itself can be taken between free_port() and the store's bind
            # (the ephemeral range other processes' connections draw from): pick another.
            mine = os.environ.get(OWN_PORT) == os.environ.get("MASTER_PORT")
            if not mine or "EADDRINUSE" not in str(exc) or attempt == 2:
                raise
            os.environ["MASTER_PORT"] = os.environ[OWN_PORT] = str(free_port())
    return DistInfo(rank, world, local_rank, local_world, device, backend)


def all_reduce(t: torch.Tensor, op: Any = None) -> torch.Tensor:
    """In-place all-reduce (SUM by default) that is a no-op on one rank."""
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.all_reduce(t, op=op or tdist.ReduceOp.SUM)
    return t


def broadcast_object(obj: T) -> T:
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def barrier() -> None:
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.barrier()


def agree(fn: Callable[[], T]) -> T:
    """Run fn on rank 0 only and give every rank its result, or raise its UserError on every rank, so a
    decision made from rank 0's view (a checkpoint to resume) never leaves the other ranks waiting."""
    result: tuple[str, Any]
    if not tdist.is_initialized() or tdist.get_rank() == 0:
        try:
            result = ("ok", fn())
        except UserError as exc:
            result = ("error", (type(exc), str(exc)))
    else:
        result = ("", None)
    kind, value = broadcast_object(result)
    if kind == "error":
        exc = value[0](value[1])
        exc.all_ranks = True
        raise exc
    return value


def shutdown() -> None:
    """Destroy the process group (best effort): left to interpreter exit, the backend's threads can abort
    the process ("terminate called without an active exception") after its work is done."""
    if tdist.is_available() and tdist.is_initialized():
        with contextlib.suppress(Exception):
            tdist.destroy_process_group()


def finish() -> None:
    """End a worker process whose work succeeded: destroy the process group, flush, and exit 0 without the
    interpreter's teardown, in which threads of gloo or of torch's profiler can still abort a finished
    process (seen under load even after `shutdown`). For test and benchmark workers: it skips atexit."""
    import sys

    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
