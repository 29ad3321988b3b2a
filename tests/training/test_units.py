"""Single-process tests of the trainer's pieces: objective, schedule, options, DeepSpeed config resolution,
checkpoint bookkeeping, metrics. No process group, no DeepSpeed engine."""

from __future__ import annotations

import json

import pytest
import torch

from dstrain.config.options import ScheduleOptions
from dstrain.model import build_model
from dstrain.training.metrics import _truncate_after
from dstrain.training.objective import LossWeights, count_targets, micro_loss
from dstrain.training.schedule import lr_at
from tests.helpers.tiny import tiny_config
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


def test_global_rows_independent_of_split():
    """The same global batch whatever micro x GA x world: the premise of the equality tests."""
    a = [GlobalRows(2, 2, r, 2) for r in range(2)]
    b = [GlobalRows(4, 1, r, 2) for r in range(2)]
    rows_a = torch.cat([next(x)["input_ids"] for x in a for _ in range(2)])
    rows_b = torch.cat([next(x)["input_ids"] for x in b])
    assert torch.equal(rows_a, rows_b)
    single = GlobalRows(8, 1, 0, 1)
    assert torch.equal(next(single)["input_ids"], rows_a)
