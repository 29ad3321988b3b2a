"""`dstrain train`: validate everything, then set up the process group, the engine and run the loop (under
the command-line policy of `dstrain.cli`)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
import warnings
from pathlib import Path

import torch

from dstrain import dist
from dstrain.checkpoint import store
from dstrain.config.ds_config import RESOLVED
from dstrain.config.options import CheckpointOptions, Options, parse_options
from dstrain.config.plan import RunPlan, prepare
from dstrain.errors import CheckpointError, UserError
from dstrain.memory.estimate import device_warning
from dstrain.model import kernel_paths

from . import watchdog
from .metrics import METRICS_FILE, plural
from .preempt import PREEMPTED_EXIT_CODE
from .trainer import Trainer

# Imported by a run, not at this module's import (`dstrain train --help` and a flag's mistake stay fast): a
# process's command line imports them once its arguments parsed, frozen (dstrain/collector.py): DeepSpeed, the
# bundled tokenizer's class.
PRELOAD = ("deepspeed", "transformers.tokenization_utils_tokenizers")


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


def count(n: float) -> str:
    """Parameters for people: 950, 12.3K, 4.56M, 671B."""
    for unit in ("", "K", "M"):
        if n < 1000:
            return f"{n:.0f}" if not unit else f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}B"


def size(n: float) -> str:
    """Bytes for people: 512 B, 49 KiB, 47.7 MiB, 7.5 GiB."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit == "MiB" else f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def default_output_dir(plan: RunPlan) -> str:
    name = Path(plan.model_folder).name if plan.model_folder else plan.opts.model.model
    return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def choose_resume(c: CheckpointOptions, output_dir: str) -> str | None:
    found = store.resolve_resume(c.resume, output_dir)
    if found is None and c.resume is None and store.newest_complete(store.checkpoint_root(output_dir)):
        raise CheckpointError(
            f"--output_dir {output_dir} already holds checkpoints: pass --resume auto to continue it, "
            "or choose another --output_dir"
        )
    return str(found) if found is not None else None


def parse(argv: list[str]) -> Options:
    return parse_options(argv)


def run(opts: Options) -> int:
    quiet_libraries(opts.logging.debug, dist.env_rank())
    try:
        # Everything that needs no process group and allocates nothing comes first: a mistake is one line,
        # and every rank makes it alike.
        plan = prepare(opts)
        if opts.schedule.epochs is not None:
            plan = prepare(steps_of_epochs(plan))
    except UserError as exc:
        exc.all_ranks = True
        raise
    try:
        return train(plan)
    except Exception as exc:
        if isinstance(exc, UserError) or not watchdog.is_peer_failure(exc):
            raise
        raise watchdog.report(exc) from exc
    finally:
        dist.shutdown()


