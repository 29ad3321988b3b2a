"""`dstrain plot RUN_DIR`: PNG plots of a run's metrics.jsonl (and expert_load.jsonl) into RUN_DIR/plots/.

Safe on a run still going: a line cut mid-write is skipped, and each PNG is replaced atomically so an image
viewer refreshing it never reads half a file."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

from matplotlib.colors import LogNorm
from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
from matplotlib.ticker import EngFormatter, FuncFormatter, MaxNLocator

from dstrain.cmdline import command_parser
from dstrain.errors import UserError

from .metrics import EXPERT_LOAD_FILE, METRICS_FILE

SIZE, DPI = (8, 4.5), 110
SMOOTH_FROM = 20  # fewer points than this are readable raw
MAX_LAYERS = 12  # more heatmaps than this stacked in one image become slivers
LOAD_RANGE = (0.25, 4.0)  # colour scale of load / uniform; log-symmetric so 1.0 (balanced) sits mid-scale


def _rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # the writer may be mid-line, or the file was cut by a crash
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def _latest(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step, the last written winning (a resumed run repeats the steps after its checkpoint)."""
    return [row for _, row in sorted({row["step"]: row for row in rows}.items())]


def _finite(v: Any) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if ok else None


def _xy(rows: list[dict[str, Any]], x: str, y: str, scale: float = 1.0) -> tuple[list[float], list[float]]:
    pairs = [(_finite(r.get(x)), _finite(r.get(y))) for r in rows]
    pairs = [(a, b * scale) for a, b in pairs if a is not None and b is not None]
    return [a for a, _ in pairs], [b for _, b in pairs]


def _smooth(ys: list[float]) -> list[float]:
    """Centred moving average over ~1/20 of the run. Centred, not an EMA: an EMA lags a falling loss, which
    would draw training loss above eval loss that is really below it. The window narrows symmetrically at
    the ends so the first and last points are not pulled towards the middle."""
    half = max(1, len(ys) // 40)
    out = []
    for i in range(len(ys)):
        h = min(half, i, len(ys) - 1 - i)
        out.append(sum(ys[i - h : i + h + 1]) / (2 * h + 1))
    return out


def _line(ax: Any, xs: list[float], ys: list[float], **kw: Any) -> None:
    # A single point draws no line: give it a marker so a 1-step run is not an empty plot.
    if len(xs) == 1:
        kw.setdefault("marker", "o")
    ax.plot(xs, ys, **kw)


def _figure(title: str) -> tuple[Figure, Any]:
    fig = Figure(figsize=SIZE, dpi=DPI, layout="constrained")
    ax = fig.subplots()
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig: Figure, path: Path) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path


def _loss(train: list[dict], evals: list[dict], title: str) -> Figure:
    # Tokens, not steps, so runs with different batch sizes compare; steps if a row lacks the count.
    x = "tokens" if all(_finite(r.get("tokens")) is not None for r in train + evals) else "step"
    y = "lm_loss" if any(_finite(r.get("lm_loss")) is not None for r in train) else "loss"
    fig, ax = _figure(title)
    what = "train LM loss" if y == "lm_loss" else "train loss"
    xs, ys = _xy(train, x, y)
    mx, my = _xy(train, x, "mtp_loss")
    ex, ey = _xy(evals, x, "eval_loss")
    raw, smooth, smooth_mtp = ys, len(ys) >= SMOOTH_FROM, len(my) >= SMOOTH_FROM
    if smooth:
        ax.plot(xs, raw, color="C0", lw=1, alpha=0.3, label=f"{what} (raw)")
        ys = _smooth(ys)
    _line(ax, xs, ys, color="C0", lw=2 if smooth else 1.5, label=what + (" (smoothed)" if smooth else ""))
    if my:
        my = _smooth(my) if smooth_mtp else my
        _line(ax, mx, my, color="C2", lw=1, label="train MTP loss" + (" (smoothed)" if smooth_mtp else ""))
    if ey:
        ax.plot(ex, ey, "o-", color="C3", lw=1.5, ms=5, label="eval loss")
    if smooth:
        # Fit the axis to the smoothed and eval curves: a single bad batch spiking the raw loss would
        # otherwise squash everything else flat. The spike runs off the top, still visible as a spike.
        low, top = min(raw + ey), max(ys + my + ey)
        ax.set_ylim(low - 0.05 * (top - low), top + 0.05 * (top - low))
    ax.set_xlabel("tokens trained" if x == "tokens" else "step")
    ax.xaxis.set_major_formatter(EngFormatter(unit="", sep=""))
    ax.set_ylabel("loss (nats / token)")
    if len(ax.get_lines()) > 1:
        ax.legend()
    return fig


def _lr(train: list[dict], title: str) -> Figure:
    fig, ax = _figure(title)
    _line(ax, *_xy(train, "step", "lr"), color="C1")
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.1e}" if v else "0"))
    ax.set_ylim(bottom=0)
    return fig


