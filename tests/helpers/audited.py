"""`dstrain/train.py` with every file this process writes logged (Python's audit hook for open and rename, and
wrappers around torch.save and safetensors' save_file, which write from native code): the multi-node test
checks that no file is written by two ranks. The log goes to $DSTRAIN_WRITE_LOG.rank<RANK>."""

from __future__ import annotations

import os
import runpy
import sys

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND


def main() -> None:
    log = open(f"{os.environ['DSTRAIN_WRITE_LOG']}.rank{os.environ['RANK']}", "w", buffering=1)  # noqa: SIM115

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & WRITE_FLAGS
            )
            if writing and isinstance(path, (str, bytes, os.PathLike)):
                log.write(os.path.abspath(os.fsdecode(path)) + "\n")
        elif event in ("os.rename", "os.replace"):
            log.write(os.path.abspath(os.fsdecode(args[1])) + "\n")

    sys.addaudithook(hook)
    # torch.save and safetensors write from C++ / Rust, past the audit hook: log their targets here.
    import safetensors.torch
    import torch

    def logged(fn):  # noqa: ANN001, ANN202
        def write(obj, target, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if isinstance(target, (str, os.PathLike)):
                log.write(os.path.abspath(os.fspath(target)) + "\n")
            return fn(obj, target, *args, **kwargs)

        return write

    torch.save = torch.serialization.save = logged(torch.save)
    safetensors.torch.save_file = logged(safetensors.torch.save_file)
    sys.argv = ["dstrain/train.py", *sys.argv[1:]]
    runpy.run_path("dstrain/train.py", run_name="__main__")


if __name__ == "__main__":
    main()
