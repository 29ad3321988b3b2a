"""--compile (regional: each block, and the head's loss chunks) trains like eager: 20 steps of ZeRO-2 with
full activation checkpointing against the same run eager, and ZeRO-3, PP2 and EP2 (with 'mlp'
checkpointing) and TP2 (with 'attention') against one plain PyTorch process. Tolerance 1e-5 relative on loss and grad norm: inductor fuses and
reorders elementwise work, so compiled runs match to rounding, not bit for bit."""

from __future__ import annotations

import json

import pytest

from tests.helpers.ranks import launch
from tests.helpers.tiny import tiny_config
from tests.helpers.trainer import make_options, reference_run

pytestmark = pytest.mark.multirank
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile")
    proc = launch(["-m", "tests.training.worker", "compile", str(out)], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((out / "result_compile_rank0.json").read_text())


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
    opts = make_options(["--micro_batch_size", "2", "--max_steps", "4", "--clip_grad", "0.5"])
    ref = reference_run(tiny_config(), opts, steps=4, global_batch=rows)
    dev = _max_rel(runs[name], ref)
    print(f"{name} vs one process: max rel {dev:.1e}")
    assert dev <= TOLERANCE
