"""Throughput of dstrain's model vs transformers' DeepseekV3ForCausalLM: forward + backward + AdamW step.

Same config (~70M parameters: hidden 512, 6 layers, 16 routed experts top-4, 1 shared, vocab 32000),
same weights, same batch (4 x 512). Steps are interleaved A B B A in one process (the first slot of a round
runs slower on a shared machine) and the median per-step time is compared. MFU is against a matmul peak
measured in this process. Usage: python launch/bench_model.py [--rounds 3] [--dtypes fp32,bf16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from transformers import DeepseekV3ForCausalLM

from dstrain.model import ModelConfig, build_model, flops_per_token, param_counts, save_pretrained

CONFIG = ModelConfig(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    moe_intermediate_size=256,
    num_hidden_layers=6,
    num_attention_heads=8,
    q_lora_rank=256,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=4,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    num_nextn_predict_layers=0,  # transformers has no MTP: compare the same computation
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def matmul_peak(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    """Best of `reps` square matmuls: the least-disturbed sample on a shared machine."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def make_step(model, ids, hf: bool):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> tuple[float, float]:
        """(wall seconds, process CPU seconds): CPU time is less disturbed by other processes."""
        t, c = time.perf_counter(), time.process_time()
        if hf:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        else:
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t, time.process_time() - c

    return step


def bench(dtype_name: str, rounds: int, batch: int, seq: int) -> dict:
    dtype = DTYPES[dtype_name]
    torch.manual_seed(0)
    ours = build_model(CONFIG, seed=0, dtype=dtype).train()
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(ours, tmp)
        hf = DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=dtype).train()
    ids = torch.randint(0, CONFIG.vocab_size, (batch, seq))
    steps = {"dstrain": make_step(ours, ids, hf=False), "transformers": make_step(hf, ids, hf=True)}
    for s in steps.values():  # warm-up
        s()
    peaks = {"fp32": [], dtype_name: []}
    wall: dict[str, list[float]] = {k: [] for k in steps}
    cpu: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name in ("dstrain", "transformers", "transformers", "dstrain"):
            w, c = steps[name]()
            wall[name].append(w)
            cpu[name].append(c)
        for key in peaks:
            peaks[key].append(matmul_peak(DTYPES[key]))
    tokens = batch * seq
    fpt = flops_per_token(CONFIG, seq)
    out: dict = {
        "dtype": dtype_name,
        "params": param_counts(CONFIG, include_mtp=False)["total"],
        "rounds": rounds,
    }
    out.update({f"peak_gflops_{k}": max(v) / 1e9 for k, v in peaks.items()})
    for k in steps:
        t = statistics.median(wall[k])
        out[f"{k}_tokens_per_s"] = tokens / t
        for pk, pv in peaks.items():
            out[f"{k}_mfu_vs_{pk}_peak"] = fpt * tokens / t / max(pv)
    out["speedup_wall_median"] = statistics.median(wall["transformers"]) / statistics.median(wall["dstrain"])
    out["speedup_cpu_time_median"] = statistics.median(cpu["transformers"]) / statistics.median(
        cpu["dstrain"]
    )
    out["speedup_wall_min_round"] = min(
        (wall["transformers"][2 * r] + wall["transformers"][2 * r + 1])
        / (wall["dstrain"][2 * r] + wall["dstrain"][2 * r + 1])
        for r in range(rounds)
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--dtypes", default="fp32,bf16")
    args = p.parse_args()
    for name in args.dtypes.split(","):
        print(json.dumps(bench(name, args.rounds, args.batch, args.seq_len)), flush=True)


if __name__ == "__main__":
    main()
