"""dstrain/dist.py outside a process group (the group itself: every multi-rank test)."""

from __future__ import annotations

import os
import sys

from dstrain import dist


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
