"""The training options: every flag documented, recipe and flag precedence, the shipped recipes."""

from __future__ import annotations

import dataclasses

import pytest

from dstrain.config.options import SECTIONS, build_parser, parse_options
from dstrain.config.plan import prepare
from dstrain.errors import ConfigError
from dstrain.fields import field_docs
from tests.helpers.tiny import ROOT


def test_every_option_documented_and_in_help():
    for name, cls in SECTIONS.items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{name} option {f.name} has no docstring"
    flags = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert len(flags) == len(set(flags)), "a flag named in two sections"
    text = build_parser().format_help()
    required = [
        "--model",
        "--data",
        "--data_format",
        "--tokenizer",
        "--seq_len",
        "--micro_batch_size",
        "--gradient_accumulation_steps",
        "--max_steps",
        "--lr",
        "--warmup_steps",
        "--min_lr",
        "--seed",
        "--precision",
        "--output_dir",
        "--resume",
        "--save_every",
        "--keep_last",
        "--activation_checkpointing",
        "--clip_grad",
        "--moe_bias_update_speed",
        "--moe_aux_loss_alpha",
        "--mtp_loss_weight",
        "--wandb_project",
        "--wandb_mode",
        "--nan_policy",
        "--debug",
        "--config",
        "--recipe",
    ]
    for flag in required:
        assert flag in text, flag
    assert "Peak learning rate" in text and "Tokens per packed row" in text


def test_recipe_and_flag_precedence(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text("lr = 0.01\nmax_steps = 7\n[data]\nseq_len = 48\n")
    opts = parse_options(["--recipe", str(recipe), "--lr", "0.02"])
    assert opts.schedule.lr == 0.02 and opts.schedule.max_steps == 7 and opts.data.seq_len == 48
    assert parse_options([]).data.seq_len == 64  # the trainer's CPU-sized default
    recipe.write_text("lr_rate = 0.01\n")
    with pytest.raises(ConfigError, match="unknown option 'lr_rate'"):
        parse_options(["--recipe", str(recipe)])
    recipe.write_text('max_steps = "many"\n')
    with pytest.raises(ConfigError, match="max_steps='many'"):
        parse_options(["--recipe", str(recipe)])
    with pytest.raises(ConfigError, match="--min_lr 0.5"):
        parse_options(["--lr", "0.1", "--min_lr", "0.5"])
    with pytest.raises(ConfigError, match="invalid choice"):
        parse_options(["--precision", "fp16"])
    with pytest.raises(ConfigError, match="seq_len"):
        parse_options(["--seq_len", "1"])


def test_shipped_recipes_parse_and_resolve():
    for recipe in sorted((ROOT / "launch" / "recipes").glob("*.toml")):
        opts = parse_options(["--recipe", str(recipe)])
        plan = prepare(opts, 8)
        layout = opts.layout
        assert (
            plan.global_batch_rows
            == layout.micro_batch_size * layout.gradient_accumulation_steps * plan.dims.dp
        )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--max_stesp", "3"],
            "unrecognized arguments: --max_stesp 3 (--max_stesp: did you mean --max_steps?)",
        ),
        # a prefix is no flag: `--max_step` would change meaning the day a `--max_step...` flag is added
        (["--max_step", "3"], "(--max_step: did you mean --max_steps?)"),
        (["--lora_rr=4"], "(--lora_rr: did you mean --lora_r?)"),
        (["--zzz", "1"], "unrecognized arguments: --zzz 1"),
    ],
)
def test_unknown_flags_name_the_nearest_one(argv, message):
    with pytest.raises(ConfigError) as info:
        parse_options(argv)
    assert str(info.value).endswith(message) if message.startswith("(") else str(info.value) == message


def test_dash_and_underscore_spellings_are_the_same_flag():
    assert parse_options(["--lora-r", "8", "--max-steps=3"]).lora.lora_r == 8
    assert parse_options(["--max-steps=3"]).schedule.max_steps == 3
    assert parse_options(["--no_plots"]).given == parse_options(["--no-plots"]).given == {"plots"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--data", "{tmp}/missing.jsonl"],
            "dstrain: error: data: no such file or folder: {tmp}/missing.jsonl",
        ),
        (["--eval_data", "{tmp}/*.parquet"], "dstrain: error: data: no file matches {tmp}/*.parquet"),
        (
            ["--lora_r", "4", "--lora_targets", "q_proj"],
            "dstrain: error: --lora_targets q_proj: 'q_proj' matches no",
        ),
    ],
)
def test_data_and_lora_targets_are_checked_before_anything_exists(flags, message, tmp_path, capsys):
    """One line, from the checks before the process group: no model built, no run folder, no resolved file."""
    from dstrain.cli import main as dstrain_main

    out = tmp_path / "run"
    argv = ["train", "--output_dir", str(out), *[f.format(tmp=tmp_path) for f in flags]]
    assert dstrain_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message.format(tmp=tmp_path)) and err.count("\n") == 1
    assert not out.exists()


def test_other_tools_names_are_accepted_or_pointed_to_ours(tmp_path):
    """LLaMA-Factory's and Hugging Face's names for the same options set them (flags and recipe keys); their
    names for what dstrain does otherwise are refused naming the flag to use; a hidden flag (--local_rank) is
    no suggestion."""
    argv = ["--lora_rank", "8", "--learning_rate", "2e-5", "--num_train_epochs", "2"]
    argv += ["--per_device_train_batch_size", "3", "--lora_target", "q_b_proj", "--max_grad_norm", "0.5"]
    opts = parse_options([*argv, "--logging_steps", "7", "--lr_scheduler_type", "linear"])
    assert (opts.lora.lora_r, opts.schedule.lr, opts.schedule.epochs) == (8, 2e-5, 2.0)
    assert (opts.layout.micro_batch_size, opts.lora.lora_targets, opts.optimizer.clip_grad) == (
        3,
        "q_b_proj",
        0.5,
    )
    assert (opts.logging.log_every, opts.schedule.lr_schedule) == (7, "linear")
    assert {"lora_r", "lr", "epochs", "micro_batch_size", "lora_targets"} <= opts.given
    recipe = tmp_path / "r.toml"
    recipe.write_text("learning_rate = 1e-5\nlora_rank = 16\n")
    from_recipe = parse_options(["--recipe", str(recipe)])
    assert (from_recipe.schedule.lr, from_recipe.lora.lora_r) == (1e-5, 16)
    with pytest.raises(ConfigError, match=r"\(--max_seq_length: use --seq_len"):
        parse_options(["--max_seq_length", "512"])
    with pytest.raises(ConfigError, match=r"\(--lora_rnk: did you mean --lora_rank\?\)"):
        parse_options(["--lora_rnk", "8"])
    with pytest.raises(ConfigError) as info:
        parse_options(["--local_rnk", "8"])
    assert "--local_rank" not in str(info.value)
    text = " ".join(build_parser().format_help().split())
    assert "--lr LR, --learning_rate LR" in text and "(default: 0.003)" not in text
    assert "5e-6, under LoRA 5e-5; DPO 1e-6" in text  # a fine-tune's, not the preset's