def _grad_norm(train: list[dict], title: str) -> Figure:
    fig, ax = _figure(title)
    xs, ys = _xy(train, "step", "grad_norm")
    _line(ax, xs, ys, color="C4", lw=1)
    positive = [y for y in ys if y > 0]
    if positive and max(positive) / min(positive) > 100:
        ax.set_yscale("log")
    skipped = [r["step"] for r in train if r.get("skipped") is True]
    if skipped:
        # At the bottom edge (axes coordinates), since a skipped step usually has no finite norm to plot.
        ax.plot(skipped, [0.0] * len(skipped), "^", color="red", ms=7, clip_on=False,
                transform=ax.get_xaxis_transform(), label=f"skipped update ({len(skipped)})")  # fmt: skip
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("gradient L2 norm (before clipping)")
    return fig


def _throughput(train: list[dict], title: str) -> Figure:
    fig, ax = _figure(title)
    xs, ys = _xy(train, "step", "tokens_per_s")
    smooth = len(ys) >= SMOOTH_FROM
    label = "tokens/s" + (" (raw)" if smooth else "")
    _line(ax, xs, ys, color="C0", lw=1, alpha=0.35 if smooth else 1, label=label)
    if smooth:
        ax.plot(xs, _smooth(ys), color="C0", lw=2, label="tokens/s (smoothed)")
    ax.set_ylim(0, max(ys, default=1) * 1.15)  # headroom so a steady rate is not drawn on the frame
    ax.yaxis.set_major_formatter(EngFormatter(unit="", sep=""))
    ax.set_xlabel("step")
    ax.set_ylabel("throughput (tokens / s, all ranks)")
    handles = ax.get_lines()
    mx, my = _xy(train, "step", "mfu", scale=100)
    if my:
        right = ax.twinx()
        # MFU is tokens/s times a constant (at a fixed seq_len) and both axes start at 0 with the same
        # headroom, so the two curves coincide: dashed, so the tokens/s line still shows underneath.
        label = "MFU" + (" (smoothed)" if smooth else "")
        _line(right, mx, _smooth(my) if smooth else my, color="C1", lw=1.5, ls="--", label=label)
        right.set_ylim(0, max(my) * 1.15)
        right.set_ylabel("MFU (% of peak FLOP/s)", color="C1")
        right.tick_params(axis="y", colors="C1")
        handles += right.get_lines()
    if len(handles) > 1:
        ax.legend(handles=handles, loc="lower right")
    return fig


