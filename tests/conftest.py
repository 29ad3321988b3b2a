"""Session fixtures. Helpers live in tests/helpers/."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> dict[str, Path]:
    """Single-process runs on a transformers-written HF folder (see tests/helpers/runs.py), made once."""
    from tests.helpers.runs import lora_runs

    return lora_runs(tmp_path_factory.mktemp("runs"))
