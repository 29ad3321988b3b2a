"""Installed, not cloned: the wheel built from this tree, installed into a fresh virtual environment (its
dependencies are this environment's, made visible by a path file, so nothing is downloaded), runs `dstrain
train` on its defaults (the shipped DeepSpeed configs and text, package data), `dstrain export` and
`dstrain plot` from a directory outside the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

import pytest

from tests.helpers.tiny import ROOT


@pytest.mark.multirank  # several processes, a minute of CPU
def test_wheel_runs_train_export_and_plot_outside_the_checkout(tmp_path):
    wheels, venv, work = tmp_path / "wheels", tmp_path / "venv", tmp_path / "elsewhere"
    work.mkdir()

    def run(cmd: list, cwd=ROOT, timeout: int = 300) -> subprocess.CompletedProcess:  # noqa: ANN001
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        # The dependencies' ninja too (pip's, beside this interpreter; the new environment has none of its own):
        # DeepSpeed's JIT-built ops then come from the cache this checkout's runs use (dstrain/dist.py)
        path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PATH=path)
        proc = subprocess.run(
            [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
        assert proc.returncode == 0, (cmd, proc.stdout[-2000:], proc.stderr[-4000:])
        return proc

    pip = [sys.executable, "-m", "pip"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, ROOT])
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    with open(os.path.join(site, "dependencies.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    (wheel,) = wheels.glob("dstrain-*.whl")
    run([*pip, "--python", python, "install", "--no-deps", "-q", wheel])
    where = run([python, "-c", "import dstrain; print(dstrain.__file__)"], cwd=work).stdout
    assert where.startswith(site), where

    dstrain = venv / "bin" / "dstrain"
    train = run([dstrain, "train", "--max_steps", "2", "--output_dir", "run"], cwd=work)
    assert "dstrain: done at step 2" in train.stdout, train.stdout
    assert (work / "run" / "ds_config.resolved.json").is_file()
    run([dstrain, "export", "run", "--out", "hf"], cwd=work)  # --verify: tests/checkpoint/test_export.py
    assert (work / "hf" / "config.json").is_file()
    run([dstrain, "plot", "run"], cwd=work)
    assert (work / "run" / "plots" / "loss.png").is_file()


def test_installing_keeps_an_in_range_torch_that_is_there(tmp_path):
    """`pip install dstrain` next to a torch in the tested range (a GPU cluster's) resolves to dstrain alone:
    torch stays, nothing is fetched (--no-index). Here the oldest tested torch, a real one where this
    environment holds it (.venv-oldest), else its metadata in a fresh environment that sees this one's packages
    behind it: what pip decides from."""
    import json

    from dstrain import versions

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    with open(os.path.join(site, "dependencies.pth"), "w") as f:
        f.write("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    oldest = versions.TESTED["torch"][0] + ".0"
    here = versions.installed("torch")
    if versions.release(here) != versions.release(oldest):
        info = os.path.join(site, f"torch-{oldest}.dist-info")
        os.mkdir(info)
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: torch\nVersion: {oldest}\n")
        here = oldest
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_CONSTRAINT")}
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--dry-run", "--no-index", "--no-build-isolation",
         "--isolated", "-q", "--report", report, ROOT],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    chosen = {
        item["metadata"]["name"]: item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert chosen == {"dstrain": "0.1.0"}, chosen
    seen = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert seen == here
