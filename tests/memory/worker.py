"""The memory measurement as a scenario of the test session's pool of ranks (tests/helpers/pool.py): the
layouts of launch/bench_plan.py trained under the allocation tracker, which counts what a block allocates
(nothing alive before it), so a rank that ran other scenarios measures as a fresh one does."""

from __future__ import annotations

import sys

from tests.helpers.tiny import ROOT


def measured(info, names: list[str]) -> dict:  # noqa: ANN001
    """This rank's measured and predicted peaks per layout (bench_plan.measure)."""
    sys.path.insert(0, str(ROOT / "launch"))
    from bench_plan import measure

    return measure(info, names)
