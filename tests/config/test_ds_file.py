"""DeepSpeed JSON files as users bring them: other projects' real templates (tests/config/ds_templates, see its
SOURCES.md) run 1 step on 2 ranks or are refused in one line, the top-level key check knows every key
DeepSpeed reads, comments and keys DeepSpeed ignores pass, and a `compile` section is read as --compile."""

from __future__ import annotations

import json
import math

import pytest

from dstrain.config.ds_config import load_ds_config
from dstrain.config.ds_file import DEEPSPEED_KEYS
from dstrain.config.options import parse_options
from dstrain.config.plan import RunPlan, prepare
from dstrain.errors import ConfigError
from tests.helpers.tiny import ROOT, tiny_config
from tests.training.worker import TEMPLATE_KIND

TEMPLATE_DIR = ROOT / "tests" / "config" / "ds_templates"
TEMPLATES = sorted(TEMPLATE_DIR.glob("*.json"))
REFUSED = {
    # AutoTP of 4 on 2 ranks: dstrain reads the section as TP 4, which 2 ranks cannot hold
    "dsexamples__ds_config": "world size 2 is not divisible by --pp 1 x --tp 4 = 4",
    # fp16 on (its cuda_visible_devices, a key DeepSpeed ignores, is a note)
    "dsexamples__ds_fp16_z1_config": "ds_config fp16.enabled=true: dstrain trains in bf16 or fp32",
}
# The global batch on 2 ranks with the defaults where a file's layout leaves fewer data-parallel ranks
TRAIN_BATCH = {"llamafactory__ds_z2_autotp_config": 4}  # AutoTP 2: data-parallel 1


def _plan(config: str | dict, extra: list[str] = (), tmp=None) -> RunPlan:  # noqa: ANN001
    """The plan for 2 CPU ranks from a file, or from a dict written to `tmp`."""
    if isinstance(config, dict):
        path = tmp / "ds.json"
        path.write_text(json.dumps(config))
        config = str(path)
    return prepare(
        parse_options(["--config", str(config), *extra]), 2, device_type="cpu", model=tiny_config()
    )


def _zero1(**patch) -> dict:  # noqa: ANN003
    raw = load_ds_config("zero1")[1]
    raw.update(patch)
    return raw


def test_comments_and_keys_deepspeed_ignores_pass(tmp_path):
    """LLaMA-Factory's AutoTP template (a top-level "_comment") resolves without a word; its ZeRO-3 template's
    comms_config and monitor_config (keys no DeepSpeed 0.19 reads) are one note and not passed on; `_` keys
    inside sections are comments too."""
    plan = _plan(TEMPLATE_DIR / "llamafactory__ds_z2_autotp_config.json")
    assert plan.notes == () and plan.dims.tp == 2 and plan.stage == 2
    assert "_comment" not in plan.ds and "tensor_parallel" not in plan.ds

    plan = _plan(TEMPLATE_DIR / "llamafactory__ds_z3_fp8_config.json")
    assert plan.notes == (
        "ds_config comms_config, monitor_config: DeepSpeed 0.19 reads no such key; ignored",
    )
    assert not {"comms_config", "monitor_config"} & set(plan.ds) and plan.offload

    raw = _zero1(
        _comment="top",
        comms_config={"verbose": False},
        zero_optimization={"stage": 2, "_comment": "in a section", "offload_optimizer": {"_note": 1}},
        optimizer={"type": "AdamW", "params": {"lr": "auto", "_why": "x"}},
        bf16={"enabled": "auto", "_comment": "x"},
        tensor_parallel={"autotp_size": 1, "_comment": "x"},
        dstrain={"ep_size": 2, "_comment": "x"},
    )
    plan = _plan(raw, tmp=tmp_path)
    assert plan.notes == ("ds_config comms_config: DeepSpeed 0.19 reads no such key; ignored",)
    assert plan.stage == 2 and plan.dims.ep == 2
    assert not [k for k in _keys(plan.ds) if k.startswith("_")]


def _keys(node) -> list[str]:  # noqa: ANN001
    if not isinstance(node, dict):
        return []
    return [k for key, value in node.items() for k in (key, *_keys(value))]


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"zero_optimisation": {"stage": 3}}, "unknown top-level key 'zero_optimisation' (did you mean"),
        ({"optimiser": {"type": "AdamW"}}, "(did you mean 'optimizer'?)"),
        ({"train_micro_batch_size": 4}, "(did you mean 'train_micro_batch_size_per_gpu'?)"),
    ],
)
def test_a_near_miss_of_a_deepspeed_key_is_refused_other_unknown_keys_are_a_note(patch, message, tmp_path):
    with pytest.raises(ConfigError) as info:
        _plan(_zero1(**patch), tmp=tmp_path)
    assert message in str(info.value) and "\n" not in str(info.value)
    plan = _plan(_zero1(my_extra=1, monitor_config={"enabled": True}), tmp=tmp_path)
    assert plan.notes == ("ds_config my_extra, monitor_config: DeepSpeed 0.19 reads no such key; ignored",)


