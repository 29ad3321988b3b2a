"""The `dstrain` console script and the one command-line policy every subcommand runs under (`invoke`):

- a user's mistake (`UserError`: a flag, a config, a path, data, a checkpoint) is one line
  `dstrain: error: ...` on stderr and the error's exit code, never a traceback unless `--debug` is given
  (on the command line or, for `dstrain train`, in a recipe: it is read from the parsed options);
- an error every rank of a multi-rank job raises alike is printed once (rank 0), one that a single rank hit
  names that rank (the other ranks give rank 0 the time to print: `REPORT_GRACE_S`);
- Ctrl-C where training does not take it (training/preempt.py: the first stops with a checkpoint) is one
  line and exit 130, as the shell reports an interrupted command;
- anything else is a bug and keeps its traceback.

Each subcommand's module has `parse(argv)` and `run(args) -> int`; they are imported lazily so that
`dstrain --help` is fast."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from dstrain import collector, dist
from dstrain.errors import UserError

# A launcher (deepspeed, torchrun) ends the whole job once any rank exits with an error: a rank other than 0
# that exited at once could take rank 0 down before it printed the line it alone prints (seen under load: the
# job failed with no message). Those ranks wait this long instead (the launcher ends them when rank 0 exits),
# then print the line themselves, naming their rank (rank 0 never got there, or the launcher lets ranks run on).
REPORT_GRACE_S = 10.0

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for a command Ctrl-C ended

# name -> (module with `parse(argv)` and `run(args) -> int`, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "env": ("dstrain.env", "what this machine can run: torch/CUDA, GPUs, NCCL, kernels, DeepSpeed ops"),
    "train": ("dstrain.training.cli", "train a model (same as `python dstrain/train.py`)"),
    "data": ("dstrain.data.cli", "inspect data: `dstrain data audit`, `dstrain data stats`"),
    "plan": (
        "dstrain.memory.planner",
        "predicted peak memory per GPU of a run, a fits / does-not-fit verdict, the layouts that fit",
    ),
    "smoke": ("dstrain.model.smoke", "forward/backward/step of a preset model on random tokens"),
    "export": (
        "dstrain.checkpoint.export",
        "checkpoint -> Hugging Face folder (LoRA merged) or PEFT adapter, --verify",
    ),
    "plot": (
        "dstrain.training.plots",
        "PNG plots of a run (loss, lr, grad norm, speed, expert load) into RUN_DIR/plots/",
    ),
}


def invoke(
    parse: Callable[[list[str]], Any],
    run: Callable[[Any], int | None],
    argv: list[str],
    preload: tuple[str, ...] = (),
) -> int:
    """Parse, then run, under the policy above; -> the exit code. `preload`: modules the run will import, imported
    once the arguments parsed (not for --help or a mistake) and frozen with the process's start (collector.py)."""
    debug = "--debug" in argv
    parsed = False
    try:
        args = parse(argv)
        parsed = True
        debug = bool(getattr(args, "debug", debug))
        if preload:
            with collector.paused(freeze=True):
                for name in preload:
                    importlib.import_module(name)
        return int(run(args) or 0)
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        if dist.env_rank() == 0:
            print("dstrain: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT_CODE
    except UserError as exc:
        if debug:
            traceback.print_exc()
        rank, everywhere = dist.env_rank(), not parsed or exc.all_ranks
        line = error_line(exc, rank, everywhere)
        if line is None and str(exc) and dist.launcher_world_size() > 1:
            time.sleep(REPORT_GRACE_S)
            line = f"dstrain: error (rank {rank}): {exc}"
        if line:
            print(line, file=sys.stderr, flush=True)
        return exc.exit_code


def error_line(exc: UserError, rank: int, everywhere: bool) -> str | None:
    """What this rank prints for `exc`: errors all ranks raise alike only on rank 0; an error that only this
    rank knows about with its rank; nothing for an error already reported (an empty message)."""
    if not str(exc) or (everywhere and rank != 0):
        return None
    where = f" (rank {rank})" if rank != 0 and exc.names_rank else ""
    return f"dstrain: error{where}: {exc}"


def run_command(name: str, argv: list[str], start: bool = False) -> int:
    """Run a subcommand; `start`: the process's own command line, whose imports (with the modules the command
    will import later, its PRELOAD) are frozen (dstrain/collector.py)."""
    if start:  # not for a call from Python: its environment stays the caller's
        dist.settle_accelerator_env()
    with collector.paused(freeze=start):
        module = importlib.import_module(SUBCOMMANDS[name][0])
    return invoke(module.parse, module.run, argv, getattr(module, "PRELOAD", ()) if start else ())


def main(argv: list[str] | None = None) -> int:
    start = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="dstrain",
        description="Train DeepSeek-style MoE language models with DeepSpeed.",
        epilog="Run `dstrain COMMAND --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] not in SUBCOMMANDS:
        print(
            f"dstrain: error: unknown command {argv[0]!r}; choose from {', '.join(SUBCOMMANDS)}",
            file=sys.stderr,
        )
        return 2
    return run_command(argv[0], argv[1:], start)


def exit_process(code: int) -> NoReturn:
    """End this process with `code` as the interpreter's own exit would — its non-daemon threads joined, the
    atexit handlers run (logging, wandb, multiprocessing's children, weakref finalizers), stdout and stderr
    flushed — but without its teardown: the garbage collection of every object left and the modules' teardown
    that follows took 1.2-1.4 CPU-s after a tiny run (this exit: 0.4, the kernel freeing the memory), and in it
    gloo's or the profiler's threads can still abort a finished run. For a program's entry point only: the code
    after it never runs."""
    with contextlib.suppress(AttributeError):
        threading._shutdown()  # what Python's exit does first: join non-daemon threads and thread pools
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def console() -> NoReturn:
    """The `dstrain` program (and `python -m dstrain`): `main` on the process's command line, then its exit."""
    exit_process(main())


if __name__ == "__main__":
    console()
