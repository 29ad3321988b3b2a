"""Single-process tests of the trainer's pieces: objective, schedule, options, DeepSpeed config resolution,
checkpoint bookkeeping, metrics. No process group, no DeepSpeed engine."""

from __future__ import annotations

import json

import pytest
import torch

from dstrain.config.options import ScheduleOptions
from dstrain.model import build_model
from dstrain.training.metrics import _truncate_after, measure_cpu_peak_tflops
from dstrain.training.objective import LossWeights, count_targets, micro_loss
from dstrain.training.schedule import lr_at
from tests.helpers.tiny import byte_tokenizer, tiny_config
from tests.helpers.trainer import GlobalRows, global_row, stack


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _split_grad(model, rows, micro: int, dp: int, w: LossWeights) -> tuple[torch.Tensor, float]:
    """Emulate DeepSpeed: per rank, GA micro batches each backward(loss/GA); then average over ranks."""
    model.zero_grad()
    n_rows = len(rows)
    ga = n_rows // (micro * dp)
    depth = model.config.num_nextn_predict_layers
    n = count_targets(stack(rows), depth).float()
    per_rank, total = [], 0.0
    for r in range(dp):
        model.zero_grad()
        for i in range(ga):
            start = (r * ga + i) * micro
            out = model(**stack(rows[start : start + micro]))
            loss = micro_loss(out, n, float(ga * dp), w)
            (loss / ga).backward()
            total += float(loss.detach()) / (ga * dp)
        per_rank.append(_grads(model).clone())
    return torch.stack(per_rank).mean(0), total


def test_global_mean_whatever_the_split():
    """GA=2 x micro 2 and GA=1 x micro 4 (and 2 ranks) give the global-batch loss and gradient to 1e-6,
    with a different number of targets in every micro batch."""
    torch.manual_seed(0)
    cfg = tiny_config(bias_update_speed=0.0)
    model = build_model(cfg, seed=0)
    rows = [global_row(i) for i in range(8)]
    counts = [int(count_targets(stack(rows[i : i + 2]), 1)[0]) for i in range(0, 8, 2)]
    assert len(set(counts)) > 1, counts
    w = LossWeights(alpha=cfg.aux_loss_alpha, lam=cfg.mtp_loss_weight)
    g_ref, l_ref = _split_grad(model, rows, micro=8, dp=1, w=w)
    for micro, dp in ((2, 1), (4, 1), (2, 2), (1, 2)):
        g, loss = _split_grad(model, rows, micro=micro, dp=dp, w=w)
        assert abs(loss - l_ref) <= 1e-6 * abs(l_ref), (micro, dp, loss, l_ref)
        assert torch.allclose(g, g_ref, rtol=1e-5, atol=1e-6), (micro, dp, (g - g_ref).abs().max())


def test_counts_and_local_loss_match_the_model():
    cfg = tiny_config(num_nextn_predict_layers=2)
    model = build_model(cfg, seed=1)
    batch = stack([global_row(i) for i in range(3)])
    out = model(**batch)
    n = count_targets(batch, 2)
    assert n.tolist() == [int(out.lm_tokens), *[int(c) for c in out.mtp_tokens]]
    # one micro batch, one rank: the global mean is the model's own local mean
    loss = micro_loss(out, n.float(), 1.0, LossWeights(alpha=cfg.aux_loss_alpha, lam=cfg.mtp_loss_weight))
    assert torch.allclose(loss, out.loss, rtol=1e-6)


def test_lr_schedule():
    def at(step: int, schedule: str, **kw) -> float:
        kw = {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 4, "max_steps": 14, **kw}
        return lr_at(step, ScheduleOptions(lr_schedule=schedule, **kw))

    assert at(1, "cosine") == pytest.approx(0.25)
    assert at(4, "cosine") == pytest.approx(1.0)
    assert at(9, "cosine") == pytest.approx(0.55)
    assert at(14, "cosine") == pytest.approx(0.1)
    assert at(14, "linear") == pytest.approx(0.1)
    assert at(9, "constant") == pytest.approx(1.0)
    assert at(1, "cosine", min_lr=0.0, warmup_steps=0, max_steps=10) > 0.97


