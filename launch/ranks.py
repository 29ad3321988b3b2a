"""`torchrun` command lines for the benchmark scripts' multi-rank launches."""

from __future__ import annotations

import socket
import sys


def free_port() -> int:
    """A port nobody listens on now: parallel launches would collide on torchrun's default 29500."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(nproc: int, script: str, *args: str, port: int | None = None) -> list[str]:
    """`python -m torch.distributed.run` starting `nproc` ranks of `script args...` on one machine."""
    port = port or free_port()
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
            script, *args]  # fmt: skip
