"""The multi-rank launcher of the tests: torchrun on CPU (gloo), a free port per launch, a bounded time."""

from __future__ import annotations

import os
import subprocess
import sys

from dstrain.dist import free_port
from tests.helpers.tiny import ROOT


def launch(
    args: list[str],
    nproc: int = 2,
    port: int | None = None,
    env: dict[str, str] | None = None,
    timeout: int = 300,
) -> subprocess.CompletedProcess:
    """torchrun with a bounded time; OMP_NUM_THREADS=1 so two ranks share two cores."""
    port = port or free_port()
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", **(env or {})}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(port),
        *args,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