def test_metrics_truncated_to_resume_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)) + '{"step": 6')
    _truncate_after(str(path), 3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_the_cpu_peak_is_measured_once_per_process_off_the_run_s_random_numbers():
    """A second run in a process (the Python API, a pool of ranks) reuses the figure, and timing it draws nothing
    from torch's global generator: a run's random numbers do not depend on whether it measured."""
    state = torch.get_rng_state()
    peak = measure_cpu_peak_tflops(torch.float32, seconds=0.01)
    assert peak > 0 and torch.equal(torch.get_rng_state(), state)
    assert measure_cpu_peak_tflops(torch.float32, seconds=0.01) == peak


def test_global_rows_independent_of_split():
    """The same global batch whatever micro x GA x world: the premise of the equality tests."""
    a = [GlobalRows(2, 2, r, 2) for r in range(2)]
    b = [GlobalRows(4, 1, r, 2) for r in range(2)]
    rows_a = torch.cat([next(x)["input_ids"] for x in a for _ in range(2)])
    rows_b = torch.cat([next(x)["input_ids"] for x in b])
    assert torch.equal(rows_a, rows_b)
    single = GlobalRows(8, 1, 0, 1)
    assert torch.equal(next(single)["input_ids"], rows_a)


def test_the_first_lines_say_what_trains():
    from dstrain.config.plan import prepare
    from dstrain.training.cli import what_trains
    from tests.helpers.trainer import make_options

    full = what_trains(prepare(make_options([]), 1, model=tiny_config()))
    assert full.startswith("dstrain: trains ") and "(100.00%); routers train; MTP trains" in full
    plan = prepare(
        make_options(["--model", "tiny-dsa", "--lora_r", "4", "--lora_targets", "o_proj,experts"]), 1
    )
    model = build_model(plan.model, seed=0)
    from dstrain.training.finetune import apply_finetune_options

    apply_finetune_options(model, plan.opts.lora, 0, plan.opts.model.dsa_stage)
    trains = sum(p.numel() for p in model.parameters() if p.requires_grad)
    line = what_trains(plan)
    assert f"({trains / sum(p.numel() for p in model.parameters()):.2%})" in line
    assert "LoRA r 4 on 5 modules (o_proj 3, experts 2); routers frozen; MTP frozen" in line  # 1 dense layer
    assert line.endswith("sparse attention stage sparse (--dsa_stage auto)")


def test_epochs_become_the_steps_of_that_many_passes(tmp_path, capsys, monkeypatch):
    import math

    from dstrain.config.options import parse_options
    from dstrain.config.plan import prepare
    from dstrain.data import epoch_rows
    from dstrain.errors import ConfigError
    from dstrain.training.cli import steps_of_epochs
    from tests.helpers.data_files import text_rows, write_jsonl

    path = write_jsonl(tmp_path / "t.jsonl", text_rows(50))
    opts = parse_options(["--data", path, "--seq_len", "64", "--epochs", "2.5", "--config", "zero1"])
    plan = prepare(opts, 1, model=tiny_config())
    monkeypatch.setattr("dstrain.data.load_tokenizer", lambda *a: byte_tokenizer())
    rows = epoch_rows(opts.data, byte_tokenizer())
    counted = steps_of_epochs(plan)
    assert counted.schedule.max_steps == math.ceil(2.5 * rows / plan.global_batch_rows)
    assert f"one pass is {rows} rows of 64 tokens" in capsys.readouterr().out
    again = prepare(counted, 1, model=tiny_config())  # the schedule is sized to them
    assert again.opts.schedule.max_steps == counted.schedule.max_steps
    with pytest.raises(ConfigError, match="--epochs and --max_steps: give one"):
        parse_options(["--epochs", "1", "--max_steps", "3"])
    assert opts.schedule.epochs == 2.5


def test_the_collapse_warning_fires_on_collapsed_routing_only():
    from dstrain.training.collapse import STEPS, CollapseWatch

    watch = CollapseWatch(experts=64, top_k=6)  # at most 10.67
    healthy = [{"layer_1": 1.4, "layer_2": 2.1}] * 10
    assert [watch.update(r, 3e-3) for r in healthy] == [None] * 10
    # layer 2 near its most from the first of these steps, layer 1 from the second: the line comes once, at
    # layer 2's third step, naming the layers collapsed for STEPS steps by then
    steps = [{"layer_1": 1.5, "layer_2": 10.6}] + [{"layer_1": 10.2, "layer_2": 10.67}] * (STEPS + 2)
    said = [watch.update(r, 3e-3) for r in steps]
    assert [i for i, line in enumerate(said) if line] == [STEPS - 1]
    line = said[STEPS - 1]
    assert line.startswith("dstrain: warning: routing collapsed in layer(s) 2: the busiest expert has 10.67")
    assert "at most 10.67 = experts / top-k" in line and "lower --lr (now 0.003)" in line
    assert CollapseWatch(64, 6).update({"layer_1": 10.67}, 1e-5) is None  # one step is no collapse


def test_the_runs_loaders_read_the_data_as_its_objective_does(tmp_path):
    """Issue 60.1 / 60.2: `--objective dpo` on chats is the data's one-line refusal before the model is built;
    SFT on pairs trains their chosen side (dstrain/data: tests/data/test_preference_users.py)."""
    from dstrain.config.options import parse_options
    from dstrain.config.plan import prepare
    from dstrain.dist import DistInfo
    from dstrain.errors import DataError
    from dstrain.training.trainer import Trainer
    from tests.helpers.data_files import chat_rows, write_jsonl

    chats = write_jsonl(tmp_path / "chats.jsonl", chat_rows(5))
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "q", "chosen": "good", "rejected": "bad"}])
    info = DistInfo(0, 1, 0, 1, torch.device("cpu"), "gloo")

    def trainer(args: list[str]) -> Trainer:
        plan = prepare(parse_options([*args, "--config", "zero1"]), 1, model=tiny_config())
        return Trainer(
            plan.with_output_dir(str(tmp_path / "run")), info, tokenizer=byte_tokenizer(), verbose=False
        )

    with pytest.raises(
        DataError, match=f"^data: --objective dpo trains on preference pairs, but {chats} reads as chat"
    ):
        trainer(["--data", chats, "--objective", "dpo", "--lora_r", "4"])._build_loader()
    loader = trainer(["--data", pairs, "--num_workers", "0", "--seq_len", "32"])._build_loader()
    assert [s.fmt for s in loader._sources] == ["chosen"]
    labels = next(loader)["labels"][0]
    assert byte_tokenizer().decode(labels[labels >= 0].tolist()) == "good<|im_end|>"


