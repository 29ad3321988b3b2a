"""The pool of ranks the multi-rank tests run their scenarios in (tests/helpers/pool.py): a scenario that raises
on one rank, and one that outlives its timeout, each fail alone with their own message, and the next scenario
runs in a fresh pool; what a scenario leaves (its engines, their process groups) ends with it."""

from __future__ import annotations

import time

import pytest

from tests.helpers.pool import Pools, ScenarioError

pytestmark = pytest.mark.multirank
PROBES = "tests.helpers.probes"


def test_a_failing_scenario_fails_alone_and_the_next_one_passes(tmp_path):
    # a pool of its own: its restarts cost bare ranks (the probes import no DeepSpeed), and the session's pool
    # stays warm for the other tests
    pools = Pools(tmp_path)
    try:
        _fail_alone(pools)
    finally:
        pools.close()


def _fail_alone(rank_pools: Pools) -> None:
    assert rank_pools.run(2, f"{PROBES}:rank_sum", 10) == [21, 21]
    pool = rank_pools.pools[2]
    starts = pool.starts
    with pytest.raises(ScenarioError) as info:
        rank_pools.run(2, f"{PROBES}:raises_on", 1, "the scenario's own message")
    text = str(info.value)
    assert "rank 1 raised" in text and "ValueError: the scenario's own message" in text
    # rank 0 waited for rank 1 in the all-reduce: it raised when rank 1 left, or was killed; not left hanging
    assert "rank 0 raised" in text or "rank 0: no reply" in text
    assert rank_pools.run(2, f"{PROBES}:rank_sum", 1) == [3, 3] and pool.starts == starts + 1

    t0 = time.monotonic()
    with pytest.raises(ScenarioError, match=r"rank 0: no reply after 2 s \(killed; the timeout: 2 s\)"):
        rank_pools.run(2, f"{PROBES}:sleeps", 600, timeout=2)
    assert time.monotonic() - t0 < 30
    assert rank_pools.run(2, f"{PROBES}:rank_sum", 2) == [5, 5] and pool.starts == starts + 2


def test_an_engine_and_its_process_group_end_with_their_scenario(rank_pools):
    """The reset between scenarios ends the engines a scenario left, and what DeepSpeed keeps of a ZeRO-3 one:
    none lives on with its groups' threads (each left one would, frozen: the ranks reached MAX_THREADS and
    restarted every few layouts)."""
    # each rank's thread count at the start of each of 3 scenarios
    threads = [rank_pools.run(2, f"{PROBES}:engine_with_a_group") for _ in range(3)]
    assert threads[2] == threads[1], threads
