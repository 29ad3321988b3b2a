"""The Python parts of launch/bench_gpu.sh (one GPU):

  python launch/gpu_report.py folder OUT             # the V2-Lite-4 folder: DeepSeek-V2-Lite's shapes cut to 4
                                                     # layers, V3's vocabulary (129280), MTP on (bf16 weights)
  python launch/gpu_report.py run NAME METRICS.jsonl # a run's tokens/s and MFU: medians over its steps after
                                                     # the first WARMUP (compilation, allocator warm-up)
  python launch/gpu_report.py trace TRACE.json [N]   # a --profile_steps trace: GPU busy share of the window,
                                                     # the top N kernels, kernel time by family

Unmeasured so far (written without a GPU): the first run on one will say what needs fixing."""

from __future__ import annotations

import collections
import json
import re
import statistics
import sys
from pathlib import Path

WARMUP = 3
FAMILIES = (  # the first pattern a kernel's name matches names its family
    ("gemm", r"gemm|cutlass|sm90_xmma|nvjet|matmul|Gemm"),
    ("attention", r"flash|fmha|attention|sdpa|varlen"),
    ("nccl", r"nccl"),
    ("memcpy/memset", r"Memcpy|Memset|memcpy|memset"),
    ("optimizer", r"adam|Adam|multi_tensor|foreach"),
    (
        "elementwise/reduce",
        r"elementwise|reduce|vectorized|unrolled|index|scatter|gather|sort|topk|oftmax|cat|copy",
    ),
)


def write_folder(out: str) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_model import CONFIGS

    from dstrain.model import build_model, save_pretrained

    cfg = CONFIGS["v2lite-4"]().replace(vocab_size=129280, num_nextn_predict_layers=1, aux_loss_alpha=0.0001)
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
    save_pretrained(model, out, dtype=torch.bfloat16)
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")


def run_figures(name: str, metrics: str) -> dict:
    rows = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "tokens_per_s" in r][WARMUP:]
    if not steps:
        return {"run": name, "steps": 0}
    return {
        "run": name,
        "steps": len(steps),
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in steps)),
        "mfu": round(statistics.median(r["mfu"] for r in steps if r.get("mfu") is not None), 4),
        "step_time_s": round(statistics.median(r["step_time_s"] for r in steps), 4),
    }


def trace_summary(path: str, top: int = 25) -> list[str]:
    events = json.loads(Path(path).read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not kernels:
        return ["no GPU kernels in the trace"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    busy, (start, end) = 0.0, spans[0]
    for s, e in spans[1:]:  # the union over streams
        if s > end:
            busy, start, end = busy + end - start, s, e
        else:
            end = max(end, e)
    busy += end - start
    window = max(e for _, e in spans) - spans[0][0]
    lines = [f"window {window / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms ({100 * busy / window:.0f}%)"]
    time, count = collections.Counter(), collections.Counter()
    for e in kernels:
        time[e["name"][:110]] += e["dur"]
        count[e["name"][:110]] += 1
    lines.append(f"top {top} kernels (ms, count):")
    lines += [f"  {d / 1e3:9.2f} {count[n]:6d}  {n}" for n, d in time.most_common(top)]
    family = collections.Counter()
    for e in kernels:
        family[next((f for f, rule in FAMILIES if re.search(rule, e["name"])), "other")] += e["dur"]
    lines.append(f"by family (ms): { {k: round(v / 1e3, 1) for k, v in family.most_common()} }")
    return lines


def main(argv: list[str]) -> None:
    what, *args = argv
    if what == "folder":
        write_folder(args[0])
    elif what == "run":
        print(json.dumps(run_figures(args[0], args[1])))
    elif what == "trace":
        print("\n".join(trace_summary(args[0], int(args[1]) if len(args) > 1 else 25)))
    else:
        raise SystemExit(f"dstrain: gpu_report.py: unknown part {what!r} (folder, run or trace)")


if __name__ == "__main__":
    main(sys.argv[1:])
