"""Kimi Linear training step on this CPU: dstrain's KimiLinearLM against transformers' KimiLinearForCausalLM
(its torch path: this script refuses to run with `fla` importable, which would swap in Triton kernels) on the
same weights and batch.

  OMP_NUM_THREADS=1 python launch/bench_kda.py                 # fp32, 2 x 1024 tokens, 3 A B B A rounds
  python launch/bench_kda.py --seq_len 2048 --batch 1 --rounds 5

One Kimi-Linear-shaped model (3 KDA layers : 1 NoPE MLA layer, 8 KDA heads of 64 with the short convolutions,
MoE of 16 experts top-4 with a shared expert after a dense first layer) written by transformers with random
weights (`save_pretrained`), loaded by dstrain (`from_pretrained`), both fp32; dstrain's balance loss off
(transformers has none). A step: forward with labels, backward, no optimizer. Prints torch's version, the
threads, the KDA path each side takes (dstrain: its chunked delta rule, `kda.CHUNK` tokens per chunk, fp32
state; transformers: its torch chunked form, 64-token chunks), the loss of each model on the batch (the same
computation: their relative difference; and the logits' largest difference), the median step time and tokens/s of each, and the median and min
over rounds of transformers time / dstrain time (> 1: dstrain faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dstrain.model import from_pretrained  # noqa: E402
from dstrain.model.common.kda import CHUNK  # noqa: E402

SHAPE = dict(
    vocab_size=32000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128, q_lora_rank=None, qk_rope_head_dim=32,
    v_head_dim=64, qk_nope_head_dim=64, num_experts=16, num_experts_per_token=4, num_shared_experts=1,
    first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, linear_attn_config={"num_heads": 8, "head_dim": 64, "short_conv_kernel_size": 4,
                                                 "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
)  # fmt: skip


def models(folder: str) -> tuple[nn.Module, nn.Module]:
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(0)
    ref = KimiLinearForCausalLM(KimiLinearConfig(**SHAPE))
    with torch.no_grad():  # random weights of a trained model's spread (the init leaves many at 0 or 1)
        for name, p in ref.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias")) or "conv1d" in name:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.endswith("norm.weight") else 0.0))
    ref.save_pretrained(folder)
    ours = from_pretrained(folder, dtype=torch.float32)
    ours.config.aux_loss_alpha = 0.0
    return ref.train(), ours.train()


def step(model: nn.Module, ids: torch.Tensor, hf: bool) -> float:
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids, use_cache=False) if hf else model(ids, labels=ids)
    out.loss.backward()
    return float(out.loss.detach())


def timed(model: nn.Module, ids: torch.Tensor, hf: bool) -> float:
    t = time.perf_counter()
    step(model, ids, hf)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args()
    if importlib.util.find_spec("fla") is not None:
        sys.exit("fla is importable: transformers would run its Triton kernels, not its torch path")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32")
    print(
        f"KDA: dstrain chunked delta rule, {CHUNK}-token chunks, fp32 state; transformers: its torch chunked form"
    )
    with tempfile.TemporaryDirectory() as folder:
        ref, ours = models(folder)
    ids = torch.randint(
        3, SHAPE["vocab_size"], (args.batch, args.seq_len), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():  # the same function: logits within fp32 rounding (the loss of near-uniform logits
        # at random init agrees to more digits than it shows)
        want, got = ref(ids[:, :256], use_cache=False).logits, ours(ids[:, :256]).logits
    print(f"logits: max |difference| {(got - want).abs().max():.2e} of max |logit| {want.abs().max():.2e}")
    theirs, mine = step(ref, ids, True), step(ours, ids, False)
    print(
        f"loss: transformers {theirs:.9f}, dstrain {mine:.9f} (relative difference {abs(mine - theirs) / theirs:.1e})"
    )
    for _ in range(args.warmup):
        timed(ref, ids, True), timed(ours, ids, False)
    t_ref, t_ours, ratios = [], [], []
    for _ in range(args.rounds):
        a1, b1, b2, a2 = (
            timed(ours, ids, False),
            timed(ref, ids, True),
            timed(ref, ids, True),
            timed(ours, ids, False),
        )
        t_ours += [a1, a2]
        t_ref += [b1, b2]
        ratios.append((b1 + b2) / (a1 + a2))
    tokens = args.batch * args.seq_len
    for name, ts in (("transformers", t_ref), ("dstrain", t_ours)):
        med = statistics.median(ts)
        print(f"{name:>12}: step {med:.3f} s median, {tokens / med:,.0f} tokens/s")
    print(f"transformers / dstrain step time: median {statistics.median(ratios):.2f}, min {min(ratios):.2f} "
          f"({args.rounds} A B B A rounds, {args.batch} x {args.seq_len} tokens)")  # fmt: skip


if __name__ == "__main__":
    main()
