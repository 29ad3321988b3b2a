"""The entry point as users run it: the `deepspeed` launcher with the shipped config and the real tiny
preset on the built-in data, a plain one-process `python dstrain/train.py`, and errors before allocation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from dstrain.model import ModelConfig
from tests.helpers.hf import official_folder
from tests.helpers.ranks import free_port
from tests.helpers.tiny import ROOT

pytestmark = pytest.mark.multirank
REQUIRED = {
    "step",
    "loss",
    "lm_loss",
    "aux_loss",
    "mtp_loss",
    "lr",
    "grad_norm",
    "tokens",
    "tokens_per_s",
    "mfu",
    "moe_imbalance",
}


def _run(cmd: list[str], timeout: int = 420) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DS_ACCELERATOR", None)  # the entry point must pick the CPU accelerator by itself
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _deepspeed(args: list[str]) -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    return _run([exe, "--num_gpus", "2", "--master_port", str(free_port()), "dstrain/train.py", *args])


def _pooled(pools, argv: list[str]) -> SimpleNamespace:  # noqa: ANN001
    """`dstrain train ARGV` in the 1-rank pool -> .returncode, .stdout, .stderr as a process's."""
    res = pools.run(1, "tests.training.worker:cli_out", argv)[0]
    return SimpleNamespace(returncode=res["rc"], stdout=res["stdout"], stderr=res["stderr"])


