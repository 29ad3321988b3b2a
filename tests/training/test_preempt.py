"""Preemption: SIGTERM to one rank (again and again, so some arrive during the save), SIGTERM or SIGUSR1 to every
process of the run (DataLoader workers included, as scancel, a time limit and SLURM's --signal send them; one
worker SIGKILLed on top) or --time_limit stops every rank after the same step with a complete checkpoint and
exit code 75, and the run resumed from it logs the uninterrupted run's losses bit for bit. Ranks start the way
launch/slurm.sbatch's srun starts them (one process each, SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID), so each
rank's own exit code is seen. (Not torchrun: it starts each rank in a session of its own, exits 1 on SIGTERM
whatever the ranks return, after forwarding it, and dies of SIGUSR1, which it does not handle.) The straight run,
the resumed ones and the time limit, which take no signal, run the command's training in the session's pool of
ranks. The runs train the session's small model (conftest.py), whose save takes tens of milliseconds: the signal
repeated to one rank comes every 5 ms, so that some still arrive during the save."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from dstrain.data.loader import WORKER_IGNORED_SIGNALS
from dstrain.training.preempt import CTRL_C_LINE, PREEMPTED_EXIT_CODE, SIGNALS
from tests.helpers.ranks import free_port
from tests.helpers.tiny import ROOT

pytestmark = pytest.mark.multirank
ARGS = [
    "--seq_len",
    "32",
    "--micro_batch_size",
    "2",
    "--save_every",
    "0",
    "--log_every",
    "1",
    "--keep_last",
    "0",
]
ARGS += ["--no-plots", "--no-tensorboard", "--num_workers", "0"]
# Steps of a run: at least 14 left after the signals start, so a rank cannot finish before they arrive on a
# busy machine (a step of the small model takes tens of milliseconds)
STEPS = 20


def _start(out, extra: list[str], group: bool = False) -> list[subprocess.Popen]:
    """Both ranks; `group`: in a process group of their own (rank 0's pid), workers included."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank))  # as srun sets them
        cmd = [sys.executable, "dstrain/train.py", *ARGS, "--output_dir", str(out), *extra]
        where = {"process_group": procs[0].pid if procs else 0} if group else {}
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **where
            )
        )
    return procs


def _finish(procs: list[subprocess.Popen], timeout: float = 300) -> tuple[list[int], str]:
    """Exit codes, and rank 0's output followed by the other ranks' (stdout and stderr together)."""
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [p.returncode for p in procs], outs[0] + "".join(
        f"\n--- rank {r}:\n{o}" for r, o in enumerate(outs[1:], 1)
    )


def _losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _resume(pools, out, extra: list[str]) -> None:
    """The run in `out` continued with --resume auto to its end, on the pool's 2 ranks."""
    codes = pools.run(
        2, "tests.training.worker:cli_run", [*ARGS, "--output_dir", str(out), *extra, "--resume", "auto"]
    )
    assert codes == [0, 0]


@pytest.fixture(scope="module")
def model(small_model) -> list[str]:
    """The flags of the session's small model, which every run of this module trains."""
    return ["--model", str(small_model)]


@pytest.fixture(scope="module")
def run_flags(model) -> list[str]:
    """A whole run's flags: the small model for STEPS steps."""
    return [*model, "--max_steps", str(STEPS)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, rank_pools, run_flags) -> list[float]:
    """The uninterrupted STEPS steps' losses (no DataLoader workers: any --num_workers gives the same rows)."""
    out = tmp_path_factory.mktemp("straight")
    assert rank_pools.run(
        2,
        "tests.training.worker:cli_run",
        [*ARGS, *run_flags, "--output_dir", str(out)],
    ) == [0, 0]
    return _losses(out)


def test_signal_to_one_rank_stops_all_with_a_checkpoint_and_resume_is_exact(
    straight, run_flags, rank_pools, tmp_path
):
    run = tmp_path / "run"
    procs = _start(run, run_flags)
    when = random.Random(os.getpid()).randint(2, 6)
    seen = []
    for line in procs[0].stdout:  # rank 0 prints the steps; rank 1 gets the signals
        seen.append(line)
        if line.startswith(f"step {when}/"):
            break
    deadline = time.monotonic() + 120
    while procs[1].poll() is None and time.monotonic() < deadline:
        procs[1].send_signal(signal.SIGTERM)  # repeated: later ones arrive during the save
        time.sleep(0.005)
    codes, text = _finish(procs)
    text = "".join(seen) + text
    assert codes == [PREEMPTED_EXIT_CODE] * 2, text[-3000:]
    assert "stopped after step" in text and "a signal to another rank" in text
    stopped = (run / "checkpoints" / "latest").read_text().strip()
    step = int(stopped.split("_")[1])
    assert when <= step < STEPS and (run / "checkpoints" / stopped / "COMPLETE").is_file()

    _resume(rank_pools, run, run_flags)
    assert _losses(run) == straight


