"""The run plan's decisions that depend on what the user gave (dstrain/config/plan.py)."""

from __future__ import annotations

from dstrain.config.plan import prepare
from tests.helpers.hf import make_hf_model, v3_config
from tests.helpers.tiny import ROOT
from tests.helpers.trainer import make_options


def test_a_folder_without_mtp_weights_fine_tunes_without_mtp_unless_asked(tmp_path):
    make_hf_model(v3_config()).save_pretrained(tmp_path)  # transformers drops the MTP layers
    depth = v3_config().num_nextn_predict_layers
    assert depth > 0
    plan = prepare(make_options(["--model", str(tmp_path), "--lora_r", "4"]), 1)
    assert plan.model.num_nextn_predict_layers == 0
    assert [n for n in plan.notes if "no MTP weights: MTP is off for this run" in n]
    asked = prepare(make_options(["--model", str(tmp_path), "--lora_r", "4", "--train_mtp"]), 1)
    assert asked.model.num_nextn_predict_layers == depth
    assert [n for n in asked.notes if "MTP module(s) start fresh and train" in n]


def test_lora_keeps_the_expert_bias_unless_asked():
    assert prepare(make_options([]), 1).model.bias_update_speed > 0  # the tiny preset's own
    assert prepare(make_options(["--lora_r", "4"]), 1).model.bias_update_speed == 0.0
    given = prepare(make_options(["--lora_r", "4", "--moe_bias_update_speed", "0.01"]), 1)
    assert given.model.bias_update_speed == 0.01


def test_dsa_stage_auto_follows_each_models_post_training(tmp_path):
    """DeepSeek-V3.2's report: post-training trains the indexer as sparse pre-training did; GLM-5's states only
    its RL's frozen indexer; LoRA keeps the base model, indexers included; a fresh model trains sparse."""
    from tests.helpers.hf import glm_config, v32_config

    def stage(folder, *flags):  # noqa: ANN001, ANN202
        return prepare(make_options(["--model", str(folder), *flags]), 1).opts.model.dsa_stage

    make_hf_model(v32_config()).save_pretrained(tmp_path / "v32")
    make_hf_model(glm_config()).save_pretrained(tmp_path / "glm")
    assert stage(tmp_path / "v32") == "sparse" and stage(tmp_path / "glm") == "frozen"
    assert stage(tmp_path / "v32", "--lora_r", "4") == "frozen"
    assert stage(tmp_path / "v32", "--lora_r", "4", "--dsa_stage", "sparse") == "sparse"
    assert stage("tiny-dsa") == "sparse"


def test_the_default_lr_follows_the_kind_of_run(tmp_path):
    """A preset keeps the demo's lr; a folder's fine-tune gets DeepSeek-V3's SFT lr (5e-6 -> 1e-6), LoRA ten
    times that; DPO TRL's lr; a flag or the DeepSpeed file's own lr wins and is reported as given."""
    import json

    from dstrain.config.options import parse_options

    make_hf_model(v3_config()).save_pretrained(tmp_path / "hf")

    def sched(*flags):  # noqa: ANN002, ANN202
        plan = prepare(parse_options(["--seq_len", "32", *flags]), 1)
        return plan.opts.schedule.lr, plan.opts.schedule.min_lr, plan.lr_origin

    folder = ["--model", str(tmp_path / "hf")]
    assert sched() == (3e-3, 3e-3 / 10, "preset default")
    assert sched(*folder) == (5e-6, 1e-6, "full fine-tune default (DeepSeek-V3's SFT)")
    assert sched(*folder, "--lora_r", "8") == (5e-5, 5e-6, "LoRA fine-tune default (10x full fine-tuning's)")
    assert sched(*folder, "--lr", "1e-4") == (1e-4, 1e-4 / 10, "given")
    dpo = [*folder, "--objective", "dpo"]  # DPO: TRL's DPOConfig lr, ten times that under LoRA
    assert sched(*dpo) == (1e-6, 1e-6 / 10, "full DPO default (TRL's)")
    assert sched(*dpo, "--lora_r", "8") == (1e-5, 1e-5 / 10, "LoRA DPO default (10x full DPO's)")
    ds = json.loads((ROOT / "ds_configs" / "zero1.json").read_text())
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 2e-5}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    assert sched(*folder, "--config", str(tmp_path / "ds.json"))[::2] == (2e-5, "given")


def test_lora_targets_default_to_the_model_familys_own(monkeypatch):
    """Without --lora_targets each family adapts its own modules (V4 has no kv_b_proj: V3's names stopped every
    V4 LoRA run); given targets stay as given; a family without defaults asks for them in one line."""
    import dataclasses

    import pytest

    from dstrain.config.plan import _family_lora_targets
    from dstrain.errors import ConfigError
    from dstrain.model import family_of, get_config

    v4 = prepare(make_options(["--model", "tiny-v4", "--lora_r", "4"]), 1)
    assert v4.opts.lora.lora_targets == "q_b_proj,kv_proj,o_a_proj,o_b_proj,shared_experts"
    leaves = {name.rpartition(".")[2] for name in v4.trains[2]}
    assert leaves == {"q_b_proj", "kv_proj", "o_a_proj", "o_b_proj", "gate_proj", "up_proj", "down_proj"}
    v3 = prepare(make_options(["--lora_r", "4"]), 1)
    assert v3.opts.lora.lora_targets == "q_b_proj,kv_b_proj,o_proj,shared_experts"
    given = prepare(make_options(["--model", "tiny-v4", "--lora_r", "4", "--lora_targets", "kv_proj"]), 1)
    assert given.opts.lora.lora_targets == "kv_proj"
    assert prepare(make_options(["--model", "tiny-v4"]), 1).trains[2] == ()  # no LoRA: no targets

    cfg = get_config("tiny")
    bare = dataclasses.replace(family_of(cfg), lora_targets=())
    monkeypatch.setattr("dstrain.config.plan.family_of", lambda c: bare)  # a family naming no default
    with pytest.raises(ConfigError, match="--lora_targets: deepseek_v3 has no default LoRA targets"):
        _family_lora_targets(make_options(["--lora_r", "4"]), cfg)