def _indexer(train: list[dict], evals: list[dict], title: str) -> Figure | None:
    """Sparse attention: the indexers' KL (train, eval) and their recall, the main attention's mass inside
    the chosen keys (dense-stage training rows, eval rows); None for a model without indexers."""
    if not any(
        _finite(r.get(k)) is not None for r in train + evals for k in ("indexer_loss", "eval_indexer_loss")
    ):
        return None
    fig, ax = _figure(title)
    for rows, key, label, style in (
        (train, "indexer_loss", "train KL", "-"),
        (evals, "eval_indexer_loss", "eval KL (dense)", "o-"),
    ):
        xs, ys = _xy(rows, "step", key)
        if ys:
            _line(ax, xs, ys, ls=style[-1], marker="o" if style == "o-" else None, color="C0", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("KL(target || indexer)")
    right = ax.twinx()
    for rows, key, label in (
        (train, "indexer_recall", "train recall"),
        (evals, "eval_indexer_recall", "eval recall"),
    ):
        xs, ys = _xy(rows, "step", key)
        if ys:
            _line(
                right,
                xs,
                ys,
                color="C3",
                ls="--" if rows is train else "-",
                marker="o" if rows is evals else None,
                label=label,
            )
    right.set_ylabel("recall (attention mass chosen)")
    right.set_ylim(0, 1.02)
    lines = ax.get_lines() + right.get_lines()
    ax.legend(lines, [line.get_label() for line in lines])
    return fig


def _rewards(train: list[dict], evals: list[dict], title: str) -> Figure | None:
    """--objective dpo: the reward margin (train, eval) and the share of pairs ranked right; None for another
    objective's run."""
    if not any(_finite(r.get("rewards/margins")) is not None for r in train):
        return None
    fig, ax = _figure(title)
    right = ax.twinx()
    curves = (
        (ax, "rewards/margins", "C0", "margin", "-"),
        (right, "rewards/accuracies", "C3", "accuracy", "--"),
    )
    for axis, key, color, what, ls in curves:
        xs, ys = _xy(train, "step", key)
        smooth = len(ys) >= SMOOTH_FROM  # a step's figures over a few pairs are noisy
        if smooth:
            axis.plot(xs, ys, color=color, lw=1, alpha=0.3, ls=ls)
            ys = _smooth(ys)
        _line(axis, xs, ys, color=color, ls=ls, label=f"train {what}" + (" (smoothed)" if smooth else ""))
        ex, ey = _xy(evals, "step", f"eval_{key}")
        if ey:
            axis.plot(ex, ey, "o-", color=color, lw=1.5, ms=5, label=f"eval {what}")
    ax.axhline(0.0, color="grey", lw=0.8)  # the reference's margin: every reward is 0 at step 1
    ax.set_xlabel("step")
    ax.set_ylabel("reward margin (chosen − rejected)", color="C0")
    right.set_ylabel("accuracy (share of pairs ranked right)", color="C3")
    right.set_ylim(0, 1.02)
    lines = [line for line in ax.get_lines() + right.get_lines() if not line.get_label().startswith("_")]
    ax.legend(lines, [line.get_label() for line in lines], loc="lower right")
    return fig


def _expert_load(rows: list[dict], title: str) -> Figure | None:
    rows = [r for r in _latest(rows) if isinstance(r.get("layers"), dict)]
    has = {k for r in rows for k, v in r["layers"].items() if isinstance(v, list) and v}
    layers = sorted(has, key=lambda k: (len(k), k))  # "2" < "10"
    if not layers:
        return None
    shown = layers
    if len(layers) > MAX_LAYERS:
        shown = [layers[round(i * (len(layers) - 1) / (MAX_LAYERS - 1))] for i in range(MAX_LAYERS)]
        title += f" ({MAX_LAYERS} of {len(layers)} layers, evenly spaced)"
    # Each row covers the steps since the previous one (the first: since step 0, or one logging interval).
    steps = [r["step"] for r in rows]
    first = steps[0] - (steps[1] - steps[0] if len(steps) > 1 else 1)
    edges = [max(min(0, steps[0] - 1), first)] + steps
    height = min(2.0 + 1.4 * len(shown), 18)
    fig = Figure(figsize=(8, height), dpi=DPI, layout="constrained")
    axes = fig.subplots(len(shown), 1, sharex=True, squeeze=False)[:, 0]
    fig.suptitle(title)
    norm = LogNorm(*LOAD_RANGE)
    for ax, layer in zip(axes, shown):
        shares = [r["layers"].get(layer) if isinstance(r["layers"].get(layer), list) else [] for r in rows]
        n = max(len(s) for s in shares)
        # share x n_experts = load relative to a perfectly even router. A dead expert (0) is clamped into the
        # bottom colour rather than vanishing as log(0); a missing value (NaN) is left blank.
        cols = [[math.nan if (v := _finite(x)) is None else max(v * len(s), 1e-6) for x in s] for s in shares]
        grid = list(zip(*(c + [math.nan] * (n - len(c)) for c in cols)))  # rows: experts, columns: steps
        mesh = ax.pcolormesh(edges, [e - 0.5 for e in range(n + 1)], grid, cmap="RdBu_r", norm=norm)
        ax.set_ylabel(f"layer {layer}\nexpert")
        ax.yaxis.set_major_locator(MaxNLocator(nbins=4, integer=True))
    axes[-1].set_xlabel("step")
    bar = fig.colorbar(mesh, ax=list(axes), extend="both", shrink=min(1.0, 5 / height))  # ≤ 5 in tall
    bar.set_label("load / uniform (1 = balanced)")
    bar.set_ticks([0.25, 0.5, 1, 2, 4], labels=["≤0.25", "0.5", "1", "2", "≥4"])
    bar.minorticks_off()
    return fig


def write_plots(run_dir: str | Path) -> list[Path]:
    """Write loss, lr, grad_norm, throughput (and expert_load, indexer, DPO's rewards when recorded) PNGs into
    RUN_DIR/plots/."""
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    rows = _rows(path) if path.is_file() else []
    train = _latest([r for r in rows if "loss" in r])
    evals = _latest([r for r in rows if "eval_loss" in r and "loss" not in r])
    if not train:
        raise UserError(f"{path}: no training metrics to plot")
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    name = run_dir.resolve().name
    figures = {
        "loss": _loss(train, evals, f"Loss · {name}"),
        "lr": _lr(train, f"Learning rate · {name}"),
        "grad_norm": _grad_norm(train, f"Gradient norm · {name}"),
        "throughput": _throughput(train, f"Training speed · {name}"),
        "indexer": _indexer(train, evals, f"Sparse attention indexers · {name}"),
        "rewards": _rewards(train, evals, f"DPO rewards · {name}"),
    }
    load = run_dir / EXPERT_LOAD_FILE
    if load.is_file():
        figures["expert_load"] = _expert_load(_rows(load), f"Expert load per MoE layer · {name}")
    return [_save(fig, out / f"{key}.png") for key, fig in figures.items() if fig is not None]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = command_parser("dstrain plot", "Write PNG plots of a run's metrics into RUN_DIR/plots/.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's output folder (holds metrics.jsonl)")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    for path in write_plots(args.run_dir):
        print(path)
    return 0