def steps_of_epochs(plan: RunPlan) -> Options:
    """--epochs -> the options with the steps they make: one pass's packed rows counted (every rank counts the
    same rows; rank 0 says what it found), times the epochs, over the global batch's rows, rounded up."""
    from dstrain.data import epoch_rows, load_tokenizer

    opts, t0 = plan.opts, time.perf_counter()
    tok = load_tokenizer(opts.data.tokenizer, plan.model_folder)
    rows = epoch_rows(opts.data, tok, opts.objective.objective)
    steps = math.ceil(opts.schedule.epochs * rows / plan.global_batch_rows)
    if dist.env_rank() == 0:
        print(
            f"dstrain: --epochs {opts.schedule.epochs:g}: one pass is {rows} rows of {opts.data.seq_len} tokens "
            f"= {rows / plan.global_batch_rows:.1f} steps of {plan.global_batch_rows} rows -> {plural(steps, 'step')} "
            f"(counted in {time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
    schedule = dataclasses.replace(opts.schedule, max_steps=steps)
    # given, so that a DeepSpeed file's total_num_steps does not replace the count
    return dataclasses.replace(opts, schedule=schedule, given=opts.given | {"max_steps"})


def what_trains(plan: RunPlan) -> str:
    """The run's line on what trains: parameters that train and their share, the LoRA modules matched per
    target, the routers and MTP, the sparse-attention stage (and what `auto` resolved to)."""
    from collections import Counter

    opts = plan.opts
    trains, total, adapted = plan.trains
    parts = [f"trains {count(trains)} of {count(total)} parameters ({trains / total:.2%})"]
    if adapted:
        matched = Counter(name.rpartition(".")[2] for name in adapted)
        parts.append(
            f"LoRA r {opts.lora.lora_r} on {len(adapted)} modules ("
            + ", ".join(f"{k} {n}" for k, n in matched.items())
            + ")"
        )
    parts.append(f"routers {'train' if opts.lora.train_router else 'frozen'}")
    if plan.model.num_nextn_predict_layers:
        parts.append(f"MTP {'trains' if opts.lora.train_mtp else 'frozen'}")
    if plan.model.sparse_attention:
        how = "" if "dsa_stage" in opts.given else " (--dsa_stage auto)"
        parts.append(f"sparse attention stage {opts.model.dsa_stage}{how}")
    return "dstrain: " + "; ".join(parts)


def train(plan: RunPlan) -> int:
    """The run of a resolved plan on this process's group (made here when there is none, as under a launcher)
    -> the exit code (PREEMPTED_EXIT_CODE when it stopped early). `run` adds the error policy and ends the group."""
    opts = plan.opts
    model = opts.model.model
    info = dist.init_distributed(opts.run.collective_timeout)
    watchdog.arm(opts.run.collective_timeout)
    output_dir = opts.checkpoint.output_dir or dist.broadcast_object(default_output_dir(plan))
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
        f"{plan.dims.describe()}, ZeRO-{plan.stage}, {plan.precision}, {opts.optimizer.optimizer}, "
        f"global batch {plan.global_batch_rows} x {opts.data.seq_len} tokens, {plural(opts.schedule.max_steps, 'step')}, "
        f"lr {opts.schedule.lr:g} -> {opts.schedule.min_lr:g}"
        + ("" if plan.lr_origin == "given" else f" ({plan.lr_origin}; --lr sets another)"),
        flush=True,
    )
    dtype = torch.bfloat16 if plan.precision == "bf16" else torch.float32
    say(
        "dstrain: kernels: "
        + "; ".join(f"{k}: {v}" for k, v in kernel_paths(plan.model, info.device, dtype).items())
    )
    say(f"dstrain: outputs in {os.path.abspath(output_dir)} ({METRICS_FILE}, checkpoints/, {RESOLVED})")
    if info.is_main and (warning := device_warning(plan, info.device, info.local_world_size)):
        say(warning)
    for note in plan.notes:
        say(f"dstrain: note: {note}")
    if opts.checkpoint.resume == "auto" and resume is None:
        say(f"dstrain: --resume auto: no complete checkpoint in {output_dir}, starting fresh")
    elif resume is not None:
        say(f"dstrain: resuming from {resume}")
    say(what_trains(plan))
    trainer = Trainer(plan, info, resume_path=resume)
    trainer.setup()
    if "bytes_read" in trainer.load_stats:  # loaded from a folder (a fresh model has only bytes_drawn)
        ls = trainer.load_stats
        say(
            f"dstrain: loaded {model}: rank 0 read {size(ls['bytes_read'])} of {size(ls['checkpoint_bytes'])}, "
            f"peak memory +{size(ls['peak_rss_growth'])} while loading"
            + (
                f"; frozen base held as stored: {size(ls['stored_bytes'])} ({plan.precision}: "
                f"{size(ls['dequantized_bytes'])})"
                if "stored_bytes" in ls
                else ""
            )
        )
    summary = trainer.run()
    last = trainer.history[-1] if trainer.history else None
    if last is not None:
        first = trainer.history[0]
        losses = " -> ".join(f"{r['loss']:.4f}" if r["loss"] is not None else "nan" for r in (first, last))
        say(f"dstrain: done at step {summary['step']}: loss {losses}")
    say(f"dstrain: metrics     {os.path.abspath(os.path.join(output_dir, METRICS_FILE))}")
    if summary["checkpoint"]:
        say(f"dstrain: checkpoint  {os.path.abspath(summary['checkpoint'])}")
    if summary["stopped"]:
        return PREEMPTED_EXIT_CODE
    return 0
