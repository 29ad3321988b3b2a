"""DeepSeek-V4 training step on this CPU: dstrain's model against transformers' DeepseekV4ForCausalLM.

  python launch/bench_v4.py                      # fp32, 2 x 1024 tokens, 3 ABBA rounds
  python launch/bench_v4.py --dtype both --rounds 5

One V4-shaped model (every attention kind at the published compress rates 4 and 128, a hash layer, 4 mHC
streams, the published clamp and scoring) built by transformers, its weights copied into dstrain's model (no
MTP: transformers builds none). Each figure compares the two on the same batch, interleaved A B B A per round;
quoted: the median and the min of the per-round ratios. Memory: the bytes autograd keeps for backward in one
training forward (each storage once, `torch.autograd.graph.saved_tensors_hooks`), for transformers, dstrain, and
dstrain with the mHC weights recomputed in backward (`--activation_checkpointing mhc`) or every block
(`full`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from dstrain.model.kernels import CPU_NATIVE_BF16
from dstrain.model.v4 import DeepSeekV4LM
from dstrain.model.v4_config import V4Config

SHAPE = dict(
    vocab_size=4096,
    hidden_size=256,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    head_dim=64,
    q_lora_rank=64,
    qk_rope_head_dim=16,
    n_routed_experts=16,
    num_experts_per_tok=4,
    o_groups=2,
    o_lora_rank=64,
    index_n_heads=8,
    index_head_dim=32,
    index_topk=64,
    sliding_window=128,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    num_hash_layers=1,
    hc_mult=4,
    max_position_embeddings=8192,
)


@torch.no_grad()
def reference(seed: int = 0) -> DeepseekV4ForCausalLM:
    """transformers' model with its own init, the buffers it leaves constant drawn: each token's hash-layer
    experts distinct, the expert biases and the sinks small."""
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**SHAPE))
    cfg = model.config
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            b.copy_(torch.rand(b.shape[0], cfg.n_routed_experts).argsort(-1)[:, : b.shape[1]])
        elif name.endswith("e_score_correction_bias"):
            b.normal_(0, 0.01)
    return model.train()


def twin(ref: DeepseekV4ForCausalLM) -> DeepSeekV4LM:
    cfg = V4Config.from_hf_dict(ref.config.to_dict()).replace(num_nextn_predict_layers=0, aux_loss_alpha=0.0)
    model = DeepSeekV4LM(cfg)
    model.load_state_dict({k.removeprefix("model."): v for k, v in ref.state_dict().items()})
    model.set_sparse_attention("frozen")  # transformers trains no indexer: the same work on both sides
    return model.train()


def step(model, ids: torch.Tensor, hf: bool) -> float:  # noqa: ANN001
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids, use_cache=False).loss if hf else model(ids, labels=ids).loss
    loss.backward()
    return loss.item()


def saved_bytes(model, ids: torch.Tensor, hf: bool) -> int:  # noqa: ANN001
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids, labels=ids, use_cache=False) if hf else model(ids, labels=ids)
    del out
    return sum(seen.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="fp32")
    args = p.parse_args()
    kernel = "native bf16 (AVX512-BF16/AMX)" if CPU_NATIVE_BF16 else "bf16 computed in fp32 (no bf16 unit)"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU bf16 path: {kernel}")
    print(f"model: {SHAPE['num_hidden_layers']} layers {SHAPE['layer_types']}, hidden {SHAPE['hidden_size']}, "
          f"hc_mult {SHAPE['hc_mult']}, {SHAPE['n_routed_experts']} experts top-{SHAPE['num_experts_per_tok']}; "
          f"batch {args.batch} x {args.seq_len} tokens")  # fmt: skip
    ids = torch.randint(
        0, SHAPE["vocab_size"], (args.batch, args.seq_len), generator=torch.Generator().manual_seed(1)
    )
    tokens = ids.numel()
    dtypes = {"fp32": [torch.float32], "bf16": [torch.bfloat16], "both": [torch.float32, torch.bfloat16]}
    for dtype in dtypes[args.dtype]:
        ref = reference().to(dtype)
        ours = twin(reference()).to(dtype)
        a, b = step(ref, ids, True), step(ours, ids, False)
        print(
            f"\n[{dtype}] loss transformers {a:.6f}, dstrain {b:.6f} (relative difference {abs(a - b) / a:.1e})"
        )
        times: dict[str, list[float]] = {"transformers": [], "dstrain": []}
        for _ in range(args.rounds):
            for name in ("transformers", "dstrain", "dstrain", "transformers"):
                t0 = time.perf_counter()
                step(ref if name == "transformers" else ours, ids, name == "transformers")
                times[name].append(time.perf_counter() - t0)
        ratios = [t / d for t, d in zip(times["transformers"], times["dstrain"], strict=True)]
        for name, ts in times.items():
            print(
                f"  {name:13s} step {statistics.median(ts):.3f} s  {tokens / statistics.median(ts):8.0f} tokens/s"
            )
        print(f"  dstrain speed-up: median {statistics.median(ratios):.2f}x, min {min(ratios):.2f}x")
        print("  saved for backward (one training forward):")
        print(f"    transformers                    {saved_bytes(ref, ids, True) / 2**20:8.1f} MiB")
        for mode in ("none", "mhc", "full"):
            ours.set_activation_checkpointing(mode)
            print(f"    dstrain, checkpointing {mode:5s}    {saved_bytes(ours, ids, False) / 2**20:8.1f} MiB")
        ours.set_activation_checkpointing("none")


if __name__ == "__main__":
    main()
