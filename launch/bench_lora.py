"""Expert LoRA vs full fine-tuning on the same model: trainable parameters, adapter size, step time, memory.

  python launch/bench_lora.py                       # CPU: fine and fine-b (launch/bench_model.py), fp32 and bf16
  python launch/bench_lora.py --device cuda --configs v2lite-4 --dtypes bf16
  python launch/bench_lora.py --stored              # CPU: LoRA on a stored FP8 base vs on it dequantized

A step is forward + backward + AdamW on one batch (bench_model.make_step; AdamW keeps moments only for what
trains). LoRA adapts every routed expert (per expert its own A and B), the shared experts, the attention
projections q_b/kv_b/o and the routers (`--targets`), r 16, with every base weight frozen.
Figures (JSON lines):
  params    trainable parameters and their share of the model; the serving adapter folder's size on disk
            (PEFT per-expert layout, in the run's dtype)
  speed     full / LoRA step time (> 1: LoRA is faster), steps interleaved A B B A, min and median of rounds
  memory    per figure: persistent bytes (weights, AdamW moments) and the peak of tensors one step creates
            (activations, gradients, temporaries), and their sum, for full FT and for LoRA
--stored: the model written as a DeepSeek-V3-style FP8 folder (every projection e4m3 + fp32 128x128 scales),
LoRA (the same targets) on it loaded twice: its base stored (--base_precision stored: codes + scales,
dequantized per layer in forward and again in backward) and dequantized once into the run's dtype
(--base_precision bf16); the two compute the same values. Figures:
  stored    dequantized-base step time / stored-base step time (< 1: the stored base is slower), A B B A,
            min and median of rounds; each base's bytes (stored: codes + scales + the parameters left)
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


def _stored_pair(cfg, dtype: torch.dtype, r: int, targets: list[str], tmp: str) -> tuple:  # noqa: ANN001
    """(LoRA on the FP8 folder of `cfg` dequantized, LoRA on its stored base), built as a run builds them."""
    from dstrain.config.options import parse_options
    from dstrain.model import from_pretrained, get_config
    from dstrain.model.build import materialize
    from dstrain.model.common.lora import init_adapters
    from dstrain.model.quantized import fill_stored, store_base
    from dstrain.model.registry import on_meta
    from dstrain.model.sources import Weights, fill
    from dstrain.training.finetune import apply_finetune_options
    from tests.helpers.quantized import fp8_folder

    path = Path(tmp) / "fp8"
    fp8_folder(path, cfg)
    cfg = get_config(str(path))
    lora = parse_options(
        ["--lora_r", str(r), "--lora_alpha", str(2.0 * r), "--lora_targets", ",".join(targets)]
    ).lora
    dense = from_pretrained(str(path), dtype=dtype)
    apply_finetune_options(dense, lora, 0)
    stored = on_meta(cfg)
    apply_finetune_options(stored, lora, 0)
    with Weights(cfg, 0, folder=str(path)) as weights:
        store_base(stored, weights.reader)
        materialize(stored, "cpu", dtype)
        fill(stored, weights)
        fill_stored(stored, weights.reader)
    for model in (dense, stored):
        init_adapters(model, 0)
    return dense.train(), stored.train()


def _base_bytes(model: torch.nn.Module) -> int:
    """The frozen base's bytes: parameters that do not train, and stored weights' codes + scales."""
    from dstrain.model.common.stored import stored_weights

    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    return frozen + sum(w.nbytes for _, w in stored_weights(model))


def bench_stored(name: str, dtype_name: str, r: int, targets: list[str], rounds: int) -> list[dict]:
    dtype, cfg = DTYPES[dtype_name], CONFIGS[name]()
    batch, seq = SHAPES["cpu"][name]
    with tempfile.TemporaryDirectory() as tmp:
        present = {n.rpartition(".")[2] for n, _ in build_model(cfg, device="meta").named_modules()}
        dense, stored = _stored_pair(cfg, dtype, r, [t for t in targets if t in present], tmp)
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    head = {"config": name, "dtype": dtype_name, "batch": batch, "seq_len": seq, "r": r,
            **kernel_path(cfg, dtype, "cpu")}  # fmt: skip
    step_dense, step_stored = make_step(dense, ids, False, "cpu"), make_step(stored, ids, False, "cpu")
    t = abba(step_stored, step_dense, rounds)  # per-round ratios: dequantized-base time / stored-base time
    return [{**head, "figure": "stored: dequantized-base step time / stored-base step time", "min": t["ratio_min"],
             "median": t["ratio_median"], "stored_step_s": t["a_median_s"], "dequantized_step_s": t["b_median_s"],
             "stored_base_MiB": _base_bytes(stored) / 2**20, "dequantized_base_MiB": _base_bytes(dense) / 2**20}]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--configs", default=None, help="comma-separated (default: fine,fine-b on CPU)")
    p.add_argument("--dtypes", default=None, help="default: fp32,bf16 on CPU, bf16 on CUDA")
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--targets", default=TARGETS)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument(
        "--stored", action="store_true", help="LoRA on a stored FP8 base vs on it dequantized (CPU)"
    )
    args = p.parse_args()
    if args.stored and args.device != "cpu":
        p.error("--stored: a CPU benchmark (--device cpu)")
    set_malloc("keep")  # as `dstrain train` runs on the CPU
    configs = (args.configs or ",".join(SHAPES[args.device])).split(",")
    dtypes = (args.dtypes or ("bf16" if args.device == "cuda" else "fp32,bf16")).split(",")
    for name in configs:
        for dt in dtypes:
            if args.stored:
                rows = bench_stored(name, dt, args.r, args.targets.split(","), args.rounds)
            else:
                rows = bench(name, dt, args.r, args.targets.split(","), args.rounds, args.device)
            for row in rows:
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
