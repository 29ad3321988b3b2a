"""The memory estimate against the peak measured on this machine: one 2-rank launch of launch/bench_plan.py
trains every layout there (ZeRO-1/2/3, PP2, TP2, EP2, with and without activation checkpointing, fp32 and
bf16) under the allocation tracker; every rank's prediction is within 15% of its measured peak."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers.ranks import launch
from tests.helpers.tiny import ROOT

pytestmark = pytest.mark.multirank


def test_predicted_peak_is_within_15_percent_of_the_measured_one(tmp_path):
    sys.path.insert(0, str(ROOT / "launch"))
    from bench_plan import LAYOUTS, table

    out = tmp_path / "plan.json"
    proc = launch(["launch/bench_plan.py", "--worker", str(out)], nproc=2, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    per_rank = json.loads(out.read_text())
    assert set(per_rank[0]) == set(LAYOUTS)
    errors = {
        (name, rank): res[name]["predicted"] / res[name]["measured"] - 1
        for rank, res in enumerate(per_rank)
        for name in res
    }
    assert max(abs(e) for e in errors.values()) <= 0.15, table(per_rank)