def test_default_command_with_deepspeed_launcher(tmp_path):
    out = tmp_path / "run"
    proc = _deepspeed(
        [
            "--config",
            "ds_configs/zero1.json",
            "--max_steps",
            "4",
            "--warmup_steps",
            "1",
            "--output_dir",
            str(out),
        ],
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert f"outputs in {out}" in proc.stdout and "Traceback" not in text
    assert "tiny on 2 x cpu (gloo), dp 2, ZeRO-1, fp32" in proc.stdout
    assert "routing collapsed" not in text
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        assert set(r) >= REQUIRED, REQUIRED - set(r)
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["grad_norm"] > 0
        assert abs(r["loss"] - (r["lm_loss"] + 0.3 * r["mtp_loss"] + 1e-4 * r["aux_loss"])) < 1e-6
        assert set(r["moe_imbalance"]) == {"layer_1", "layer_2"} and all(
            v >= 1 for v in r["moe_imbalance"].values()
        )
    assert recs[-1]["tokens"] == 4 * 8 * 64
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert recs[0]["lr"] == pytest.approx(3e-3)
    ds = json.loads((out / "ds_config.resolved.json").read_text())
    assert (
        ds["train_batch_size"] == 8
        and ds["gradient_clipping"] == 1.0
        and ds["zero_optimization"]["stage"] == 1
    )
    assert (out / "checkpoints" / "step_00000004" / "COMPLETE").is_file()
    assert (out / "checkpoints" / "latest").read_text() == "step_00000004"


def test_one_process_max_steps_zero_then_resume(tmp_path, rank_pools):
    """`python dstrain/train.py` with no launcher; --max_steps 0 writes a checkpoint without training; a
    DeepSpeed monitor (CSV) and offline wandb receive the metrics; explicit bad resumes are errors. The runs after
    the first are `dstrain train` in the 1-rank pool (the command line's error policy, output captured)."""
    out = tmp_path / "one"
    train = [sys.executable, "dstrain/train.py", "--output_dir", str(out)]
    cfg = tmp_path / "ds.json"
    raw = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    raw["csv_monitor"] = {"enabled": True, "output_path": "auto", "job_name": "auto"}
    cfg.write_text(json.dumps(raw))
    proc = _run([*train, "--config", str(cfg), "--max_steps", "0"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "checkpoints" / "step_00000000" / "COMPLETE").is_file()
    # The checkpoint describes its model: the HF config of the tiny preset, readable by get_config.
    from dstrain.model import get_config

    saved = ModelConfig.from_hf_dict(
        json.loads((out / "checkpoints" / "step_00000000" / "config.json").read_text())
    )
    want = get_config("tiny")
    assert (saved.hidden_size, saved.num_hidden_layers, saved.num_nextn_predict_layers, saved.vocab_size) == (
        want.hidden_size,
        want.num_hidden_layers,
        want.num_nextn_predict_layers,
        want.vocab_size,
    )
    assert not (out / "metrics.jsonl").exists() or (out / "metrics.jsonl").read_text() == ""
    again = _pooled(rank_pools, [*train[2:], "--config", str(cfg), "--max_steps", "2"])
    assert again.returncode == 2 and "already holds checkpoints: pass --resume auto" in again.stderr
    proc = _pooled(
        rank_pools,
        [
            *train[2:],
            "--config",
            str(cfg),
            "--max_steps",
            "2",
            "--resume",
            "auto",
            "--wandb_project",
            "dstrain-test",
            "--wandb_mode",
            "offline",
            "--no-save_moments",
        ],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stdout and "step_00000000" in proc.stdout
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    csv_files = list((out / "csv_monitor").rglob("*.csv"))
    assert any("lm_loss" in p.name for p in csv_files), csv_files
    assert list((out / "wandb").glob("offline-run-*"))
    state = json.loads(
        (out / "checkpoints" / "step_00000002" / "dstrain_state" / "rank_00000.json").read_text()
    )
    assert state["step"] == 2 and state["wandb_run_id"] and state["loader"] is not None
    # --no-save_moments: the weights layout-free, AdamW's moments only in DeepSpeed's files (this layout's)
    step2 = out / "checkpoints" / "step_00000002"
    assert (step2 / "weights").is_dir() and not (step2 / "optimizer").exists()
    elsewhere = _pooled(
        rank_pools, [*train[2:], "--config", "zero1", "--resume", str(step2), "--max_steps", "3"]
    )
    assert elsewhere.returncode == 2, elsewhere.stderr[-3000:]
    assert "saved with --no-save_moments" in elsewhere.stderr.strip().splitlines()[-1]
    missing = _pooled(rank_pools, [*train[2:], "--resume", str(tmp_path / "nowhere")])
    assert missing.returncode == 2
    assert (
        missing.stderr.strip().splitlines()[-1]
        == f"dstrain: error: --resume {tmp_path / 'nowhere'}: no such file or folder"
    )
    (out / "checkpoints" / "step_00000002" / "COMPLETE").unlink()
    partial = _pooled(rank_pools, [*train[2:], "--resume", str(out / "checkpoints" / "step_00000002")])
    assert partial.returncode == 2 and "is incomplete (no COMPLETE marker" in partial.stderr


def test_config_error_under_launcher_is_one_line(tmp_path):
    cfg = tmp_path / "ds.json"
    raw = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
    raw["train_batch_size"] = 4
    cfg.write_text(json.dumps(raw))
    proc = _deepspeed(["--config", str(cfg), "--micro_batch_size", "4"])
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Traceback" not in text
    lines = [line for line in text.splitlines() if "dstrain: error:" in line]
    assert lines == [
        "dstrain: error: ds_config train_batch_size=4 is not a multiple of --micro_batch_size 4 x 2 data-parallel ranks"
    ], text[-4000:]


def test_exact_resume_with_the_real_data_pipeline(tmp_path, rank_pools):
    """The built-in data and tokenizer through the data package's loader (its worker process): 2 steps + resume
    + 2 steps give the straight run's losses bit for bit (the loader state is taken at the step boundary). Each
    `dstrain train` runs in the 1-rank pool (tests/helpers/runs.py)."""
    common = ["--max_steps", "4", "--seq_len", "32", "--micro_batch_size", "2"]
    a, b = tmp_path / "a", tmp_path / "b"
    run = "tests.training.worker:cli_out"
    first = rank_pools.run(
        1, run, [*common, "--save_every", "2", "--keep_last", "0", "--output_dir", str(a)]
    )[0]
    assert first["rc"] == 0, first["stdout"][-3000:]
    resume = ["--resume", str(a / "checkpoints" / "step_00000002")]
    second = rank_pools.run(1, run, [*common, "--output_dir", str(b), *resume])[0]
    assert second["rc"] == 0, second["stdout"][-3000:]
    straight = [json.loads(line)["loss"] for line in (a / "metrics.jsonl").read_text().splitlines()]
    resumed = [json.loads(line)["loss"] for line in (b / "metrics.jsonl").read_text().splitlines()]
    assert resumed == straight[2:]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("official") / "v3"
    official_folder(path, dtype=torch.float32, shards=3)
    return path


def test_a_folder_that_does_not_fit_is_one_line_before_anything_starts(tmp_path, folder, capsys):
    """Missing tensor, wrong shape, pickle only: `dstrain train --model` exits 2 with one line naming it,
    from the files' headers, before any process group or allocation."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from dstrain.model.hf.files import SAFE_INDEX
    from dstrain.train import main

    def broken(name: str, edit) -> str:  # noqa: ANN001
        path = tmp_path / name
        shutil.copytree(folder, path)
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(f, "pt") as h:
                sd = {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118
            if edit(sd, f):
                save_file(sd, f, metadata={"format": "pt"})
        return str(path)

    def drop_norm(sd, f) -> bool:  # noqa: ANN001
        return sd.pop("model.norm.weight", None) is not None

    def widen_o_proj(sd, f) -> bool:  # noqa: ANN001
        key = "model.layers.0.self_attn.o_proj.weight"
        if key in sd:
            sd[key] = torch.zeros(sd[key].shape[0], sd[key].shape[1] + 1)
        return key in sd

    def to_pickle(sd, f) -> bool:  # noqa: ANN001
        torch.save(sd, f.with_suffix(".bin"))
        f.unlink()
        return False

    stale = broken("stale_index", drop_norm)
    no_norm = broken("no_norm", drop_norm)
    index = json.loads((tmp_path / "no_norm" / SAFE_INDEX).read_text())
    del index["weight_map"]["model.norm.weight"]
    (tmp_path / "no_norm" / SAFE_INDEX).write_text(json.dumps(index))
    cases = {
        stale: "the index puts model.norm.weight in model-0000",
        no_norm: "1 tensors missing from the checkpoint, e.g. norm.weight",
        broken("wide", widen_o_proj): "layers.0.self_attn.o_proj.weight has shape",
        broken("pickle", to_pickle): "holds only pickle weights",
    }
    (tmp_path / "pickle" / SAFE_INDEX).unlink()
    for path, message in cases.items():
        assert main(["--model", path, "--max_steps", "1"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"dstrain: error: --model {path}: ") and message in err, err
        assert "\n" not in err


def test_watching_a_run_eval_tensorboard_plots_and_trace(tmp_path, rank_pools, small_model):
    """One rank on chat data with an eval split: eval rows in metrics.jsonl (at --eval_every and the end),
    TensorBoard events that read back with every metric, the PNG plots, expert_load.jsonl and a valid
    profiler trace of the requested steps; `dstrain plot` redraws them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dstrain.cli import main as dstrain_main
    from tests.helpers.data_files import chat_rows, write_jsonl

    data = write_jsonl(tmp_path / "chats.jsonl", chat_rows(60))
    out = tmp_path / "run"
    args = [
        "--data",
        data,
        "--eval_split",
        "0.3",
        "--eval_every",
        "2",
        "--max_steps",
        "5",
        "--seq_len",
        "128",
    ]
    args += ["--profile_steps", "2:3", "--model", str(small_model), "--output_dir", str(out)]
    proc = rank_pools.run(1, "tests.training.worker:cli_out", args)[0]  # in the 1-rank pool
    assert proc["rc"] == 0, proc["stdout"][-3000:]
    assert "eval step 2: loss" in proc["stdout"] and "mtp acc" in proc["stdout"]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in recs if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4, 5]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4, 5]
    for r in evals:
        assert r["eval_ppl"] == pytest.approx(2.718281828459045 ** r["eval_loss"])
        assert 0 <= r["eval_mtp_acc"] <= 1 and r["eval_tokens"] > 0 and len(r["eval_mtp_loss"]) == 1
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/mfu", "eval/loss", "eval/mtp_acc"} <= tags
    assert [e.step for e in events.Scalars("eval/loss")] == [2, 4, 5]
    assert events.Scalars("eval/loss")[-1].value == pytest.approx(evals[-1]["eval_loss"], rel=1e-6)

    loads = [json.loads(line) for line in (out / "expert_load.jsonl").read_text().splitlines()]
    assert loads and all(sum(v) == pytest.approx(1.0, abs=1e-4) for r in loads for v in r["layers"].values())
    for name in ("loss", "lr", "grad_norm", "throughput", "expert_load"):
        png = (out / "plots" / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000, name
    trace = json.loads((out / "profile" / "rank0_steps2-3.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "[memory]" in names and any("aten::" in str(n) for n in names)
    (out / "plots" / "loss.png").unlink()
    assert dstrain_main(["plot", str(out)]) == 0 and (out / "plots" / "loss.png").is_file()


def test_a_run_whose_routing_collapses_is_told_so_once(tmp_path, rank_pools, small_model):
    """No bias update, no balance loss and a far too high lr: every token goes to the same k experts."""
    from tests.helpers.runs import train

    flags = [
        "--lr",
        "0.05",
        "--moe_bias_update_speed",
        "0",
        "--moe_aux_loss_alpha",
        "0",
        "--max_steps",
        "24",
        "--no-plots",
        "--model",
        str(small_model),
    ]
    out = train(rank_pools, [*flags, "--output_dir", str(tmp_path / "run")]).stdout
    assert out.count("dstrain: warning: routing collapsed in layer(s) ") == 1, out[-3000:]
