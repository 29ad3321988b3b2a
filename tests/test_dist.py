"""dstrain/dist.py outside a process group (the group itself: every multi-rank test)."""

from __future__ import annotations

import os
import socket
import sys

from dstrain import dist
from tests.helpers.ranks import run_python


def test_jit_ops_are_built_with_this_environments_ninja(monkeypatch, tmp_path):
    """pip's ninja beside the interpreter goes first on PATH, once; an environment without one leaves PATH alone
    (two ninja versions rebuild each other's DeepSpeed ops: see use_this_environments_ninja)."""
    here = tmp_path / "venv" / "bin"
    here.mkdir(parents=True)
    (here / "ninja").touch()
    monkeypatch.setattr(sys, "executable", str(here / "python"))
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", "/bin"]))
    dist.use_this_environments_ninja()
    dist.use_this_environments_ninja()
    assert os.environ["PATH"] == os.pathsep.join([str(here), "/usr/bin", "/bin"])
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bare" / "bin" / "python"))
    monkeypatch.setenv("PATH", "/usr/bin")
    dist.use_this_environments_ninja()
    assert os.environ["PATH"] == "/usr/bin"


def test_a_one_rank_run_picks_another_port_when_its_own_is_taken(tmp_path):
    """A one-rank run chooses its MASTER_PORT itself; when that port is taken before the group binds it (other
    processes' connections draw from the same ephemeral range) it picks another instead of failing. On gloo the
    group comes without DeepSpeed's shared-memory all-reduce (built and loaded for its inference engine alone),
    and without its line on stdout."""
    code = """
import socket
from dstrain import dist
import os
import torch.distributed as tdist
busy = socket.socket(); busy.bind(("", 0)); busy.listen()
taken = busy.getsockname()[1]
ports = iter([taken])
real = dist.free_port
dist.free_port = lambda: next(ports, None) or real()
info = dist.init_distributed()
from deepspeed.comm import comm
print("world", info.world_size, tdist.is_initialized(), os.environ["MASTER_PORT"] != str(taken))
print("shm op", comm.cdb.shm_comm_op)
"""
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    proc = run_python(code, env)
    assert proc.returncode == 0 and "world 1 True True" in proc.stdout, proc.stderr[-2000:]
    assert "shm op None" in proc.stdout and "shm_comm" not in proc.stdout, proc.stdout


def test_a_free_port_is_below_the_ephemeral_range_and_bindable():
    """Outgoing connections take ephemeral ports: a port picked there can be taken before the store binds it."""
    low = dist._ephemeral_low()
    ports = {dist.free_port() for _ in range(20)}
    assert len(ports) > 10  # random, not a sequence that concurrent launches would share
    for port in ports:
        assert (low - 10000 <= port < low) if low > 11024 else port > 0
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
