"""Sparse attention's stages in a real run (`dstrain train --model FOLDER`, a transformers-written tiny V3.2 folder, each
in the 1-rank pool of ranks): what each trains, and the indexers' figures in metrics.jsonl and the eval rows. (The
`tiny-dsa` preset, whose 129K-token head is most of a step, trains in docs/training.md's runnable block.)"""

from __future__ import annotations

import json

import pytest
import torch

from dstrain.checkpoint.weights import iter_weights
from dstrain.train import main

STAGES = {  # stage -> which weights change: the indexers', the rest
    "dense": (True, False),
    "sparse": (True, True),
    "frozen": (False, True),
}


@pytest.fixture(scope="module")
def v32_folder(tmp_path_factory):
    from tests.helpers.hf import v32_config
    from tests.helpers.runs import hf_source

    return hf_source(tmp_path_factory.mktemp("v32") / "hf", v32_config(num_mtp_layers=1))


@pytest.mark.parametrize("stage", list(STAGES))
def test_each_stage_trains_what_it_says(stage, tmp_path, rank_pools, v32_folder):
    out = tmp_path / "run"
    args = [
        "--model",
        str(v32_folder),
        "--dsa_stage",
        stage,
        "--max_steps",
        "2",
        "--save_every",
        "1",
        "--keep_last",
        "0",
    ]
    args += ["--output_dir", str(out), "--num_workers", "0", "--eval_split", "0.05", "--eval_tokens", "2048"]
    args += ["--indexer_loss_coef", "1", "--lr", "1e-2", "--no-plots"]
    res = rank_pools.run(1, "tests.training.worker:cli_out", args)[0]  # `dstrain train ARGS`, in the pool
    assert res["rc"] == 0, res["stdout"][-3000:]
    ckpts = out / "checkpoints"
    first, last = (dict(iter_weights(ckpts / f"step_0000000{i}")) for i in (1, 2))
    changed = {k for k in first if not torch.equal(first[k], last[k])}
    indexers = {k for k in first if ".indexer." in k}
    assert indexers  # else the stage checks below hold for any run
    want_indexers, want_rest = STAGES[stage]
    assert (changed & indexers == indexers) if want_indexers else not changed & indexers
    rest = changed - indexers
    assert bool(rest) == want_rest, sorted(rest)[:5]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    if stage == "frozen":  # nothing learns from the KL: it is not computed in training
        assert all("indexer_loss" not in r for r in train)
    else:
        assert all(r["indexer_loss"] > 0 for r in train)
        assert all((r["indexer_recall"] is not None) == (stage == "dense") for r in train)
    assert evals and 0 < evals[-1]["eval_indexer_recall"] <= 1 and evals[-1]["eval_indexer_loss"] > 0
    if stage == "sparse":  # the export is a deepseek_v32 folder that transformers runs to the same logits
        from dstrain.cli import main as dstrain_main

        assert dstrain_main(["export", str(out), "--out", str(tmp_path / "hf"), "--verify"]) == 0
        assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "deepseek_v32"


def test_the_indexer_s_gradient_is_its_kl_s_mean_over_the_queries_that_hold_a_token(rank_pools, tmp_path):
    """Rows that end in padding: the KL's gradient factor is the coefficient over the step's real queries (those
    its logged figure averages: padding is in no KL, as in Megatron's packed path), not over every position."""
    res = rank_pools.run(1, "tests.training.worker:dsa_grad_scale", str(tmp_path))[0]
    assert res["real"] < res["positions"] and res["indexer_loss"] > 0
    assert res["scale"] == pytest.approx(res["coef"] / res["real"], rel=1e-6)


def test_stage_options_are_refused_for_a_model_without_sparse_attention(capsys):
    assert main(["--model", "tiny", "--dsa_stage", "dense", "--max_steps", "0"]) == 2
    assert "--dsa_stage / --indexer_loss_coef: deepseek_v3 has no sparse attention" in capsys.readouterr().err
