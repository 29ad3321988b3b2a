"""DeepSpeed JSON files as users bring them: other projects' real templates (tests/config/ds_templates, see its
SOURCES.md) run 1 step on 2 ranks or are refused in one line, and the top-level key check knows every key
DeepSpeed reads."""

from __future__ import annotations

import json

import pytest

from dstrain.config.ds_file import DEEPSPEED_KEYS
from tests.helpers.ranks import launch
from tests.helpers.tiny import ROOT

TEMPLATES = sorted((ROOT / "tests" / "config" / "ds_templates").glob("*.json"))
REFUSED = {
    # AutoTP of 4 on 2 ranks: dstrain reads the section as TP 4, which 2 ranks cannot hold
    "dsexamples__ds_config": "world size 2 is not divisible by --pp 1 x --tp 4 = 4",
    # not a DeepSpeed key (DeepSpeed ignores it): named, with the file
    "dsexamples__ds_fp16_z1_config": "unknown top-level key 'cuda_visible_devices'",
}


def test_known_keys_cover_what_deepspeed_reads():
    """Every top-level key DeepSpeedConfig looks up is known (a DeepSpeed upgrade that reads a new key fails
    here, not in a user's run)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    seen: set[str] = set()

    class Recording(dict):
        def get(self, key, *default):  # noqa: ANN001, ANN202
            seen.add(key)
            return super().get(key, *default)

        def __getitem__(self, key):  # noqa: ANN001, ANN204
            seen.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):  # noqa: ANN001, ANN204
            seen.add(key)
            return super().__contains__(key)

    DeepSpeedConfig(
        Recording(train_batch_size=1, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    )
    assert len(seen) > 40 and seen <= DEEPSPEED_KEYS, seen - DEEPSPEED_KEYS


@pytest.mark.multirank
def test_other_projects_templates_run_or_are_refused_in_one_line(tmp_path):
    proc = launch(["-m", "tests.training.worker", "templates", str(tmp_path)], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads((tmp_path / "result_templates_rank0.json").read_text())
    assert set(res) == {p.stem for p in TEMPLATES}
    for name, got in res.items():
        if name in REFUSED:
            assert REFUSED[name] in got["refused"] and "\n" not in got["refused"], (name, got)
            continue
        assert "refused" not in got, (name, got)
        assert got["loss"] is not None and got["train_batch_size"] == 8, (name, got)
    # what the files say is what runs: stage, offload, bf16, DeepSeek-MoE's own warmup-only schedule
    assert res["axolotl__zero2"]["offload"] and res["axolotl__zero2"]["stage"] == 2
    assert res["axolotl__zero3_bf16"]["precision"] == "bf16"
    assert res["deepseekmoe__ds_config_zero3"]["lr_schedule"] == "constant"
    assert res["llamafactory__ds_z0_config"]["stage"] == 0
