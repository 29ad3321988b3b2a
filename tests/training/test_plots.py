"""`dstrain plot`: PNGs from a synthetic run folder (MoE with eval and MTP, dense without eval, DPO, none)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from dstrain.cli import main as dstrain_main
from dstrain.training import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL = {"loss.png", "lr.png", "grad_norm.png", "throughput.png", "expert_load.png"}


def _write_run(run_dir: Path, *, moe: bool, evals: bool, steps: int = 30) -> None:
    lines = []
    for step in range(1, steps + 1):
        loss = 10 * math.exp(-step / 10) + 3
        lines.append(
            {
                "step": step,
                "loss": loss + 0.1,
                "lm_loss": loss,
                "mtp_loss": loss + 0.4 if moe else None,
                "aux_loss": 0.001 if moe else None,
                "lr": 3e-4 * min(1, step / 5),
                "grad_norm": None if step == 7 else 1 / step,
                "tokens": 4096 * step,
                "target_tokens": 4096 * steps,
                "skipped": step == 7,
                "step_time_s": 0.4,
                "tokens_per_s": 10240.0 + step,
                "seq_len": 512,
                "moe_imbalance": {"layer_1": 1.3} if moe else {},
                "mfu": 0.2 if moe else None,
                "some_future_key": [1, 2],
            }
        )
        if evals and step % 10 == 0:
            lines.append(
                {"step": step, "tokens": 4096 * step, "eval_loss": loss, "eval_ppl": math.exp(loss),
                 "eval_mtp_loss": [loss + 0.3], "eval_mtp_acc": 0.3, "eval_tokens": 12000, "eval_time_s": 1.2}
            )  # fmt: skip
    lines.append({"step": 3, "loss": None, "lm_loss": None, "tokens": 4096 * 3, "skipped": True})  # resumed
    text = "\n".join(json.dumps(row) for row in lines)
    (run_dir / "metrics.jsonl").write_text(text + '\n{"step": 31, "loss": 2.9, "lm_lo')  # cut mid-write
    if moe:
        load = [{"step": s, "layers": {str(k): [0.3] + [0.1] * 7 for k in (1, 2)}} for s in (10, 20, 30)]
        (run_dir / "expert_load.jsonl").write_text("\n".join(json.dumps(row) for row in load) + "\n")


def _assert_pngs(paths: list[Path], names: set[str]) -> None:
    assert {p.name for p in paths} == names
    for p in paths:
        assert p.parent.name == "plots"
        assert p.read_bytes()[:8] == PNG_MAGIC


def test_moe_run_with_eval_and_a_truncated_line(tmp_path: Path, capsys) -> None:
    _write_run(tmp_path, moe=True, evals=True)
    _assert_pngs(plots.write_plots(tmp_path), ALL)
    assert dstrain_main(["plot", str(tmp_path)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(ALL)


def test_dense_run_without_eval(tmp_path: Path) -> None:
    _write_run(tmp_path, moe=False, evals=False)
    _assert_pngs(plots.write_plots(tmp_path), ALL - {"expert_load.png"})


def test_single_step(tmp_path: Path) -> None:
    _write_run(tmp_path, moe=True, evals=False, steps=1)
    _assert_pngs(plots.write_plots(tmp_path), ALL)


def test_dpo_run_adds_the_rewards_plot(tmp_path: Path) -> None:
    _write_run(tmp_path, moe=True, evals=True)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()[:-1]]
    for row in rows:  # TRL's names, as a --objective dpo run writes them (train and eval rows)
        prefix = "eval_" if "eval_loss" in row else ""
        margin = 0.01 * row["step"]
        row.update(
            {f"{prefix}rewards/margins": margin, f"{prefix}rewards/accuracies": min(1.0, 0.5 + margin)}
        )
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    _assert_pngs(plots.write_plots(tmp_path), ALL | {"rewards.png"})
    fig = plots._rewards(*_train_and_eval(rows), "t")
    curves = {line.get_label(): line.get_ydata() for ax in fig.axes for line in ax.get_lines()}
    assert list(curves["eval margin"]) == [0.1, 0.2, 0.3] and list(curves["eval accuracy"]) == [0.6, 0.7, 0.8]
    assert len(curves["train margin (smoothed)"]) == 30  # one point a step (the resumed step 3's row wins)


def _train_and_eval(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    train = plots._latest([r for r in rows if "loss" in r])
    return train, plots._latest([r for r in rows if "eval_loss" in r and "loss" not in r])


def test_missing_or_empty_metrics(tmp_path: Path, capsys) -> None:
    assert dstrain_main(["plot", str(tmp_path)]) == 2
    assert "dstrain: error:" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 5, "tokens": 10, "eval_loss": 3.0}\n')
    assert dstrain_main(["plot", str(tmp_path)]) == 2
    assert "no training metrics to plot" in capsys.readouterr().err
    assert not (tmp_path / "plots").exists()
