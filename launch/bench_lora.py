"""Expert LoRA vs full fine-tuning on the same model: trainable parameters, adapter size, step time, memory.

  python launch/bench_lora.py                       # CPU: fine and fine-b (launch/bench_model.py), fp32 and bf16
  python launch/bench_lora.py --device cuda --configs v2lite-4 --dtypes bf16

A step is forward + backward + AdamW on one batch (bench_model.make_step; AdamW keeps moments only for what
trains). LoRA adapts every routed expert (per expert its own A and B), the shared experts, the attention
projections q_b/kv_b/o and the routers (`--targets`), r 16, with every base weight frozen.
Figures (JSON lines):
  params    trainable parameters and their share of the model; the serving adapter folder's size on disk
            (PEFT per-expert layout, in the run's dtype)
  speed     full / LoRA step time (> 1: LoRA is faster), steps interleaved A B B A, min and median of rounds
  memory    per figure: persistent bytes (weights, AdamW moments) and the peak of tensors one step creates
            (activations, gradients, temporaries), and their sum, for full FT and for LoRA
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dstrain.model import build_model  # noqa: E402
from dstrain.model.common.lora import apply_lora  # noqa: E402
from launch.bench_model import (  # noqa: E402
    CONFIGS,
    DTYPES,
    SHAPES,
    abba,
    kernel_path,
    make_step,
    peak_step_bytes,
    set_malloc,
)

TARGETS = "q_b_proj,q_proj,kv_b_proj,o_proj,shared_experts,experts,gate"


def _persistent(model: torch.nn.Module) -> int:
    """Weights plus AdamW's two moments for what trains (in the weights' dtype, as torch's AdamW keeps them)."""
    total = 0
    for p in model.parameters():
        total += p.numel() * p.element_size() * (3 if p.requires_grad else 1)
    return total


def _adapter_bytes(model: torch.nn.Module) -> int | None:
    """Bytes of the serving adapter folder's weights file (None when the writer refuses this model)."""
    from dstrain.checkpoint.lora import ADAPTER_WEIGHTS, save_peft_adapter

    with tempfile.TemporaryDirectory() as tmp:
        try:
            save_peft_adapter(model, tmp, "base")
        except ValueError as exc:
            print(f"# adapter folder not written: {exc}", file=sys.stderr)
            return None
        return (Path(tmp) / ADAPTER_WEIGHTS).stat().st_size


def bench(name: str, dtype_name: str, r: int, targets: list[str], rounds: int, device: str) -> list[dict]:
    dtype = DTYPES[dtype_name]
    cfg = CONFIGS[name]()
    batch, seq = SHAPES[device][name]
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    full = build_model(cfg, seed=0, dtype=dtype, device=device).train()
    lora = build_model(cfg, seed=0, dtype=dtype, device=device).train()
    present = {n.rpartition(".")[2] for n, _ in lora.named_modules()}
    apply_lora(lora, r, 2.0 * r, [t for t in targets if t in present])
    head = {"config": name, "dtype": dtype_name, "batch": batch, "seq_len": seq, "r": r,
            **kernel_path(cfg, dtype, device)}  # fmt: skip
    total = sum(p.numel() for p in lora.parameters())
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    experts = sum(p.numel() for n, p in lora.named_parameters() if p.requires_grad and ".experts." in n)
    out = [{**head, "figure": "params", "model_params": total - trainable, "lora_trainable": trainable,
            "lora_trainable_share": round(trainable / (total - trainable), 5), "of_which_routed_experts": experts,
            "adapter_file_MiB": (b / 2**20) if (b := _adapter_bytes(lora)) else None}]  # fmt: skip
    step_full, step_lora = make_step(full, ids, False, device), make_step(lora, ids, False, device)
    t = abba(step_lora, step_full, rounds)  # per-round ratios: full step time / LoRA step time
    out.append({**head, "figure": "speed: full FT step time / LoRA step time", "min": t["ratio_min"],
                "median": t["ratio_median"], "full_step_s": t["b_median_s"],
                "lora_step_s": t["a_median_s"]})  # fmt: skip
    mem = {}
    for label, model, step in (("full", full, step_full), ("lora", lora, step_lora)):
        keep, peak = _persistent(model), peak_step_bytes(step, device)
        mem[label] = {
            "persistent_MiB": keep / 2**20,
            "step_peak_MiB": peak / 2**20,
            "total_MiB": (keep + peak) / 2**20,
        }
    out.append({**head, "figure": "memory: LoRA / full FT", "total_ratio": mem["lora"]["total_MiB"] / mem["full"]["total_MiB"],
                "step_peak_ratio": mem["lora"]["step_peak_MiB"] / mem["full"]["step_peak_MiB"], **mem})  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--configs", default=None, help="comma-separated (default: fine,fine-b on CPU)")
    p.add_argument("--dtypes", default=None, help="default: fp32,bf16 on CPU, bf16 on CUDA")
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--targets", default=TARGETS)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    set_malloc("keep")  # as `dstrain train` runs on the CPU
    configs = (args.configs or ",".join(SHAPES[args.device])).split(",")
    dtypes = (args.dtypes or ("bf16" if args.device == "cuda" else "fp32,bf16")).split(",")
    for name in configs:
        for dt in dtypes:
            for row in bench(name, dt, args.r, args.targets.split(","), args.rounds, args.device):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