def test_time_limit_stops_before_it_is_up(tmp_path, model, rank_pools):
    """--time_limit needs no signal: the command's run on the pool's 2 ranks (its output captured)."""
    out = tmp_path / "limited"
    t0 = time.monotonic()
    args = [*ARGS, *model, "--output_dir", str(out), "--max_steps", "100000", "--time_limit", "0.1"]
    ranks = rank_pools.run(2, "tests.training.worker:cli_out", args)
    text = "".join(r["stdout"] + r["stderr"] for r in ranks)
    assert [r["rc"] for r in ranks] == [PREEMPTED_EXIT_CODE] * 2, text[-3000:]
    assert "(--time_limit)" in text
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert (out / "checkpoints" / latest / "COMPLETE").is_file()
    assert time.monotonic() - t0 < 120


def _workers_of(pid: int) -> list[int]:
    """The DataLoader worker processes of process `pid` (torch names them pt_data_worker)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{entry}/stat").read()  # noqa: SIM115 - /proc reads
            comm = open(f"/proc/{entry}/comm").read().strip()  # noqa: SIM115
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and comm == "pt_data_worker":
            found.append(int(entry))
    return found


# SIGTERM to the group with a worker SIGKILLed covers SIGTERM to the group alone; SIGINT to the group is Ctrl-C
@pytest.mark.parametrize(("sig", "kill_worker"), [("SIGUSR1", False), ("SIGTERM", True), ("SIGINT", False)])
def test_signal_to_every_process_stops_with_a_checkpoint_and_resume_is_exact(
    sig, kill_worker, straight, run_flags, rank_pools, tmp_path
):
    """scancel, a time limit and --signal signal every process of the job step, the ranks' DataLoader workers
    included (here: the ranks' process group), as Ctrl-C in a terminal does: the workers leave it to their
    rank, and a worker killed anyway once the rank has its signal (SIGKILLed here) changes nothing. Ctrl-C is
    said in one line (rank 0's)."""
    assert set(WORKER_IGNORED_SIGNALS) == set(SIGNALS)
    run = tmp_path / "run"
    flags = [*run_flags, "--num_workers", "1"]
    procs = _start(run, flags, group=True)
    seen = []
    for line in procs[0].stdout:
        seen.append(line)
        if line.startswith("step 3/"):
            break
    os.killpg(procs[0].pid, getattr(signal, sig))
    if kill_worker:
        workers = _workers_of(procs[1].pid)
        assert workers, "no DataLoader worker found"
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
    codes, text = _finish(procs)
    text = "".join(seen) + text
    assert codes == [PREEMPTED_EXIT_CODE] * 2, text[-3000:]
    assert f"({sig})" in text and "Traceback" not in text, text[-3000:]
    assert text.count(CTRL_C_LINE.strip()) == (sig == "SIGINT"), text[-3000:]
    stopped = (run / "checkpoints" / "latest").read_text().strip()
    assert 3 <= int(stopped.split("_")[1]) < STEPS and (run / "checkpoints" / stopped / "COMPLETE").is_file()

    _resume(rank_pools, run, flags)
    assert _losses(run) == straight  # with a worker per rank: the same rows


def test_second_ctrl_c_stops_at_once_without_a_traceback(model, tmp_path):
    """Ctrl-C twice (to the process group, as a terminal sends it): the first starts the stop with a save, the
    second ends the rank at once by SIGINT's default action (the shell's exit 130), no traceback; one rank.
    A step of 64 micro batches lasts long enough (about a second) for the second to come inside it."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flags = [
        *ARGS,
        *model,
        "--output_dir",
        str(out),
        "--max_steps",
        "1000",
        "--gradient_accumulation_steps",
        "64",
    ]
    proc = subprocess.Popen(
        [sys.executable, "dstrain/train.py", *flags],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        process_group=0,
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step 1/"):
            os.killpg(proc.pid, signal.SIGINT)
        if line.startswith("dstrain: Ctrl-C"):
            os.killpg(proc.pid, signal.SIGINT)
            break
    t0 = time.monotonic()
    text = "".join(seen) + proc.communicate(timeout=60)[0]
    assert proc.returncode == -signal.SIGINT and time.monotonic() - t0 < 30, text[-3000:]
    assert text.count(CTRL_C_LINE.strip()) == 1 and "Traceback" not in text, text[-3000:]
    assert not (out / "checkpoints" / "latest").exists()  # ended inside the step: nothing saved