@pytest.mark.parametrize(
    ("section", "extra", "compiled"),
    [
        (None, [], True),  # axolotl's file: {"disable": false, "backend": "inductor"}
        (None, ["--no-compile"], False),
        ({"enabled": True}, [], True),
        ({"disable": True}, ["--compile"], True),
        ({"disable": True, "backend": "inductor"}, [], False),
        ({"free_activation": False}, [], False),  # DeepSpeed 0.19's DeepCompile keys alone: no wish
    ],
)
def test_a_compile_section_is_the_wish_for_compile(section, extra, compiled, tmp_path):
    """The section's torch.compile keys set --compile where no flag does; the section never reaches
    DeepSpeed (whose 0.19 CompileConfig refuses these keys)."""
    config = TEMPLATE_DIR / "in_process" / "axolotl__zero1_torch_compile.json"
    if section is not None:
        config = {**json.loads(config.read_text()), "compile": section}
    plan = _plan(config, extra, tmp=tmp_path)
    assert plan.opts.model.compile is compiled and "compile" not in plan.ds and plan.notes == ()


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"compile": {"disable": False, "backend": 3}}, "ds_config compile.backend=3: dstrain's --compile"),
        ({"compile": {"backend": "cudagraphs"}}, "ds_config compile.backend=cudagraphs"),
        ({"compile": {"disable": "no"}}, "ds_config compile.disable=no"),
        (
            {"compile": {"disable": False, "bogus": 1}},
            "ds_config compile.bogus: unknown setting (DeepSpeed's compile section has no such key)",
        ),
        ({"compile": {"free_activation": "maybe"}}, "ds_config compile.free_activation=maybe"),
        ({"compile": {"deepcompile": True}}, "compile.deepcompile=true: dstrain does not run DeepSpeed's"),
        (
            {"compile": {"enabled": True, "disable": True}},
            "compile.disable=true conflicts with compile.enabled",
        ),
        ({"compile": True}, "ds_config compile=true: expected an object"),
        ({"fp16": {"enabled": "auto", "loss_scale": -1}}, "ds_config fp16.loss_scale=-1"),
        (
            {"comms_logger": {"enabled": False, "verbos": True}},
            "ds_config comms_logger.verbos: unknown setting (did you mean 'verbose'?)",
        ),
        (
            {"tensorboard": {"enabled": False, "outpath": "x"}},
            "ds_config tensorboard.outpath: unknown setting",
        ),
        ({"hybrid_engine": {"max_out_tokens": 0}}, "ds_config hybrid_engine.max_out_tokens=0"),
        (
            {"timers": {"throughput": {"enabled": "sometimes"}}},
            "ds_config timers.throughput.enabled=sometimes",
        ),
    ],
)
def test_sections_deepspeed_validates_are_refused_in_one_line(patch, message, tmp_path):
    with pytest.raises(ConfigError) as info:
        _plan(_zero1(**patch), tmp=tmp_path)
    assert message in str(info.value) and "\n" not in str(info.value)


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
def test_other_projects_templates_run_or_are_refused_in_one_line(tmp_path, rank_pools):
    res = rank_pools.run(2, "tests.training.worker:templates", str(tmp_path), timeout=900)[0]
    assert set(res) == {p.stem for p in TEMPLATES}
    ran = set()
    for name, got in res.items():
        if name in REFUSED:
            assert REFUSED[name] in got["refused"] and "\n" not in got["refused"], (name, got)
            continue
        assert "refused" not in got, (name, got)
        assert got["train_batch_size"] == TRAIN_BATCH.get(name, 8), (name, got)
        kind = tuple(got[k] for k in TEMPLATE_KIND)
        if got["loss"] is not None:
            assert kind not in ran and math.isfinite(got["loss"]), (name, got)
            # torch's fused AdamW stepped, the offloaded CPU states included (no DeepSpeed C++ op built)
            assert got["optimizer"] == ["torch.optim.adamw.AdamW", True], (name, got)
            ran.add(kind)
    # every kind of run the files resolve to ran a step (12 kinds among the 20 files that run)
    kinds = {tuple(g[k] for k in TEMPLATE_KIND) for g in res.values() if "refused" not in g}
    assert ran == kinds and len(kinds) >= 10, kinds - ran
    # what the files say is what runs: stage, offload, bf16, DeepSeek-MoE's own warmup-only schedule
    assert res["axolotl__zero2"]["offload"] and res["axolotl__zero2"]["stage"] == 2
    assert any(
        g["offload"] and g["stage"] == 3 and g["loss"] is not None for g in res.values() if "refused" not in g
    )
    assert res["axolotl__zero3_bf16"]["precision"] == "bf16"
    assert res["deepseekmoe__ds_config_zero3"]["lr_schedule"] == "constant"
    assert res["llamafactory__ds_z0_config"]["stage"] == 0
    assert res["llamafactory__ds_z2_autotp_config"]["dims"] == "dp 1 x tp 2"
