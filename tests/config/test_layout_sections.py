"""The parallel layout as DeepSpeed files and flags give it: pipeline, AutoTP / AutoEP sections, dstrain's own section, sequence parallelism; refused settings in one line."""

from __future__ import annotations

import json

import pytest

from dstrain.config.plan import prepare
from dstrain.errors import ConfigError
from dstrain.parallel import ParallelDims
from tests.helpers.tiny import ROOT, tiny_config
from tests.helpers.trainer import make_options


def _resolve(flags: str, world: int, config: str = "zero1"):  # noqa: ANN202 - a RunPlan
    return prepare(make_options(f"--config {config} {flags}".split()), world, model=tiny_config())


def test_sizes_from_flags_and_config_sections():
    plan = _resolve("--pp 2", 4)
    assert plan.dims == ParallelDims(4, pp=2)
    assert plan.ds["pipeline"]["pipe_partitioned"] is False  # several activations need gradients
    assert plan.ds["train_batch_size"] == 4 * 2  # micro 4 x GA 1 x dp 2
    plan = _resolve("", 4, config="tp2_zero2")
    assert plan.dims == ParallelDims(4, tp=2)
    assert "dstrain" not in plan.ds and "tensor_parallel" not in plan.ds  # DeepSpeed would read it as AutoTP
    assert _resolve("", 2, config="ep_zero2").dims == ParallelDims(2, ep=2)
    with pytest.raises(ConfigError, match=r"dstrain.tp_size=2 conflicts with --tp 1"):
        _resolve("--tp 1", 4, config="tp2_zero2")


@pytest.mark.parametrize(
    ("section", "dims", "note"),
    [
        ({"tensor_parallel": {"autotp_size": 2}}, ParallelDims(4, tp=2), None),
        ({"tensor_parallel": {"tp": {"tp_size": 2}, "dtype": "bf16"}}, ParallelDims(4, tp=2), None),
        (
            {"expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "deepseek_v3"}},
            ParallelDims(4, ep=2),
            None,
        ),
        ({"expert_parallel": {"enabled": False, "autoep_size": 4}}, ParallelDims(4), None),
        ({"tensor_parallel": {"tp_size": 2}}, ParallelDims(4, tp=2), "tensor_parallel.tp_size is deprecated"),
        ({"expert_parallel": {"ep_size": 2}}, ParallelDims(4, ep=2), "expert_parallel.ep_size is deprecated"),
    ],
)
def test_deepspeed_autotp_and_autoep_sections_set_dstrains_layout(tmp_path, section, dims, note):
    """DeepSpeed 0.19's AutoTP / AutoEP sections mean TP / EP of that size: dstrain runs its own; the old
    dstrain forms of those sections still read, with a note."""
    raw = json.loads((ROOT / "ds_configs" / "zero1.json").read_text())
    raw.update(section)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    plan = _resolve("", 4, config=str(path))
    assert plan.dims == dims
    assert not ({"tensor_parallel", "expert_parallel"} & set(plan.ds))
    assert [n for n in plan.notes if note and note in n] if note else not plan.notes


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            {"tensor_parallel": {"autotp_size": 2, "partition_config": {"use_default_specs": False}}},
            'ds_config tensor_parallel.partition_config={"use_default_specs": false}: dstrain\'s tensor',
        ),
        (
            {"expert_parallel": {"enabled": True, "autoep_size": 2, "load_balance_coeff": 0.01}},
            "ds_config expert_parallel.load_balance_coeff=0.01: dstrain's expert parallelism",
        ),
        (
            {"expert_parallel": {"enabled": True, "autoep_size": 2, "moe_sharding": 1}},
            "ds_config expert_parallel.moe_sharding: unknown expert parallelism",
        ),
        (
            {"tensor_parallel": {"tp_size": 2}, "dstrain": {"tp_size": 4}},
            "ds_config tensor_parallel.tp_size=2 conflicts with dstrain.tp_size=4",
        ),
        ({"moe": {"ep_size": 2}}, "ds_config moe="),
        ({"pipeline": {"stages": 2, "micro_batches": 3}}, "ds_config pipeline.micro_batches: unknown key"),
    ],
)
def test_deepspeed_automatic_paths_are_refused(tmp_path, section, message):
    raw = json.loads((ROOT / "ds_configs" / "zero1.json").read_text())
    raw.update(section)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        _resolve("", 4, config=str(path))
    assert str(err.value).startswith(message)


def test_sequence_parallel_settings_refused_before_anything_is_built(tmp_path):
    base = json.loads((ROOT / "ds_configs" / "zero1.json").read_text())
    config = tmp_path / "sp.json"
    config.write_text(json.dumps({**base, "sequence_parallel_size": 2}))
    with pytest.raises(ConfigError, match=r"^--sp 2 must divide --seq_len 31$"):
        _resolve("--sp 2 --seq_len 31", 2)
    with pytest.raises(ConfigError, match=r"^--sp 2 with --compile"):
        _resolve("--sp 2 --compile", 2)
    with pytest.raises(ConfigError, match=r"^ds_config sequence_parallel_size=2 conflicts with --sp 1$"):
        _resolve("--sp 1", 2, config=str(config))
    plan = _resolve("--micro_batch_size 2", 4, config=str(config))
    assert (plan.dims.sp, plan.dims.data, plan.global_batch_rows) == (2, 2, 4)
    assert "sequence_parallel_size" not in plan.ds  # dstrain's Ulysses, not DeepSpeed's
