"""The `dstrain` console script. Subcommands import their module lazily so `dstrain --help` is fast."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with a `main(argv) -> int` function, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("dstrain.train", "train a model (same as `python dstrain/train.py`)"),
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


def main(argv: list[str] | None = None) -> int:
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
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        parser.error(f"unknown command {name!r}; choose from {', '.join(SUBCOMMANDS)}")
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
