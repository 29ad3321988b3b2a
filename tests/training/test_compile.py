"""--compile (regional: each block, and the head's loss chunks) trains like eager: 20 steps of ZeRO-2 with
full activation checkpointing against the same run eager, and ZeRO-3, PP2 and EP2 (with 'mlp'
checkpointing) and TP2 (with 'attention') against one plain PyTorch process. Tolerance 1e-5 relative on loss and grad norm: inductor fuses and
reorders elementwise work, so compiled runs match to rounding, not bit for bit."""

from __future__ import annotations

import pytest

from tests.helpers.pool import ScenarioResults
from tests.helpers.trainer import cached_reference

pytestmark = pytest.mark.multirank
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory, rank_pools):
    """runs[name]: the worker's compiled (or eager) run on 2 ranks, in the pool when first asked for."""
    out = str(tmp_path_factory.mktemp("compile"))
    return ScenarioResults(rank_pools, 2, "tests.training.worker:compiled", out, timeout=900)


def _max_rel(got: list[dict], want: list[dict]) -> float:
    assert len(got) == len(want)
    return max(abs(g[k] - w[k]) / abs(w[k]) for g, w in zip(got, want) for k in ("loss", "grad_norm"))


def test_compiled_matches_eager_over_20_steps(runs):
    dev = _max_rel(runs["compiled_z2"], runs["eager_z2"])
    print(f"compiled vs eager, ZeRO-2 + activation checkpointing, 20 steps: max rel {dev:.1e}")
    assert dev <= TOLERANCE


@pytest.mark.parametrize(
    ("name", "rows"), [("compiled_z3", 4), ("compiled_pp2", 2), ("compiled_tp2", 2), ("compiled_ep2", 4)]
)
def test_compiled_layouts_match_one_process(runs, name, rows):
    ref = cached_reference(["--micro_batch_size", "2", "--max_steps", "4", "--clip_grad", "0.5"], 4, rows)
    dev = _max_rel(runs[name], ref)
    print(f"{name} vs one process: max rel {dev:.1e}")
    assert dev <= TOLERANCE
