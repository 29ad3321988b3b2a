"""The DeepSpeed config resolved from the options: "auto" filled, explicit values adopted or refused in one line."""

from __future__ import annotations

import json

import pytest

from dstrain.config.ds_config import load_ds_config, resolve_precision
from dstrain.config.options import parse_options
from dstrain.config.plan import prepare
from dstrain.errors import ConfigError
from tests.helpers.tiny import tiny_config
from tests.helpers.trainer import make_options


def _resolve(config: str | dict, extra: list[str] = (), world: int = 2, tmp=None) -> dict:  # noqa: ANN001
    """The DeepSpeed engine dict `prepare` resolves for a shipped config name or a config dict."""
    if isinstance(config, dict):
        path = tmp / "ds.json"
        path.write_text(json.dumps(config))
        config = str(path)
    return prepare(make_options(["--config", config, *extra]), world, model=tiny_config()).ds


def test_shipped_configs_resolve_from_options():
    for name in ("zero1", "zero2", "zero3", "zero3_offload"):
        ds = _resolve(
            name, ["--micro_batch_size", "3", "--gradient_accumulation_steps", "2", "--clip_grad", "0"]
        )
        assert ds["train_batch_size"] == 12 and ds["train_micro_batch_size_per_gpu"] == 3
        assert ds["gradient_clipping"] == 0.0 and ds["bf16"]["enabled"] is False
        assert ds["optimizer"]["params"]["lr"] == 3e-3 and ds["optimizer"]["params"]["betas"] == [0.9, 0.95]
        assert ds["scheduler"]["type"] == "WarmupCosineLR"
        # torch's fused AdamW, offload included (no C++ op built at run time); overlap_comm "auto" is off
        # without CUDA
        assert ds["optimizer"]["params"]["torch_adam"] is True and ds["optimizer"]["params"]["fused"] is True
        assert ds["zero_optimization"]["overlap_comm"] is False
        assert "auto" not in json.dumps({k: v for k, v in ds.items() if k != "tensorboard"})


@pytest.mark.parametrize(
    ("patch", "extra", "message"),
    [
        (
            {"gradient_clipping": 0.5},
            ["--clip_grad", "1.0"],
            "ds_config gradient_clipping=0.5 conflicts with --clip_grad 1.0",
        ),
        (
            {"train_batch_size": 16},
            ["--micro_batch_size", "2", "--gradient_accumulation_steps", "1"],
            "ds_config train_batch_size=16 != --micro_batch_size 2",
        ),
        (
            {"train_batch_size": 15},
            ["--micro_batch_size", "2"],
            "train_batch_size=15 is not a multiple of --micro_batch_size 2 x 2 data-parallel ranks",
        ),
        (
            {"train_micro_batch_size_per_gpu": 8},
            ["--micro_batch_size", "4"],
            "train_micro_batch_size_per_gpu=8 conflicts with --micro_batch_size 4",
        ),
        (
            {"bf16": {"enabled": True}},
            ["--precision", "fp32"],
            "ds_config bf16.enabled=true conflicts with --precision fp32",
        ),
        ({"fp16": {"enabled": True}}, [], "fp16.enabled=true: dstrain trains in bf16 or fp32, not fp16"),
        ({"zero_optimisation": {"stage": 3}}, [], "did you mean 'zero_optimization'?"),
        ({"zero_optimization": {"stage": 4}}, [], "zero_optimization.stage=4"),
        (
            {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
            [],
            "offload_param needs stage 3",
        ),
        ({"pipeline": {"stages": 2}}, ["--pp", "3"], "ds_config pipeline.stages=2 conflicts with --pp 3"),
        (
            {"tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True}},
            [],
            "tensor_parallel.tp_overlap_comm=true: dstrain's tensor parallelism (DeepSpeed AutoTP section) cannot",
        ),
        ({"moe": {"ep_size": 2}}, [], "ds_config moe="),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "momentum": 0.9}}},
            [],
            "optimizer.params.momentum: unknown key",
        ),
        ({"optimizer": {"type": "SGD"}}, [], "optimizer.type=SGD"),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}},
            ["--lr", "0.2"],
            "optimizer.params.lr=0.1 conflicts with --lr 0.2",
        ),
        (
            {"scheduler": {"type": "WarmupLR"}},
            ["--lr_schedule", "cosine"],
            "scheduler.type=WarmupLR conflicts with --lr_schedule cosine",
        ),
        (
            {"scheduler": {"type": "auto", "params": {"warmup_num_steps": 9}}},
            ["--warmup_steps", "2"],
            "warmup_num_steps=9 conflicts",
        ),
        ({"bf16": {"enabled": "auto", "master_weights": True}}, [], "bf16.master_weights: unknown key"),
        (
            {"zero_optimization": {"stage": 1, "reduce_bucket_sise": 5}},
            [],
            "zero_optimization.reduce_bucket_sise: unknown setting (did you mean 'reduce_bucket_size'?)",
        ),
        (  # a typo'd key set to "auto" is a typo, not a setting dstrain does not fill
            {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sise": "auto"}},
            [],
            "zero_optimization.stage3_prefetch_bucket_sise: unknown setting (did you mean "
            "'stage3_prefetch_bucket_size'?)",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memroy": True}}},
            [],
            "zero_optimization.offload_optimizer.pin_memroy: unknown setting (did you mean 'pin_memory'?)",
        ),
        (
            {"zero_optimization": {"stage": 1, "allgather_bucket_size": "auto"}},
            [],
            "allgather_bucket_size='auto'",
        ),
        ({"zero_optimization": {"stage": 0}}, ["--nan_policy", "skip"], "--nan_policy skip needs"),
        (
            {"optimizer": {"type": "AdamW", "params": {"torch_adam": "yes"}}},
            [],
            "optimizer.params.torch_adam='yes': true, false or \"auto\"",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"torch_adam": 0}}},
            [],
            'optimizer.params.torch_adam=0: true, false or "auto"',
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"torch_adam": False, "fused": True}}},
            [],
            "optimizer.params.fused=true needs torch_adam",
        ),
        (
            {"zero_optimization": {"stage": 0}},
            ["--precision", "bf16"],
            "zero_optimization.stage=0 with bf16: not",
        ),
    ],
)
def test_ds_config_errors_name_key_and_value(patch, extra, message, tmp_path):
    raw = load_ds_config("zero1")[1]
    raw.update(patch)
    with pytest.raises(ConfigError) as info:
        _resolve(raw, extra, tmp=tmp_path)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_torch_adam_false_asks_for_deepspeed_s_own_adam(tmp_path):
    """The one way to DeepSpeed's CPU Adam under offload (its C++ op built at first use): torch_adam=false."""
    raw = load_ds_config("zero3_offload")[1]
    raw["optimizer"]["params"]["torch_adam"] = False
    params = _resolve(raw, [], tmp=tmp_path)["optimizer"]["params"]
    assert params["torch_adam"] is False and "fused" not in params


