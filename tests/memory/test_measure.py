"""The allocation tracker (dstrain/memory/measure.py) on known allocations, and the memory estimate against the
peak measured on this machine: launch/bench_plan.py's measurement on 2 ranks (in the test session's pool,
tests/memory/worker.py) trains every layout there (ZeRO-1/2/3, PP2, TP2, EP2, with and without activation
checkpointing, fp32 and bf16) under the allocation tracker; every rank's prediction is within 15% of its
measured peak; DeepSeek-V4, Kimi Linear and GLM-5.3-Flash likewise on one rank (tests/memory/worker.py
V4_LAYOUTS, KIMI_LAYOUTS, GLM_LAYOUTS)."""

from __future__ import annotations

import sys

import pytest

from tests.helpers.tiny import ROOT


def test_the_tracker_counts_what_a_block_allocates_by_phase():
    import torch

    from dstrain.memory.measure import AllocationTracker

    mib = 1 << 20
    before = torch.ones(mib // 4)  # alive before the block: not counted, nor is its free
    with AllocationTracker() as tracker:
        with tracker.phase("one"):
            a = torch.ones(mib // 4)  # 1 MiB, kept
            t = torch.ones(2 * mib // 4)  # 2 MiB, freed within the phase
            del t
        with tracker.phase("two"):
            b = torch.ones(mib // 4) + a  # a 1 MiB result: the ones() temporary is 1 MiB more
            del a, before
    one, two = tracker.phases
    assert (one.name, one.start_bytes, one.peak_bytes) == ("one", 0, 3 * mib)
    assert (two.name, two.start_bytes, two.peak_bytes) == ("two", mib, 3 * mib)
    assert tracker.peak_bytes == 3 * mib and tracker.end_bytes == mib
    assert b.numel() == mib // 4


@pytest.mark.multirank
def test_predicted_peak_is_within_15_percent_of_the_measured_one(rank_pools):
    sys.path.insert(0, str(ROOT / "launch"))
    from bench_plan import LAYOUTS, table

    per_rank = rank_pools.run(2, "tests.memory.worker:measured", list(LAYOUTS), timeout=600)
    assert set(per_rank[0]) == set(LAYOUTS)
    errors = {
        (name, rank): res[name]["predicted"] / res[name]["measured"] - 1
        for rank, res in enumerate(per_rank)
        for name in res
    }
    assert max(abs(e) for e in errors.values()) <= 0.15, table(per_rank)


@pytest.mark.multirank
def test_deepseek_v4_predicted_peak_is_within_15_percent_of_the_measured_one(rank_pools):
    """DeepSeek-V4 (tests/memory/worker.py's v4_config: mHC streams, CSA with its learning indexer, HCA, a
    sliding layer, hash and biased MoE, MTP) on one rank, measured as bench_plan measures, without and with
    full checkpointing."""
    sys.path.insert(0, str(ROOT / "launch"))
    from bench_plan import table

    from tests.memory.worker import V4_LAYOUTS

    per_rank = rank_pools.run(1, "tests.memory.worker:measured_v4", list(V4_LAYOUTS), timeout=300)
    errors = {name: r["predicted"] / r["measured"] - 1 for name, r in per_rank[0].items()}
    print(table(per_rank))
    assert set(errors) == set(V4_LAYOUTS) and max(abs(e) for e in errors.values()) <= 0.15, table(per_rank)


@pytest.mark.multirank
def test_kimi_linear_predicted_peak_is_within_15_percent_of_the_measured_one(rank_pools):
    """Kimi Linear (tests/memory/worker.py's kimi_config: KDA's chunked delta rule, NoPE MLA, a dense MLP and
    MoE) on one rank, measured as bench_plan measures, without and with full checkpointing."""
    sys.path.insert(0, str(ROOT / "launch"))
    from bench_plan import table

    from tests.memory.worker import KIMI_LAYOUTS

    per_rank = rank_pools.run(1, "tests.memory.worker:measured_kimi", list(KIMI_LAYOUTS), timeout=300)
    errors = {name: r["predicted"] / r["measured"] - 1 for name, r in per_rank[0].items()}
    print(table(per_rank))
    assert set(errors) == set(KIMI_LAYOUTS) and max(abs(e) for e in errors.values()) <= 0.15, table(per_rank)


@pytest.mark.multirank
def test_glm5_next_predicted_peak_is_within_15_percent_of_the_measured_one(rank_pools):
    """GLM-5.3-Flash (tests/memory/worker.py's glm_config: mHC streams, KDA with the bounded gate, DSA with the
    k-pool indexer learning, shared selection, clamped MoE, MTP) on one rank, measured as bench_plan measures,
    in bf16 with full checkpointing."""
    sys.path.insert(0, str(ROOT / "launch"))
    from bench_plan import table

    from tests.memory.worker import GLM_LAYOUTS

    per_rank = rank_pools.run(1, "tests.memory.worker:measured_glm", list(GLM_LAYOUTS), timeout=300)
    errors = {name: r["predicted"] / r["measured"] - 1 for name, r in per_rank[0].items()}
    print(table(per_rank))
    assert set(errors) == set(GLM_LAYOUTS) and max(abs(e) for e in errors.values()) <= 0.15, table(per_rank)
