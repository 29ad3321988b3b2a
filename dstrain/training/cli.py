"""`dstrain train`: validate everything, then set up the process group, the engine and run the loop."""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

from dstrain import dist
from dstrain.checkpoint import store
from dstrain.config.ds_config import RESOLVED
from dstrain.config.options import CheckpointOptions, parse_options
from dstrain.config.plan import prepare
from dstrain.errors import CheckpointError, UserError
from dstrain.memory.estimate import device_warning

from . import watchdog
from .preempt import PREEMPTED_EXIT_CODE
from .trainer import Trainer


def _rank_env() -> int:
    for key in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(key):
            return int(os.environ[key])
    return 0


def quiet_libraries(debug: bool, rank: int) -> None:
    """DeepSpeed logs at INFO and torch warns about its own deprecations on every rank; users see dstrain's
    lines (rank 0) unless --debug."""
    if debug:
        return
    level = logging.WARNING if rank == 0 else logging.ERROR
    for name in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(level)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed.*")
    warnings.filterwarnings("ignore", message=".*TORCH_CUDA_ARCH_LIST.*")


def size(n: float) -> str:
    """Bytes for people: 512 B, 49 KiB, 47.7 MiB, 7.5 GiB."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit == "MiB" else f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def default_output_dir(model: str) -> str:
    name = Path(model).name if os.path.isdir(model) else model
    return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def choose_resume(c: CheckpointOptions, output_dir: str) -> str | None:
    found = store.resolve_resume(c.resume, output_dir)
    if found is None and c.resume is None and store.newest_complete(store.checkpoint_root(output_dir)):
        raise CheckpointError(
            f"--output_dir {output_dir} already holds checkpoints: pass --resume auto to continue it, "
            "or choose another --output_dir"
        )
    return str(found) if found is not None else None


def run(argv: list[str]) -> int:
    # Everything that needs no process group and allocates nothing comes first: a mistake is one line.
    plan = prepare(parse_options(argv))
    opts = plan.opts
    model = opts.model.model
    info = dist.init_distributed(opts.run.collective_timeout)
    watchdog.arm(opts.run.collective_timeout)
    output_dir = opts.checkpoint.output_dir or dist.broadcast_object(default_output_dir(model))
    resume = dist.agree(lambda: choose_resume(opts.checkpoint, output_dir))
    say = print if info.is_main else (lambda *a, **k: None)
    if info.is_main:
        os.makedirs(output_dir, exist_ok=True)
    plan = plan.with_output_dir(output_dir)
    if info.is_main:
        plan.write_resolved()
    dist.barrier()
    say(
        f"dstrain: {model} on {info.world_size} x {info.device.type} ({info.backend}), "
        f"{plan.dims.describe()}, ZeRO-{plan.stage}, {plan.precision}, "
        f"global batch {plan.global_batch_rows} x {opts.data.seq_len} tokens, {opts.schedule.max_steps} steps",
        flush=True,
    )
    say(f"dstrain: outputs in {os.path.abspath(output_dir)} (metrics.jsonl, checkpoints/, {RESOLVED})")
    if info.is_main and (warning := device_warning(plan, info.device, info.local_world_size)):
        say(warning)
    for note in plan.notes:
        say(f"dstrain: note: {note}")
    if opts.checkpoint.resume == "auto" and resume is None:
        say(f"dstrain: --resume auto: no complete checkpoint in {output_dir}, starting fresh")
    elif resume is not None:
        say(f"dstrain: resuming from {resume}")
    trainer = Trainer(plan, info, resume_path=resume)
    trainer.setup()
    if trainer.load_stats:
        ls = trainer.load_stats
        say(
            f"dstrain: loaded {model}: rank 0 read {size(ls['bytes_read'])} of {size(ls['checkpoint_bytes'])}, "
            f"peak memory +{size(ls['peak_rss_growth'])} while loading"
        )
    summary = trainer.run()
    last = trainer.history[-1] if trainer.history else None
    if last is not None:
        first = trainer.history[0]
        losses = " -> ".join(f"{r['loss']:.4f}" if r["loss"] is not None else "nan" for r in (first, last))
        say(f"dstrain: done at step {summary['step']}: loss {losses}")
    say(f"dstrain: metrics     {os.path.abspath(os.path.join(output_dir, 'metrics.jsonl'))}")
    if summary["checkpoint"]:
        say(f"dstrain: checkpoint  {os.path.abspath(summary['checkpoint'])}")
    if summary["stopped"]:
        return PREEMPTED_EXIT_CODE
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    rank = _rank_env()
    quiet_libraries(debug, rank)
    try:
        return run(argv)
    except SystemExit as exc:  # argparse --help
        return int(exc.code or 0)
    except UserError as exc:
        if debug:
            traceback.print_exc()
        import torch.distributed as tdist

        # Errors every rank raises alike (validation before the process group, agreed decisions, the NaN
        # check) are printed once; anything else only the rank that hit it knows about.
        everywhere = getattr(exc, "all_ranks", False) or not (tdist.is_available() and tdist.is_initialized())
        if rank == 0 or not everywhere:
            where = "" if everywhere or rank == 0 else f" (rank {rank})"
            print(f"dstrain: error{where}: {exc}", file=sys.stderr, flush=True)
        return getattr(exc, "exit_code", 2)
    except Exception as exc:
        if not watchdog.is_peer_failure(exc):
            raise
        if debug:
            traceback.print_exc()
        return watchdog.report(exc)
    finally:
        dist.shutdown()