def test_the_cpu_peak_is_the_best_window_and_mfu_above_it_is_said_once(monkeypatch):
    """On a shared CPU the matmuls of some windows wait for other processes: the peak is the best window's
    rate, not the mean (which made MFU read 116%); a step above the peak anyway shows "mfu >100%" and one line
    saying the peak is low, metrics.jsonl keeping the figure."""
    from dstrain.training import metrics

    clock = {"t": 0.0, "calls": 0}
    fast, slow = 2.0**-10, 2.0**-8  # seconds a call (a product): exact in binary, so the windows end exactly

    def perf_counter() -> float:  # the first 9 calls (3 windows of 1 product) slow: interrupted windows
        clock["calls"] += 1
        clock["t"] += slow if clock["calls"] <= 9 else fast
        return clock["t"]

    monkeypatch.setattr(metrics.time, "perf_counter", perf_counter)
    window = 2.0**-7
    peak = metrics._time_matmuls.__wrapped__(torch.float32, 1, window * metrics.PEAK_WINDOWS)
    # an uninterrupted window: 7 products in 2^-7 s (a call starts it, the 8th ends it)
    assert peak == 2 * metrics.PEAK_N**3 * 7 / window / 1e12

    log = metrics.RunLog(None, tiny_config(), 1, 0.05, "measured matmul", 1)
    rec = {"loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0, "mfu": 1.16}
    assert metrics._short(rec).endswith("mfu >100%")
    assert metrics._short({**rec, "mfu": 0.5}).endswith("mfu 50.0%")
    note = log.over_peak(1.16)
    assert note.startswith("dstrain: MFU 116% against 0.05 TFLOP/s (measured matmul): that peak is too low")
    assert log.over_peak(1.2) is None and log.over_peak(0.5) is None


def test_the_dpo_progress_line_has_its_margin_and_accuracy_and_counts_read_right():
    from dstrain.training.metrics import _short, plural

    rec = {"loss": 0.6931, "lr": 1e-6, "grad_norm": 1.0, "tokens_per_s": 100.0, "mfu": 0.1}
    dpo = {**rec, "rewards/margins": 0.01234, "rewards/accuracies": 0.75}
    assert _short(dpo).startswith("loss 0.6931 margin 0.0123 acc 75.0% lr 1.00e-06")
    assert "margin" not in _short(rec)
    assert [plural(n, "step") for n in (0, 1, 2)] == ["0 steps", "1 step", "2 steps"]


def test_a_full_dpo_reference_says_how_far_it_reaches_and_how_to_go_further(tmp_path):
    """The table keeps the steps its pass covered (a resumed run going further extends it: test_dpo.py); a pair
    it never saw (the data changed) stops the run with what to do instead."""
    from dstrain.errors import DataError
    from dstrain.training.reference import Table

    table = Table({b"k" * 16: -3.5}, steps=12)
    table.save(tmp_path / "ref.safetensors")
    back = Table.load(tmp_path / "ref.safetensors")
    assert back.steps == 12 and back.lookup([b"k" * 16], torch.device("cpu")).tolist() == [-3.5]
    with pytest.raises(DataError) as info:
        back.lookup([b"x" * 16], torch.device("cpu"))
    message = str(info.value)
    assert "it read the data of the run's first 12 steps with the initial model" in message
    assert "a new run (another --output_dir) with the same --model and this --data" in message
    assert "`dstrain export` this run and fine-tune that folder as --model" in message