def test_precision_auto_follows_explicit_config():
    assert resolve_precision("auto", {"bf16": {"enabled": True}}, "cpu") == "bf16"
    assert resolve_precision("auto", {}, "cpu") == "fp32"


def test_explicit_file_values_are_the_settings_where_no_flag_says_otherwise(tmp_path):
    """A DeepSpeed file's explicit values train as given when no flag or recipe sets them (DeepSeek-MoE's own
    ZeRO-3 file runs without extra flags); train_batch_size fixes the accumulation as in transformers."""
    from dstrain.config.plan import prepare

    raw = load_ds_config("zero2")[1]
    raw.update(train_micro_batch_size_per_gpu=2, train_batch_size=16, gradient_clipping=0.3)
    raw["optimizer"] = {
        "type": "AdamW",
        "params": {"lr": 1e-4, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.1},
    }
    raw["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 7, "total_num_steps": 40}}
    path = tmp_path / "user.json"
    path.write_text(json.dumps(raw))

    plan = prepare(parse_options(["--config", str(path)]), 2, model=tiny_config())
    o = plan.opts
    assert (o.layout.micro_batch_size, o.layout.gradient_accumulation_steps) == (2, 4)
    assert (o.schedule.lr, o.schedule.min_lr, o.schedule.lr_schedule) == (1e-4, 0.0, "linear")
    assert (o.schedule.warmup_steps, o.schedule.max_steps, o.optimizer.clip_grad) == (7, 40, 0.3)
    assert (o.optimizer.adam_beta2, o.optimizer.adam_eps, o.optimizer.weight_decay) == (0.98, 1e-6, 0.1)
    assert plan.ds["train_batch_size"] == 16 and plan.ds["optimizer"]["params"]["lr"] == 1e-4
    # a flag that agrees is fine; one that contradicts names both
    prepare(parse_options(["--config", str(path), "--lr", "1e-4"]), 2, model=tiny_config())
    with pytest.raises(ConfigError, match=r"optimizer.params.lr=0.0001 conflicts with --lr 0.001"):
        prepare(parse_options(["--config", str(path), "--lr", "1e-3"]), 2, model=tiny_config())
    # the cosine floor follows the file's ratio and lr
    raw["scheduler"] = {"type": "WarmupCosineLR", "params": {"cos_min_ratio": 0.05}}
    path.write_text(json.dumps(raw))
    plan = prepare(parse_options(["--config", str(path)]), 2, model=tiny_config())
    assert plan.opts.schedule.min_lr == pytest.approx(5e-6)
