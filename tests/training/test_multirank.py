"""2-rank DeepSpeed runs on CPU (gloo): ZeRO 1/2/3 against a plain PyTorch run of the same global batch,
exact resume, GA/micro-batch invariance, ZeRO-3 with idle experts, bf16, the NaN policy, and a rank killed
in the middle of a save. Each scenario runs in the session's pool of ranks (tests/training/worker.py), the
killed save in processes of its own."""

from __future__ import annotations

import pytest

from tests.helpers.ranks import launch
from tests.helpers.trainer import cached_reference

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def runs(tmp_path_factory, rank_pools):
    """runs(scenario, *args): the worker's scenario on 2 ranks (once per module) -> each rank's result."""
    out = str(tmp_path_factory.mktemp("multirank"))

    def run(scenario: str, *args):
        return rank_pools.cached((out, scenario, args), 2, f"tests.training.worker:{scenario}", out, *args)

    return run


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_matches_single_process_reference(runs, stage):
    """Per-step loss and pre-clip global grad norm equal a plain PyTorch run of the same global batch
    (clipping binding: every norm is above --clip_grad 0.5), and the expert bias ends up the same."""
    r0, r1 = runs("zero_runs", stage)
    ref = cached_reference(["--micro_batch_size", "2", "--max_steps", "6", "--clip_grad", "0.5"], 6, 4)
    got = r0["straight"]
    assert [g["step"] for g in got] == [1, 2, 3, 4, 5, 6]
    for g, want in zip(got, ref):
        assert want["grad_norm"] > 0.5
        assert _rel(g["loss"], want["loss"]) <= 1e-5, (g["loss"], want["loss"])
        assert _rel(g["grad_norm"], want["grad_norm"]) <= 1e-5, (g["grad_norm"], want["grad_norm"])
    assert [x["loss"] for x in got] == [x["loss"] for x in r1["straight"]]
    flat = [v for layer in ref[-1]["bias"] for v in layer]
    got_bias = [v for layer in r0["bias"] for v in layer]
    assert got_bias == pytest.approx(flat, abs=1e-7)
    assert r0["bias"] == r1["bias"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_is_bit_identical(runs, stage):
    r0, _ = runs("zero_runs", stage)
    straight = [x["loss"] for x in r0["straight"]]
    assert r0["resumed"] == straight[3:]
    assert r0["twice"] == straight[3:]


def test_evaluating_every_step_changes_nothing_in_training(runs):
    """ZeRO-3 with an evaluation after every step: the same losses and expert bias as the run without, the
    bias and the step's expert loads untouched by an evaluation, and the same figures evaluated twice."""
    got, other = runs("evaluated_every_step")
    (z3, _) = runs("zero_runs", 3)
    assert got["losses"] == [x["loss"] for x in z3["straight"]]
    assert got["bias"] == z3["bias"]
    assert got["evals"] == [1, 2, 3, 4, 5, 6]
    assert got["untouched"] and got["repeat_equal"]
    assert other["untouched"]


def test_ga_and_micro_split_give_the_same_step(runs):
    r0, _ = runs("ga_split")
    ref = cached_reference(["--micro_batch_size", "4", "--max_steps", "2", "--clip_grad", "0.5"], 2, 8)
    for a, b, want in zip(r0["ga2"], r0["ga1"], ref):
        assert a["target_tokens"] == b["target_tokens"]
        assert _rel(a["loss"], b["loss"]) <= 1e-6 and _rel(a["grad_norm"], b["grad_norm"]) <= 1e-6
        assert _rel(a["loss"], want["loss"]) <= 1e-6 and _rel(a["grad_norm"], want["grad_norm"]) <= 1e-6


def test_zero3_with_experts_idle_on_one_rank_completes(runs):
    r0, r1 = runs("idle_experts")
    assert r1["zero_experts"] >= 2  # rank 1 routed nothing to some experts
    assert r0["zero_experts"] == 0
    assert len(r0["losses"]) == 2 and all(x is not None for x in r0["losses"])


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_trains_with_fp32_expert_bias(runs, stage):
    got, other = runs("bf16_run", stage)
    assert got["param_dtype"] == "torch.bfloat16" and got["bias_dtypes"] == ["torch.float32"]
    assert got["bias"] == other["bias"]
    assert any(v != 0 for layer in got["bias"] for v in layer)
    fp32 = [x["loss"] for x in runs("zero_runs", 1)[0]["straight"][:3]]
    assert all(abs(a - b) < 0.01 for a, b in zip(got["losses"], fp32))


def test_nan_policy(runs):
    r0, r1 = runs("nan_policies")
    stop = r0["stop"]
    assert stop["error"].startswith("NonFiniteLossError: step 2: non-finite loss")
    assert r1["stop"]["error"] == stop["error"]  # rank 0's loss was finite: the ranks agreed
    assert [h["step"] for h in stop["history"]] == [1]
    skip = r0["skip"]
    assert skip["error"] is None
    assert [h["skipped"] for h in skip["history"]] == [False, True, False]
    sums = skip["param_sums"]
    assert sums[1] == sums[0] and sums[2] != sums[1]  # the skipped step left the weights alone
    assert skip["history"][0]["loss"] == runs("zero_runs", 1)[0]["straight"][0]["loss"]


def test_killed_during_save_resumes_from_previous(runs, rank_pools, tmp_path):
    """Rank 1 SIGKILLs itself after DeepSpeed wrote step 6 but before COMPLETE: step 3 stays the newest
    complete checkpoint, and the next run continues from it with the same losses as a straight run."""
    straight = [x["loss"] for x in runs("zero_runs", 1)[0]["straight"]]
    env = {"DSTRAIN_TEST_KILL_DURING_SAVE": "6"}
    first = launch(["-m", "tests.training.worker", "kill", str(tmp_path)], env=env, timeout=300)
    assert first.returncode != 0
    ckpts = tmp_path / "killed" / "checkpoints"
    assert (ckpts / "step_00000003" / "COMPLETE").is_file()
    assert (ckpts / "step_00000006").is_dir() and not (ckpts / "step_00000006" / "COMPLETE").exists()
    assert (ckpts / "latest").read_text() == "step_00000003"
    res = rank_pools.run(2, "tests.training.worker:killed_run", str(tmp_path))[0]
    assert res["start_step"] == 3
    assert res["losses"] == straight[3:]
    assert (ckpts / "step_00000006" / "COMPLETE").is_file()
