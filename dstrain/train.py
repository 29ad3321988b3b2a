"""Entry point: `deepspeed dstrain/train.py ...`, `torchrun ... dstrain/train.py ...`, `python dstrain/train.py`,
`accelerate launch ... dstrain/train.py ...`, or `dstrain train ...` (which calls main())."""

from __future__ import annotations

import os
import sys

# Run as a file, Python puts dstrain/ first on sys.path, where `data`, `model`, `training`... would shadow
# top-level packages of the same names; drop it, and find the package from a checkout that is not installed.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or os.getcwd()) == _HERE:
    sys.path.pop(0)
    if os.path.dirname(_HERE) not in sys.path:
        sys.path.append(os.path.dirname(_HERE))


# Routing changes the expert buffers' sizes every step: expandable segments keep the CUDA caching allocator
# from fragmenting (set before torch initialises CUDA; a user's own setting wins).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def main(argv: list[str] | None = None) -> int:
    from dstrain.cli import run_command

    return run_command("train", list(sys.argv[1:] if argv is None else argv), start=argv is None)


if __name__ == "__main__":
    from dstrain.cli import exit_process

    exit_process(main())
