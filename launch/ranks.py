"""`torchrun` command lines for the benchmark scripts' multi-rank launches."""

from __future__ import annotations

import sys

from dstrain.dist import free_port  # below the ephemeral range: an outgoing connection cannot take it first


def torchrun(nproc: int, script: str, *args: str, port: int | None = None) -> list[str]:
    """`python -m torch.distributed.run` starting `nproc` ranks of `script args...` on one machine."""
    port = port or free_port()
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
            script, *args]  # fmt: skip
