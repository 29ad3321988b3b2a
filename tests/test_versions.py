"""The tested version ranges (dstrain/versions.py) are the ones pyproject.toml requires, and the ones this
environment holds."""

from __future__ import annotations

import re

import pytest

from dstrain import versions
from tests.helpers.tiny import ROOT

tomllib = pytest.importorskip("tomllib")


def _requirements() -> dict[str, str]:
    """pyproject's requirements (dependencies and the dev extra) by package name, markers dropped."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = project["dependencies"] + project["optional-dependencies"]["dev"]
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower(): r.split(";")[0].strip() for r in listed}


def test_pyproject_requires_exactly_the_tested_ranges():
    required = _requirements()
    assert {p: required.get(p) for p in versions.TESTED} == {
        p: versions.requirement(p) for p in versions.TESTED
    }
    assert versions.in_range("torch", versions.CPU_WHEEL_TORCH)


def test_this_environment_is_in_the_tested_ranges():
    """What the suite runs on is what the ranges claim (on .venv the newest end, on .venv-oldest the oldest)."""
    assert versions.outside_tested() == []


@pytest.mark.parametrize(
    ("version", "inside"),
    [("2.11.0+cu130", True), ("2.13.0+cpu", True), ("2.13.9", True), ("2.10.2", False), ("2.14.0", False),
     ("2.14.0.dev20260101", False)],
)  # fmt: skip
def test_torch_range_reads_builds_and_local_labels(version, inside):
    assert versions.in_range("torch", version) is inside


def test_a_version_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="not a version"):
        versions.release("cuda")


def test_the_command_launch_setup_reads_before_dstrain_is_installed():
    """launch/setup.sh keeps the venv's torch where `torch` exits 0, else installs `--cpu-wheel`'s; standard
    library only (-S -I: no site-packages, no dstrain)."""
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-S", "-I", str(ROOT / "dstrain" / "versions.py"), *args],
                              capture_output=True, text=True)  # fmt: skip

    assert run("--cpu-wheel").stdout == f"torch=={versions.CPU_WHEEL_TORCH}\n"
    assert run("--oldest").stdout.split() == ["torch==2.11.*", "triton==3.6.*", "transformers==5.23.*"]
    assert run("bogus").returncode == 2
    # without site-packages no torch is installed: the venv gets the CPU wheel
    assert run("torch").returncode == 1
    in_range = subprocess.run([sys.executable, str(ROOT / "dstrain" / "versions.py"), "torch"])
    assert in_range.returncode == 0
