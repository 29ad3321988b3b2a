"""`dstrain train`: validate everything, then set up the process group, the engine and run the loop."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

from dstrain.data import DataError
from dstrain.model import ModelConfig

from . import checkpoint, dist
from .ds_config import (
    finalize_paths,
    load_ds_config,
    parallel_dims,
    resolve_ds_config,
    resolve_precision,
    write_resolved,
)
from .errors import CheckpointError, ConfigError, UserError
from .options import Options, parse_options
from .trainer import Trainer, model_config_for


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


def validate(argv: list[str]) -> tuple[Options, dict, str]:
    """Everything that needs no process group and allocates nothing: options, recipe, DeepSpeed config."""
    opts = parse_options(argv)
    accel = dist.pick_accelerator()
    world = dist.launcher_world_size()
    _, raw = load_ds_config(opts.train.config)
    cfg = model_config_for(opts)
    precision = resolve_precision(opts.train, raw, accel)
    ds = resolve_ds_config(
        raw, opts.train, world_size=world, precision=precision, hidden_size=cfg.hidden_size
    )
    zero = ds["zero_optimization"]
    offload = (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
    try:
        dims = parallel_dims(ds, world)
        dims.validate(cfg, int(zero.get("stage", 0)), offload=offload)
        if opts.train.lora_r and dims.tp > 1:
            raise ValueError(
                f"--lora_r {opts.train.lora_r} with --tp {dims.tp}: LoRA under tensor parallelism is not supported"
            )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if os.path.isdir(opts.train.model):
        check_model_folder(opts.train.model, cfg)
    return opts, ds, precision


def check_model_folder(path: str, cfg: ModelConfig) -> None:
    """A folder that does not fit its own config.json is a one-line error here, before any process group or
    allocation (headers only: nothing is read)."""
    from dstrain.model.loading import check_folder
    from dstrain.model.reader import HFReader

    try:
        with HFReader(path, cfg) as reader:
            check_folder(reader, cfg)
    except ValueError as exc:
        raise ConfigError(f"--model {path}: {exc}") from None


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


def choose_resume(opts: Options, output_dir: str) -> str | None:
    t = opts.train
    found = checkpoint.resolve_resume(t.resume, output_dir)
    if (
        found is None
        and t.resume is None
        and checkpoint.newest_complete(checkpoint.checkpoint_root(output_dir))
    ):
        raise CheckpointError(
            f"--output_dir {output_dir} already holds checkpoints: pass --resume auto to continue it, "
            "or choose another --output_dir"
        )
    return str(found) if found is not None else None


def run(argv: list[str]) -> int:
    opts, ds, precision = validate(argv)
    t = opts.train
    info = dist.init_distributed()
    output_dir = t.output_dir or dist.broadcast_object(default_output_dir(t.model))
    resume = dist.agree(lambda: choose_resume(opts, output_dir))
    say = print if info.is_main else (lambda *a, **k: None)
    if info.is_main:
        os.makedirs(output_dir, exist_ok=True)
    finalize_paths(ds, output_dir)
    resolved = os.path.join(output_dir, "ds_config.resolved.json")
    if info.is_main:
        write_resolved(ds, output_dir)
    dist.barrier()
    stage = ds["zero_optimization"].get("stage", 0)
    say(
        f"dstrain: {t.model} on {info.world_size} x {info.device.type} ({info.backend}), "
        f"{parallel_dims(ds, info.world_size).describe()}, ZeRO-{stage}, {precision}, "
        f"global batch {ds['train_batch_size']} x {opts.data.seq_len} tokens, {t.max_steps} steps",
        flush=True,
    )
    say(
        f"dstrain: outputs in {os.path.abspath(output_dir)} (metrics.jsonl, checkpoints/, {os.path.basename(resolved)})"
    )
    if t.resume == "auto" and resume is None:
        say(f"dstrain: --resume auto: no complete checkpoint in {output_dir}, starting fresh")
    elif resume is not None:
        say(f"dstrain: resuming from {resume}")
    trainer = Trainer(opts, info, ds, output_dir, resume_path=resume)
    trainer.setup()
    if trainer.load_stats:
        ls = trainer.load_stats
        say(
            f"dstrain: loaded {t.model}: rank 0 read {size(ls['bytes_read'])} of {size(ls['checkpoint_bytes'])}, "
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
    except (UserError, DataError) as exc:
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
    finally:
        _shutdown()


def _shutdown() -> None:
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        with contextlib.suppress(Exception):  # best effort at exit
            tdist.destroy_process_group()
