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

    def step() -> float:
        t = time.perf_counter()
        if hf:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        else:
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t

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
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name in ("dstrain", "transformers", "transformers", "dstrain"):
            times[name].append(steps[name]())
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = batch * seq
    peak = matmul_peak(dtype)
    fpt = flops_per_token(CONFIG, seq)
    out = {"dtype": dtype_name, "params": param_counts(CONFIG, include_mtp=False)["total"], "peak_gflops": peak / 1e9}
    for k, t in med.items():
        out[f"{k}_tokens_per_s"] = tokens / t
        out[f"{k}_mfu"] = fpt * tokens / t / peak
    out["speedup_vs_transformers"] = med["transformers"] / med["dstrain"]
    out["min_round_speedup"] = min(
        (times["transformers"][2 * r] + times["transformers"][2 * r + 1]) / (times["dstrain"][2 * r] + times["dstrain"][2 * r + 1])
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
