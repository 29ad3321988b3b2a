"""What rank 0 shows and records: metrics.jsonl (training and eval rows), expert_load.jsonl, TensorBoard
events, a progress bar (or plain lines off a terminal), wandb, DeepSpeed's monitors; MFU against a device
peak; profiler traces."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from collections import deque
from typing import Any

import torch

from dstrain.atomic import write_atomic

# Dense bf16 tensor-core peaks (TFLOP/s) by a substring of torch.cuda.get_device_name(); fp32 runs use TF32.
GPU_PEAK_TFLOPS = [
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200 NVL", 835.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H800 PCIe", 756.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("RTX 4090", 165.0),
    ("RTX 3090", 71.0),
    ("V100", 125.0),
    ("T4", 65.0),
    ("MI300X", 1307.0),
    ("MI250X", 383.0),
]


def measure_cpu_peak_tflops(dtype: torch.dtype = torch.float32, seconds: float = 0.1) -> float:
    """Achievable matmul TFLOP/s of this process's CPU threads: a cheap stand-in for a datasheet peak, paid by
    every run at start, once per process for a dtype and thread count (a second run in the same process, e.g.
    from the Python API, reuses it). The best of PEAK_WINDOWS windows: on a CPU other processes share, one
    window's mean took 0.023-0.103 TFLOP/s between runs (and a step then ran above "100%"); a window nobody
    interrupted is the peak."""
    return _time_matmuls(dtype, torch.get_num_threads(), seconds)


PEAK_WINDOWS = 10
PEAK_N = 256  # a few milliseconds a product: many fit in a window that nothing else interrupts


@functools.cache
def _time_matmuls(dtype: torch.dtype, threads: int, seconds: float) -> float:
    """The figure, for the `threads` the process runs now (part of the key: a thread count set later measures
    again)."""
    n = PEAK_N
    draw = torch.Generator().manual_seed(0)  # not the global one: a run's random numbers stay the run's
    a, b = (torch.randn(n, n, dtype=dtype, generator=draw) for _ in range(2))
    a @ b  # warm-up (thread pool, kernel choice)
    best = 0.0
    for _ in range(PEAK_WINDOWS):
        reps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds / PEAK_WINDOWS:
            a @ b
            reps += 1
        best = max(best, 2 * n**3 * reps / elapsed / 1e12)
    return best


def device_peak_tflops(device: torch.device, precision: str, override: float | None) -> tuple[float, str]:
    """(peak TFLOP/s of one device, where the figure comes from)."""
    if override:
        return override, "--peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK_TFLOPS:
            if key in name:
                return (peak if precision == "bf16" else peak / 2), f"table ({name})"
        return float("nan"), f"unknown GPU {name!r}: pass --peak_tflops"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return measure_cpu_peak_tflops(dtype), "measured matmul"


class Display:
    """Rank 0's console: a tqdm bar on a terminal, one plain line every `log_every` steps otherwise."""

    def __init__(self, total: int, start: int, log_every: int, enabled: bool) -> None:
        self.enabled = enabled
        self.log_every = log_every
        self.total = total
        self.bar = None
        if enabled and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", dynamic_ncols=True, file=sys.stdout)

    def update(self, rec: dict[str, Any], eta_s: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(_short(rec), refresh=False)
            self.bar.update(1)
        elif rec["step"] % self.log_every == 0 or rec["step"] == self.total:
            print(f"step {rec['step']}/{self.total} {_short(rec)} eta {_fmt_eta(eta_s)}", flush=True)

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _short(rec: dict[str, Any]) -> str:
    mfu = rec.get("mfu")
    parts = [
        f"loss {rec['loss']:.4f}",
        f"lr {rec['lr']:.2e}",
        f"gnorm {rec['grad_norm']:.3f}" if rec.get("grad_norm") is not None else "gnorm -",
        f"tok/s {rec['tokens_per_s']:.0f}",
        _mfu(mfu),
    ]
    if rec.get("rewards/accuracies") is not None:  # DPO: what its eval line says too
        parts[1:1] = [f"margin {rec['rewards/margins']:.4f}", f"acc {100 * rec['rewards/accuracies']:.1f}%"]
    if rec.get("skipped"):
        parts.append("SKIPPED (non-finite loss)")
    return " ".join(parts)


def plural(n: int, word: str) -> str:
    """`1 step`, `2 steps`, `0 steps`."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _mfu(mfu: float | None) -> str:
    if mfu is None or not math.isfinite(mfu):
        return "mfu -"
    # above the peak is a peak measured low (RunLog.over_peak says so once), not a figure to show
    return f"mfu {100 * mfu:.1f}%" if mfu <= 1 else "mfu >100%"


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


METRICS_FILE = "metrics.jsonl"
EXPERT_LOAD_FILE = "expert_load.jsonl"


def finite_or_none(x: float | None) -> float | None:
    """JSON has no NaN/Inf: non-finite values are recorded as null."""
    if x is None or not math.isfinite(x):
        return None
    return x


class RunLog:
    """What the loop records beside each step's own figures: MFU (the step's model FLOPs over the peak of every
    device of the world: each rank works on the step's tokens, a pipeline stage or TP shard on its share), an
    ETA from the last 20 step times, and the expert loads summed over the steps since the last
    expert_load.jsonl row (one every `log_every` steps)."""

    def __init__(
        self, sink: MetricsSink, cfg: Any, world_size: int, peak: float, peak_source: str, log_every: int
    ) -> None:
        self.sink, self.cfg, self.world_size = sink, cfg, world_size
        self.peak, self.peak_source, self.log_every = peak, peak_source, log_every
        self.recent: deque[float] = deque(maxlen=20)
        self.flops_per_token: dict[int, float] = {}
        self.load: torch.Tensor | None = None
        self.over = False

    def over_peak(self, mfu: float | None) -> str | None:
        """The one line, the first time a step's MFU is above 1: the peak it is measured against is too low
        (the progress line then shows "mfu >100%"; metrics.jsonl keeps the figure)."""
        if self.over or mfu is None or mfu <= 1:
            return None
        self.over = True
        return (
            f"dstrain: MFU {100 * mfu:.0f}% against {self.peak:.3g} TFLOP/s ({self.peak_source}): that peak is "
            "too low (a CPU shared with other processes measures low); --peak_tflops sets the device's"
        )

    def mfu(self, rec: dict[str, Any]) -> float | None:
        from dstrain.model import flops_per_token

        seq = rec["seq_len"]
        if seq not in self.flops_per_token:
            self.flops_per_token[seq] = flops_per_token(self.cfg, seq)
        if not self.peak > 0:  # unknown GPU: NaN
            return None
        return finite_or_none(
            rec["tokens_per_s"] * self.flops_per_token[seq] / (self.world_size * self.peak * 1e12)
        )

    def eta_s(self, rec: dict[str, Any], steps_left: int) -> float:
        self.recent.append(rec["step_time_s"])
        return steps_left * sum(self.recent) / len(self.recent)

    def expert_load(self, step: int, layer_ids: list[int], load: torch.Tensor, flush: bool) -> None:
        self.load = load if self.load is None else self.load + load
        if step % self.log_every == 0 or flush:
            self.sink.log_load(step, layer_ids, self.load)
            self.load = None


class MetricsSink:
    """Rank 0's records. metrics.jsonl: one object per optimizer step (key "loss") and one per evaluation (key
    "eval_loss"); expert_load.jsonl: {"step", "layers": {MoE layer id: each expert's share of the routed
    assignments since the previous row}}; TensorBoard events under tensorboard/ (train/*, eval/*); wandb and
    DeepSpeed monitors. A resumed run drops the rows after its checkpoint's step (and TensorBoard's events)."""

    def __init__(
        self,
        output_dir: str,
        enabled: bool,
        start_step: int = 0,
        monitor: Any = None,
        tensorboard: bool = False,
    ) -> None:
        self.enabled = enabled
        self.path = os.path.join(output_dir, METRICS_FILE)
        self.load_path = os.path.join(output_dir, EXPERT_LOAD_FILE)
        self.file = self.load_file = self.tb = None
        if enabled:
            os.makedirs(output_dir, exist_ok=True)
            _truncate_after(self.path, start_step)
            _truncate_after(self.load_path, start_step)
            self.file = open(self.path, "a")  # noqa: SIM115 - lives as long as the run
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: events a resumed run writes again replace those of the interrupted one
                self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard"), purge_step=start_step + 1)
        self.monitor = (
            monitor if enabled and monitor is not None and getattr(monitor, "enabled", False) else None
        )
        self.wandb = None

    def start_wandb(
        self, project: str, mode: str, name: str, run_id: str | None, config: dict[str, Any]
    ) -> str:
        """-> the run id (kept in checkpoints so a resumed run continues the same wandb run)."""
        import wandb

        run = wandb.init(
            project=project,
            mode=mode,
            name=name,
            id=run_id,
            resume="allow",
            config=config,
            dir=os.path.dirname(self.path),
        )
        self.wandb = run
        return run.id

    def log(self, rec: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        flat = _flatten(rec)
        step = rec["step"]
        if self.wandb is not None:
            self.wandb.log(flat, step=step)
        kind = "eval" if "eval_loss" in rec else "train"
        if self.tb is not None:
            for k, v in flat.items():
                if k != "step":
                    self.tb.add_scalar(f"{kind}/{k.removeprefix('eval_')}", v, step)
            self.tb.flush()
        if self.monitor is not None:
            self.monitor.write_events(
                [(f"{kind.title()}/{k}", v, step) for k, v in flat.items() if k != "step"]
            )

    def log_load(self, step: int, layer_ids: list[int], load: torch.Tensor) -> None:
        """Expert loads (MoE layers, E) summed over some steps -> a row of expert_load.jsonl (shares)."""
        if not self.enabled:
            return
        shares = (load / load.sum(dim=1, keepdim=True).clamp(min=1)).tolist()
        row = {"step": step, "layers": {str(i): [round(x, 6) for x in r] for i, r in zip(layer_ids, shares)}}
        if self.load_file is None:
            self.load_file = open(self.load_path, "a")  # noqa: SIM115 - lives as long as the run
        self.load_file.write(json.dumps(row) + "\n")
        self.load_file.flush()

    def close(self) -> None:
        for f in (self.file, self.load_file, self.tb):
            if f is not None:
                f.close()
        if self.wandb is not None:
            self.wandb.finish()


def _flatten(rec: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in rec.items():
        if isinstance(v, list):  # per MTP depth
            v = {f"depth{i}": x for i, x in enumerate(v, start=1)}
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None:
            out[f"{prefix}{k}"] = v
    return out


def _truncate_after(path: str, step: int) -> None:
    """Keep the records of steps <= step: a resumed run re-logs the steps after its checkpoint."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):
                continue
    write_atomic(path, "".join(keep))


class Profiler:
    """A torch profiler recording from construction (CPU ops, CUDA kernels on a GPU, memory) until `finish`."""

    def __init__(self, device: torch.device) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.prof = profile(activities=activities, record_shapes=True, profile_memory=True, with_stack=False)
        self.prof.__enter__()

    def finish(self, output_dir: str, rank: int, window: tuple[int, int]) -> str:
        """Stop and write the Chrome/Perfetto trace; -> its path."""
        self.prof.__exit__(None, None, None)
        path = os.path.join(output_dir, "profile", f"rank{rank}_steps{window[0]}-{window[1]}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.prof.export_chrome_trace(path)
        return path
