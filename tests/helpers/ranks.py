"""Processes of the tests' own: the multi-rank launcher (torchrun on CPU, gloo, a free port per launch) and a fresh
Python, each in a bounded time."""

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


def run_python(
    code: str, env: dict[str, str] | None = None, timeout: int = 120
) -> subprocess.CompletedProcess:
    """`python -c code` in a fresh interpreter from the repository root (environment `env`, default this one's),
    its output captured as text."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
