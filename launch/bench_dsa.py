"""DeepSeek Sparse Attention: tokens/s and step memory of a V3-shaped model with dense MLA, the same model with
sparse attention in the dense warm-up stage, and in the sparse stage, at several row lengths, on this CPU or a
GPU (`--device cuda`: bf16, the Triton kernels where Triton is installed, dsa_kernels.py; each row names the
sparse-attention kernels it ran).

  python launch/bench_dsa.py                                  # CPU, fp32: T 2048, 8192, 16384; top-k 1024
  python launch/bench_dsa.py --lengths 8192 --rounds 2 --indexer random
  python launch/bench_dsa.py --device cuda                    # bf16: T 4K to 64K; top-k 2048; local indexer
  python launch/bench_dsa.py --device cuda --check            # the Triton kernels against the torch path
  python launch/bench_dsa.py --device cuda --lengths 16384 --profile /tmp/dsa   # + a trace of each config's step

A step is forward + backward of one row (no optimizer), the LM loss and, with sparse attention, the indexer's
KL (its gradient injected, as in training). Two figures per length and configuration (JSON lines):
  attention  one attention layer's forward + backward (MLA, with the indexer, its KL and the selection)
  model      the whole model's step: tokens/s, and the peak bytes of tensors created during it (on a GPU:
             torch.cuda's peak allocated during the step less what was allocated before it)
Timing: the three configurations interleaved A B C C B A in one process, >= 2 rounds; quoted: the median time
and the min / median of the per-round ratios to dense MLA.

`--check`: before any timing, a V3.2 model's step (packed rows, each stage) with the sparse-attention kernels
this device runs against the torch path they replace (Triton off: torch's indexer blocks, SDPA over a mask on
a GPU), in fp32 and bf16: the loss, the indexer's KL and every gradient, as relative differences with their
bounds (fp32: 1e-5 loss and KL, 1e-4 gradients; bf16: 2e-2 and 5e-2, each path's own rounding); exits 1 past
one. On the CPU it needs DSTRAIN_KERNEL_POLICY=cuda TRITON_INTERPRET=1 and checks fp32 only (the interpreter's
tl.dot of bf16 tiles is wrong: Triton 3.9).

The indexer's weights decide which keys a block of 64 query rows chooses together, and with it the CPU
kernel's cost (attention.py: a block runs against the union of its rows' keys): `--indexer random` is the
model's own initialisation (every query its own keys: the union is nearly every key); `--indexer local` sets a
locality prior (rotary dims of the indexer's q and k equal, so that scores fall with distance): neighbouring
queries choose mostly the same recent keys, the pattern of a coherent selection. Both are printed by default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dstrain.hostalloc import keep_freed_memory  # noqa: E402
from dstrain.memory.measure import AllocationTracker  # noqa: E402
from dstrain.model import DeepSeekLM, ModelConfig  # noqa: E402
from dstrain.model.common.attention import attention_layout  # noqa: E402
from dstrain.model.common.dsa import kernel_path  # noqa: E402
from dstrain.model.common.kernels import cpu_bf16_path  # noqa: E402
from dstrain.model.sources import init_weights  # noqa: E402

STAGES = ("dense MLA", "DSA dense stage", "DSA sparse stage")


def config(topk: int, sparse: bool) -> ModelConfig:
    """A V3-shaped model small enough for 16K-token rows on a CPU: 2 blocks (dense, MoE), 8 heads."""
    return ModelConfig(
        model_type="deepseek_v32" if sparse else "deepseek_v3",
        vocab_size=32768,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        num_nextn_predict_layers=0,
        max_position_embeddings=32768,
        index_topk=topk if sparse else None,
        index_n_heads=8 if sparse else 64,
        index_head_dim=64 if sparse else 128,
    )


@torch.no_grad()
def locality_prior(model: DeepSeekLM) -> None:
    """Indexer q and k equal to one constant vector in their rotary dims (and 0 elsewhere): after RoPE their
    product is a sum of cos((t - u) * frequency), largest for the nearest keys; every head weight positive."""
    for block in model.blocks():
        ix = block.self_attn.indexer
        if ix is None:
            continue
        r = model.config.qk_rope_head_dim
        ix.wq_b.weight.zero_().view(ix.n_heads, ix.head_dim, -1)[:, :r].fill_(0.05)
        ix.wk.weight.zero_()[:r].fill_(0.05)
        ix.k_norm.weight.fill_(1.0)
        ix.k_norm.bias.zero_()[:r].fill_(1.0)
        ix.weights_proj.weight.zero_()


def models(topk: int, indexer: str, device: torch.device, dtype: torch.dtype) -> dict[str, DeepSeekLM]:
    dense = DeepSeekLM(config(topk, sparse=False))
    init_weights(dense, 0)
    out = {"dense MLA": dense.train()}
    for stage in ("dense", "sparse"):
        m = DeepSeekLM(config(topk, sparse=True))
        init_weights(m, 0)
        if indexer == "local":
            locality_prior(m)
        m.load_state_dict(dense.state_dict(), strict=False)  # the same model, plus the indexers
        m.train().set_sparse_attention(stage)
        out[f"DSA {stage} stage"] = m
    return {n: m.to(device, dtype) for n, m in out.items()}


def timed(fn: Callable[[], None], device: torch.device) -> Callable[[], float]:
    def run() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t

    return run


def model_step(model: DeepSeekLM, ids: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    return step


def attention_step(model: DeepSeekLM, t: int) -> Callable[[], None]:
    block = model.layers[1]
    weight = block.self_attn.o_proj.weight
    x = torch.randn(1, t, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    x = x.to(
        weight.device, weight.dtype
    ).requires_grad_()  # a gradient into the block's input, as in training
    pos = torch.arange(t, device=weight.device).unsqueeze(0)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        layout = attention_layout(pos, 1, t, x.device)
        out = block.self_attn(x, model._rope(pos), layout)
        out.sum().backward()

    return step


def interleaved(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, dict]:
    """A B C C B A rounds after one warm-up each: median seconds, and per-round ratios to the first."""
    names = list(runs)
    for n in names:
        runs[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        got = {n: 0.0 for n in names}
        for n in [*names, *reversed(names)]:
            got[n] += runs[n]()
        for n in names:
            times[n].append(got[n] / 2)
            ratios[n].append(got[n] / got[names[0]])
    return {
        n: {
            "median_s": statistics.median(times[n]),
            "to_dense_min": min(ratios[n]),
            "to_dense_median": statistics.median(ratios[n]),
        }  # fmt: skip
        for n in names
    }


def peak_bytes(step: Callable[[], None], device: torch.device) -> int:
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with AllocationTracker() as tracker:
        step()
    return tracker.peak_bytes


def check_kernels(device: torch.device, dtypes: list[torch.dtype], t: int, topk: int) -> bool:
    """The kernels' step against the torch path's (see the top): prints a JSON line per dtype and stage."""
    from dstrain.model.common import kernels

    runs_triton = kernels._triton_runs
    ok = True
    ids = torch.randint(0, 32768, (2, t), generator=torch.Generator().manual_seed(3)).to(device)
    pos = torch.cat([torch.arange(t // 3), torch.arange(t - t // 3)]).expand(2, -1).to(device)  # 2 documents
    for dtype in dtypes:
        bound = (1e-5, 1e-4) if dtype == torch.float32 else (2e-2, 5e-2)
        built = models(topk, "random", device, dtype)
        for stage in ("dense", "sparse"):
            model = built[f"DSA {stage} stage"]
            got = []
            for triton_on in (True, False):
                kernels._triton_runs = runs_triton if triton_on else (lambda _: False)
                try:
                    model.zero_grad(set_to_none=True)
                    out = model(ids, position_ids=pos, labels=ids)
                    out.loss.backward()
                    path = kernel_path(device, dtype)
                finally:
                    kernels._triton_runs = runs_triton
                grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
                got.append((out.loss.detach().float(), out.indexer_stats.double(), grads, path))
            (loss, stats, grads, path), (ref_loss, ref_stats, ref_grads, ref_path) = got

            def rel(a: torch.Tensor, b: torch.Tensor) -> float:
                return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))

            figures = {"loss": rel(loss, ref_loss), "indexer_stats": rel(stats, ref_stats),
                       "worst_grad": max(rel(g, ref_grads[n]) for n, g in grads.items())}  # fmt: skip
            passed = (figures["loss"] <= bound[0] and figures["indexer_stats"] <= bound[0]
                      and figures["worst_grad"] <= bound[1] and grads.keys() == ref_grads.keys())  # fmt: skip
            ok &= passed
            print(json.dumps({"check": stage, "dtype": str(dtype).removeprefix("torch."), "seq_len": t, "topk": topk,
                              **figures, "bounds": bound, "passed": passed, "kernels": path,
                              "against": ref_path}), flush=True)  # fmt: skip
    return ok


def profile(step: Callable[[], None], out: Path) -> None:
    """A chrome trace of one step after a warm-up (launch/gpu_report.py trace reads it)."""
    step()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        step()
        torch.cuda.synchronize()
    out.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), help="default: fp32 on the CPU, bf16 on a GPU")
    p.add_argument("--lengths", help="default: 2048,8192,16384 on the CPU, 4096 to 65536 on a GPU")
    p.add_argument("--topk", type=int, help="default: 1024 on the CPU, 2048 (V3.2's) on a GPU")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--indexer", choices=("random", "local", "both"), help="default: both; local on a GPU")
    p.add_argument(
        "--check", action="store_true", help="only the kernels against the torch path (see the top)"
    )
    p.add_argument(
        "--profile", type=Path, help="a GPU: also a trace of each config's model step per length here"
    )
    args = p.parse_args()
    gpu = args.device == "cuda"
    device = torch.device(args.device)
    dtype = torch.bfloat16 if (args.dtype or ("bf16" if gpu else "fp32")) == "bf16" else torch.float32
    lengths = args.lengths or ("4096,8192,16384,32768,65536" if gpu else "2048,8192,16384")
    topk = args.topk or (2048 if gpu else 1024)
    indexer_kinds = args.indexer or ("local" if gpu else "both")
    if args.check:
        small = (512, 128) if gpu else (48, 8)  # the interpreter runs a kernel program at a time
        sys.exit(
            0 if check_kernels(device, [torch.float32, *([torch.bfloat16] if gpu else [])], *small) else 1
        )
    keep_freed_memory()
    torch.set_num_threads(torch.get_num_threads())
    path = {"device": torch.cuda.get_device_name(device) if gpu else "cpu", "threads": torch.get_num_threads(),
            "cpu_bf16_path": cpu_bf16_path(), "dtype": str(dtype).removeprefix("torch."),
            "sparse_kernels": kernel_path(device, dtype)}  # fmt: skip
    for indexer in ("random", "local") if indexer_kinds == "both" else (indexer_kinds,):
        for t in (int(x) for x in lengths.split(",")):
            ms = models(topk, indexer, device, dtype)
            ids = torch.randint(0, 32768, (1, t), generator=torch.Generator().manual_seed(2)).to(device)
            attn = interleaved({n: timed(attention_step(m, t), device) for n, m in ms.items()}, args.rounds)
            step = interleaved({n: timed(model_step(m, ids), device) for n, m in ms.items()}, args.rounds)
            for name, m in ms.items():
                row = {"indexer": indexer, "seq_len": t, "topk": topk, "config": name,
                       "attention_layer": attn[name], "model_step": step[name],
                       "tokens_per_s": t / step[name]["median_s"],
                       "step_peak_mib": peak_bytes(model_step(m, ids), device) / 2**20, **path}  # fmt: skip
                print(json.dumps(row), flush=True)
                if gpu and args.profile:
                    profile(model_step(m, ids), args.profile / f"{t}_{name.replace(' ', '_')}.json")
            del ms
            if gpu:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
