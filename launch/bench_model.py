"""Model step benchmark: dstrain vs transformers' DeepseekV3ForCausalLM (its default grouped_mm experts), on
the CPU or a CUDA GPU. A step is forward + backward + AdamW on one batch, the same loss computation for both
(token-mean cross-entropy; dstrain's balance loss is switched off and no model has MTP).

  python launch/bench_model.py                          # CPU: every figure, every CPU config, fp32 and bf16
  python launch/bench_model.py --device cuda            # GPU: bf16, V2-Lite-shaped (4 layers) and fine
  python launch/bench_model.py --configs fine --dtypes bf16 --figures speed,memory

Figures (JSON lines, one per config x dtype x figure):
  speed     dstrain / transformers tokens/s, eager
  moe       MoE step efficiency: step time of the dense model with the same active MLP width (same attention,
            same FLOPs per token) / step time of the MoE model, for dstrain and for transformers
  compile   dstrain with regional compilation (each block, like --compile) / transformers eager; warm-up time
  packed    dstrain on packed rows (4 documents per row, position ids restarting: the varlen kernel on GPUs)
            / the same tokens as one document per row, tokens/s
  memory    peak memory of one step (tensors created during it: activations, gradients, optimizer
            temporaries; CUDA: max_memory_allocated) dstrain / transformers
At most two models with their AdamW states live at a time (v2lite-4 in bf16: about 18 GB each, so the GPU
figures fit 80 GB with transformers' fp32 logits); CUDA runs with expandable segments, as `dstrain train` does.
Timing: steps interleaved A B B A in one process (the first slot of a round runs slower on a shared machine),
>= 4 rounds; quoted: the min and the median of the per-round ratios. MFU against the measured matmul peak
(CPU) or the device's dense bf16 peak (CUDA). Every line names the kernel path: native bf16 on this CPU or
not (kernels.CPU_NATIVE_BF16), threads, grouped_mm or its fallback, and malloc's mode (--malloc: glibc's
default maps and faults in every large tensor afresh, which costs transformers more than dstrain).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# As dstrain/train.py: set before CUDA initialises (a user's own setting wins).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dstrain.hostalloc import keep_freed_memory  # noqa: E402
from dstrain.model import ModelConfig, build_model, flops_per_token, save_pretrained  # noqa: E402
from dstrain.model.common.experts import grouped_mm_ok  # noqa: E402
from dstrain.model.common.kernels import CPU_NATIVE_BF16, cpu_bf16_path  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MALLOC = "glibc default"


def _cfg(**kw) -> ModelConfig:  # noqa: ANN003
    base = dict(
        num_nextn_predict_layers=0,  # transformers has no MTP: compare the same computation
        aux_loss_alpha=0.0,  # nor a balance loss
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
    )
    return ModelConfig(**{**base, **kw})


def fine(**kw) -> ModelConfig:  # noqa: ANN003
    """64 experts top-6, 1 shared: the fine-grained shape (V2/V3 routing widths), CPU-sized."""
    return _cfg(
        vocab_size=16384, hidden_size=512, moe_intermediate_size=128, intermediate_size=7 * 128,
        num_hidden_layers=4, num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=64, n_shared_experts=1, num_experts_per_tok=6,
        **kw,
    )  # fmt: skip


CONFIGS: dict[str, Callable[[], ModelConfig]] = {
    "fine": fine,
    # Not tuned for: 32 experts top-8 with 2 shared, wider experts, V2-Lite's MLA (no q compression).
    "fine-b": lambda: _cfg(
        vocab_size=32000,
        hidden_size=768,
        moe_intermediate_size=192,
        intermediate_size=10 * 192,
        num_hidden_layers=3,
        num_attention_heads=12,
        q_lora_rank=None,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        n_routed_experts=32,
        n_shared_experts=2,
        num_experts_per_tok=8,
    ),  # fmt: skip
    # DeepSeek-V2-Lite's shapes cut to 4 layers (GPU): 64 experts top-6, 2 shared, moe width 1408.
    "v2lite-4": lambda: _cfg(
        vocab_size=102400,
        hidden_size=2048,
        moe_intermediate_size=1408,
        intermediate_size=8 * 1408,
        num_hidden_layers=4,
        num_attention_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        routed_scaling_factor=1.0,
        max_position_embeddings=4096,
    ),  # fmt: skip
}
SHAPES = {"cpu": {"fine": (8, 512), "fine-b": (8, 512)}, "cuda": {"fine": (8, 2048), "v2lite-4": (4, 4096)}}


def dense_twin(cfg: ModelConfig) -> ModelConfig:
    """Every layer dense with the MoE layers' active width (k routed + shared experts): same attention, same
    FLOPs per token, no router."""
    width = (cfg.num_experts_per_tok + cfg.n_shared_experts) * cfg.moe_intermediate_size
    return dataclasses.replace(cfg, intermediate_size=width, first_k_dense_replace=cfg.num_hidden_layers)


# ---------------------------------------------------------------------- models and steps
def hf_model(ours, dtype: torch.dtype, device: str):  # noqa: ANN001, ANN201
    from transformers import DeepseekV3ForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(ours, tmp)
        return DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=dtype).to(device).train()


def make_step(
    model,  # noqa: ANN001
    ids: torch.Tensor,
    hf: bool,
    device: str,
    position_ids: torch.Tensor | None = None,
) -> Callable[[], float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step() -> float:
        sync(device)
        t = time.perf_counter()
        if hf:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        else:
            loss = model(ids, labels=ids, position_ids=position_ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        return time.perf_counter() - t

    return step


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def abba(a: Callable[[], float], b: Callable[[], float], rounds: int, warmup: int = 2) -> dict:
    """Per-round time ratios b/a (> 1: a is faster) from A B B A rounds."""
    for _ in range(warmup):
        a(), b()
    ta, tb, ratios = [], [], []
    for _ in range(rounds):
        a1, b1, b2, a2 = a(), b(), b(), a()
        ta += [a1, a2]
        tb += [b1, b2]
        ratios.append((b1 + b2) / (a1 + a2))
    return {
        "a_median_s": statistics.median(ta),
        "b_median_s": statistics.median(tb),
        "ratio_min": min(ratios),
        "ratio_median": statistics.median(ratios),
    }


def peak_step_bytes(step: Callable[[], float], device: str) -> int:
    """Peak bytes of tensors created during one step, above what lived before it (the optimizer's states
    exist already: a step runs first)."""
    step()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as p:
        step()
    live = peak = 0
    for _, action, _, size in p._memory_profile().timeline:
        if action == Action.CREATE:
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return peak


def matmul_peak(dtype: torch.dtype, device: str, n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of the best of `reps` square matmuls (CPU: what this process's threads reach)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    a @ a
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        a @ a
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def kernel_path(cfg: ModelConfig, dtype: torch.dtype, device: str) -> dict:
    compute = (
        torch.float32 if (device == "cpu" and dtype == torch.bfloat16 and not CPU_NATIVE_BF16) else dtype
    )
    grouped = grouped_mm_ok(compute, torch.device(device), cfg.hidden_size, cfg.moe_intermediate_size)
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "cpu_bf16_path": cpu_bf16_path(),
        "compute_dtype": str(compute).removeprefix("torch."),
        "experts": "grouped_mm" if grouped else "per-group loop (grouped_mm cannot take these sizes/dtype)",
        "malloc": MALLOC,
    }


# ---------------------------------------------------------------------- figures
def bench(name: str, dtype_name: str, figures: list[str], rounds: int, device: str) -> list[dict]:
    """At most two models (each with its AdamW states) are alive at a time: on an 80 GB GPU, v2lite-4 (2.3B
    parameters, 18 GB per model in bf16 with its states) plus transformers' fp32 logits fit; every model is
    rebuilt from seed 0 when a figure needs it again."""
    dtype = DTYPES[dtype_name]
    cfg = CONFIGS[name]()
    batch, seq = SHAPES[device][name]
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    head = {
        "config": name,
        "dtype": dtype_name,
        "batch": batch,
        "seq_len": seq,
        **kernel_path(cfg, dtype, device),
    }
    tokens = batch * seq
    peak = matmul_peak(dtype, device) if device == "cpu" else gpu_peak_flops()
    fpt = flops_per_token(cfg, seq)
    out = []

    def mfu(seconds: float) -> float:
        return round(fpt * tokens / seconds / peak, 4)

    def ours(c: ModelConfig = cfg):  # noqa: ANN202
        return build_model(c, seed=0, dtype=dtype, device=device).train()

    def theirs(c: ModelConfig = cfg):  # noqa: ANN202 - transformers' model with ours(c)'s weights
        return hf_model(ours(c), dtype, device)

    if "speed" in figures or "memory" in figures:
        step_ours, step_hf = make_step(ours(), ids, False, device), make_step(theirs(), ids, True, device)
        if "speed" in figures:
            r = abba(step_ours, step_hf, rounds)
            out.append({**head, "figure": "speed: dstrain / transformers tok/s, eager", "min": r["ratio_min"],
                        "median": r["ratio_median"], "dstrain_tok_s": tokens / r["a_median_s"],
                        "transformers_tok_s": tokens / r["b_median_s"], "dstrain_mfu": mfu(r["a_median_s"]),
                        "transformers_mfu": mfu(r["b_median_s"])})  # fmt: skip
        if "memory" in figures:
            mine, hfs = peak_step_bytes(step_ours, device), peak_step_bytes(step_hf, device)
            out.append({**head, "figure": "memory: peak of one step, dstrain / transformers",
                        "ratio": mine / hfs, "dstrain_MiB": mine / 2**20, "transformers_MiB": hfs / 2**20})  # fmt: skip
        del step_ours, step_hf
        free(device)
    if "moe" in figures:
        twin = dense_twin(cfg)
        r = abba(make_step(ours(), ids, False, device), make_step(ours(twin), ids, False, device), rounds)
        free(device)
        r_hf = abba(
            make_step(theirs(), ids, True, device), make_step(theirs(twin), ids, True, device), rounds
        )
        free(device)
        out.append({**head, "figure": "moe: dense-twin step time / MoE step time", "dstrain_min": r["ratio_min"],
                    "dstrain_median": r["ratio_median"], "transformers_min": r_hf["ratio_min"],
                    "transformers_median": r_hf["ratio_median"]})  # fmt: skip
    if "packed" in figures:
        # The same tokens as documents of seq/4 packed into each row (position ids restart per document: the
        # varlen kernel on GPUs, the block kernel's document ids on the CPU) against one document per row.
        model = ours()
        pos = torch.arange(seq, device=device).remainder(seq // 4).expand(batch, seq)
        r = abba(make_step(model, ids, False, device, pos), make_step(model, ids, False, device), rounds)
        out.append({**head, "figure": "packed: dstrain tok/s, 4 documents per row / 1 per row",
                    "min": r["ratio_min"], "median": r["ratio_median"], "packed_tok_s": tokens / r["a_median_s"],
                    "packed_mfu": mfu(r["a_median_s"])})  # fmt: skip
        del model
        free(device)
    if "compile" in figures:
        compiled = ours()
        compiled.compile_blocks()
        step_c = make_step(compiled, ids, False, device)
        t = time.perf_counter()
        step_c()
        warm = time.perf_counter() - t
        r = abba(step_c, make_step(theirs(), ids, True, device), rounds)
        out.append({**head, "figure": "compile: dstrain --compile / transformers eager tok/s", "min": r["ratio_min"],
                    "median": r["ratio_median"], "warmup_s": round(warm, 1), "dstrain_mfu": mfu(r["a_median_s"])})  # fmt: skip
        del compiled, step_c
        free(device)
    return out


def free(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def set_malloc(mode: str) -> None:
    global MALLOC
    if mode == "keep" and keep_freed_memory():
        MALLOC = "freed memory kept (dstrain.hostalloc)"


def gpu_peak_flops() -> float:
    from dstrain.training.metrics import device_peak_tflops

    peak, _ = device_peak_tflops(torch.device("cuda"), "bf16", None)
    return peak * 1e12


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--configs", default=None, help="comma-separated (default: fine,fine-b on CPU)")
    p.add_argument("--dtypes", default=None, help="default: fp32,bf16 on CPU, bf16 on CUDA")
    p.add_argument("--figures", default="speed,moe,packed,compile,memory")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument(
        "--malloc",
        choices=["keep", "system"],
        default="keep",
        help="keep: freed memory reused (dstrain.hostalloc, what `dstrain train` sets on the CPU, for both "
        "models here); system: glibc's default (a fresh mmap for every large tensor)",
    )
    args = p.parse_args()
    set_malloc(args.malloc)
    configs = (args.configs or ",".join(SHAPES[args.device])).split(",")
    dtypes = (args.dtypes or ("bf16" if args.device == "cuda" else "fp32,bf16")).split(",")
    for name in configs:
        for dt in dtypes:
            for row in bench(name, dt, args.figures.split(","), args.rounds, args.device):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
