"""A rank that hangs or dies: the other exits within --collective_timeout plus a few seconds, with one line naming
it and exit code 76, instead of waiting until the allocation ends. Ranks start as srun starts them (see
test_preempt.py), so rank 0's own exit code and time are seen while rank 1 is still stuck."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from unittest import mock

import pytest

from dstrain.training.watchdog import DIE_ENV, HANG_ENV, PEER_LOST_EXIT_CODE, REPORT_GRACE_S
from tests.training.test_preempt import _start

pytestmark = pytest.mark.multirank
TIMEOUT_S = 10


def _rank0_exit(procs: list[subprocess.Popen], bound: float) -> tuple[int, str, float]:
    """Rank 0's exit code, output and seconds from its step 3 to its exit (rank 1 is killed after)."""
    deadline = threading.Timer(
        240, lambda: [p.kill() for p in procs]
    )  # ends the read below, whatever happens
    deadline.start()
    try:
        seen, t_step3 = [], None
        for line in procs[0].stdout:  # plain lines: stdout is not a TTY
            seen.append(line)
            if line.startswith("step 2/"):  # the next heartbeat starts step 3, where rank 1 stops
                t_step3 = time.monotonic()
                break
        assert t_step3 is not None, "".join(seen)[-3000:]
        rest = procs[0].communicate(timeout=bound)[0]
        return procs[0].returncode, "".join(seen) + rest, time.monotonic() - t_step3
    finally:
        deadline.cancel()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.communicate(timeout=30)


@pytest.fixture(scope="module")
def exits(tmp_path_factory, small_model) -> Iterator[dict[str, Future]]:
    """Both faults' runs side by side (most of each is waiting: the timeout, the report's grace): fault -> the
    future of `_rank0_exit`'s (exit code, output, seconds)."""
    args = ["--model", str(small_model), "--max_steps", "100", "--collective_timeout", str(TIMEOUT_S)]
    out = tmp_path_factory.mktemp("hang")
    waits = ThreadPoolExecutor(2)
    futures = {}
    for fault, env in (("hang", HANG_ENV), ("die", DIE_ENV)):
        with mock.patch.dict(os.environ, {env: "3:1"}):
            procs = _start(out / fault, args)
        bound = (TIMEOUT_S if fault == "hang" else 0) + REPORT_GRACE_S + 10
        futures[fault] = waits.submit(_rank0_exit, procs, bound)
    yield futures
    waits.shutdown()


@pytest.mark.parametrize("fault", ["hang", "die"])
def test_the_others_exit_in_bounded_time_naming_the_rank(fault, exits):
    code, text, took = exits[fault].result()
    lines = [x for x in text.splitlines() if x.startswith("dstrain: error:")]
    print(f"{fault}: rank 0 exited {took:.1f} s after step 2: {lines}")
    assert code == PEER_LOST_EXIT_CODE, text[-3000:]
    how = "stopped responding" if fault == "hang" else "died"
    assert len(lines) == 1 and f"rank 1 {how} in step 3" in lines[0], text[-3000:]
    assert "Traceback" not in text
    if fault == "hang":
        assert f"--collective_timeout {TIMEOUT_S} s" in lines[0]
        assert took >= TIMEOUT_S


def test_collective_timeout_is_a_positive_number_of_seconds():
    from dstrain.config.options import parse_options
    from dstrain.errors import ConfigError

    assert parse_options([]).run.collective_timeout == 600
    assert parse_options(["--collective_timeout", "2.5"]).run.collective_timeout == 2.5
    for bad in ("0", "-1", "inf", "nan"):
        with pytest.raises(ConfigError, match="--collective_timeout"):
            parse_options(["--collective_timeout", bad])
