"""DeepSeek-V4 training step on this CPU: dstrain's DeepSeekV4LM against transformers'
DeepseekV4ForCausalLM (the inference-only reference: its training forward and backward still run) on the
same model and batch.

  python launch/bench_v4.py                              # fp32, 2 x 1024 tokens, 3 A B B A rounds
  python launch/bench_v4.py --dtype both --rounds 5
  python launch/bench_v4.py --seq_len 512 --batch 1 --memory saved

One V4-shaped model (every attention kind: sliding, CSA and HCA at the published compress rates 4 and 128,
a hash layer, 4 mHC streams, 16 experts top-4) built by transformers in fp32 (its default experts and
attention implementations), randomised by tests/helpers/v4.py `randomize_v4` (the parity tests' oracle:
every weight N(0, 0.2), the hash table and expert biases drawn), the same weights loaded into dstrain's
model (no MTP and no balance loss: transformers has neither). The CSA indexer runs `--indexer_stage frozen`
by default: attention over its top-k on both sides and no indexer loss, as transformers trains none;
`sparse` adds dstrain's indexer KL and its gradient (the training default), which transformers does not
compute. bf16: both models `.to(bfloat16)`.

Figures, per dtype:
  loss     both models' loss on the batch and their relative difference, first: the same computation or
           no comparison (fp32: ~1e-6 or less; bf16: rounding at different places, ~1e-3)
  speed    a training step (forward with labels + backward, no optimizer), tokens/s; A B B A per round
           after 1 + `--warmup` untimed steps each (oneDNN builds its kernels over the first steps);
           quoted: the median step time and the median and min over rounds of the per-round ratio
           transformers time / dstrain time (> 1: dstrain faster)
  memory   `saved`: the bytes autograd keeps for backward after one training forward, caught by
           `torch.autograd.graph.saved_tensors_hooks`, each storage once (by its `data_ptr()`), the
           model's own parameters and buffers left out (and what a freed graph saved: still alive at the
           forward's end only). `rss`: the process's peak resident set over one
           step above its resident set before it (VmHWM reset by /proc/self/clear_refs, free heap returned
           by malloc_trim first; allocator-dependent, Linux only). For transformers, dstrain, and dstrain
           with `set_activation_checkpointing("mhc")` (each mHC's weights recomputed in backward) and with
           "full" (every block recomputed). Under "full" the hook undercounts: non-reentrant checkpointing
           keeps each block's input by reference, outside the hooks (B x T x hc_mult x hidden per block).
Prints torch's version, threads, the CPU bf16 kernel path dstrain takes (kernels.CPU_NATIVE_BF16),
transformers' experts and attention implementations, the shapes, and a table per dtype.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import gc
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402

from dstrain.model import DeepSeekV4LM, V4Config  # noqa: E402
from dstrain.model.common.kernels import cpu_bf16_path  # noqa: E402
from tests.helpers.v4 import randomize_v4  # noqa: E402

# tests/helpers/v4.py's V4_SHAPE scaled up; the published compress rates, transformers' default rope.
SHAPE = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "head_dim": 64,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "o_groups": 2,
    "o_lora_rank": 64,
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 64,
    "sliding_window": 128,
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "num_hash_layers": 1,
    "hc_mult": 4,
    "max_position_embeddings": 8192,
}
DTYPES = {"fp32": [torch.float32], "bf16": [torch.bfloat16], "both": [torch.float32, torch.bfloat16]}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
MIB = 2**20


def models(stage: str) -> tuple[DeepseekV4ForCausalLM, DeepSeekV4LM, list[str], list[str]]:
    """transformers' fp32 model randomised, dstrain's with its weights; the keys load_state_dict left out."""
    torch.manual_seed(0)
    ref = randomize_v4(DeepseekV4ForCausalLM(DeepseekV4Config(**SHAPE)), seed=0)
    cfg = V4Config.from_hf_dict(ref.config.to_dict()).replace(num_nextn_predict_layers=0, aux_loss_alpha=0.0)
    ours = DeepSeekV4LM(cfg)
    weights = {k.removeprefix("model."): v for k, v in ref.state_dict().items()}
    missing, unexpected = ours.load_state_dict(weights, strict=False)
    ours.set_sparse_attention(stage)
    return ref.train(), ours.train(), missing, unexpected


def step(model: nn.Module, ids: torch.Tensor, hf: bool) -> float:
    """A training step without the optimizer: forward with labels, backward; -> the loss."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids, use_cache=False).loss if hf else model(ids, labels=ids).loss
    loss.backward()
    return loss.item()


def interleaved(ref: nn.Module, ours: nn.Module, ids: torch.Tensor, rounds: int) -> dict[str, list[float]]:
    """Per round: transformers, dstrain, dstrain, transformers; -> each one's round time (mean of its two)."""
    times: dict[str, list[float]] = {"transformers": [], "dstrain": []}
    for _ in range(rounds):
        got = {"transformers": 0.0, "dstrain": 0.0}
        for name in ("transformers", "dstrain", "dstrain", "transformers"):
            t0 = time.perf_counter()
            step(ref if name == "transformers" else ours, ids, name == "transformers")
            got[name] += time.perf_counter() - t0
        for name, t in got.items():
            times[name].append(t / 2)
    return times


def saved_bytes(model: nn.Module, ids: torch.Tensor, hf: bool) -> int:
    """Bytes of the storages autograd keeps for backward after one training forward, each once; the model's
    own parameters and buffers left out, and tensors saved by a graph freed before the forward's end."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    packed: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(weakref.ref(t))  # alive while a graph node holds it
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids, labels=ids, use_cache=False) if hf else model(ids, labels=ids)
    kept = {s.data_ptr(): s.nbytes() for s in (r().untyped_storage() for r in packed if r() is not None)}
    del out
    return sum(n for ptr, n in kept.items() if ptr not in own)


def _vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def rss_bytes(model: nn.Module, ids: torch.Tensor, hf: bool) -> int | None:
    """The process's peak resident set during one training step above its resident set before it (Linux)."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    _malloc_trim()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
        before = _vm_kib("VmRSS")
    except (OSError, KeyError):
        return None
    step(model, ids, hf)
    return (_vm_kib("VmHWM") - before) * 1024


def memory(ref: nn.Module, ours: DeepSeekV4LM, ids: torch.Tensor, kinds: list[str]) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for name, model, hf, mode in [
        ("transformers", ref, True, None),
        ("dstrain", ours, False, "none"),
        ("dstrain + mhc recompute", ours, False, "mhc"),
        ("dstrain + full recompute", ours, False, "full"),
    ]:
        if mode is not None:
            model.set_activation_checkpointing(mode)
        rows[name] = {
            "saved": saved_bytes(model, ids, hf) if "saved" in kinds else None,
            "rss": rss_bytes(model, ids, hf) if "rss" in kinds else None,
        }
    ours.set_activation_checkpointing("none")
    return rows


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="A B B A rounds per dtype")
    p.add_argument("--warmup", type=int, default=2, help="steps per model after the loss check, untimed")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--memory", choices=["saved", "rss", "both", "none"], default="both")
    p.add_argument("--indexer_stage", choices=["frozen", "sparse"], default="frozen")
    args = p.parse_args()
    kinds = {"both": ["saved", "rss"], "none": []}.get(args.memory, [args.memory])

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU bf16 path: {cpu_bf16_path()}")
    ids = torch.randint(
        0, SHAPE["vocab_size"], (args.batch, args.seq_len), generator=torch.Generator().manual_seed(1)
    )
    tokens = ids.numel()
    base_ref, base_ours, missing, unexpected = models(args.indexer_stage)
    ref_cfg = base_ref.config
    print(f"transformers: experts {ref_cfg._experts_implementation_internal!r}, "
          f"attention {ref_cfg._attn_implementation!r}")  # fmt: skip
    print(
        f"model: {SHAPE['num_hidden_layers']} layers {SHAPE['layer_types']}, compress rates "
        f"{SHAPE['compress_rates']}, hidden {SHAPE['hidden_size']}, {SHAPE['num_attention_heads']} heads x "
        f"{SHAPE['head_dim']} (rope {SHAPE['qk_rope_head_dim']}), q_lora {SHAPE['q_lora_rank']}, o_groups "
        f"{SHAPE['o_groups']} x o_lora {SHAPE['o_lora_rank']}, {SHAPE['n_routed_experts']} experts top-"
        f"{SHAPE['num_experts_per_tok']} x {SHAPE['moe_intermediate_size']}, {SHAPE['num_hash_layers']} hash "
        f"layer, indexer {SHAPE['index_n_heads']} x {SHAPE['index_head_dim']} top-{SHAPE['index_topk']}, "
        f"window {SHAPE['sliding_window']}, hc_mult {SHAPE['hc_mult']}, vocab {SHAPE['vocab_size']}; "
        f"{sum(x.numel() for x in base_ours.parameters()) / 1e6:.1f}M parameters"
    )
    print(f"batch {args.batch} x {args.seq_len} = {tokens} tokens; indexer stage {args.indexer_stage!r}; "
          f"{args.rounds} A B B A rounds")  # fmt: skip
    left = {"missing": list(missing) or "none", "unexpected": list(unexpected) or "none"}
    print(f"dstrain load_state_dict(strict=False): {left}")
    del base_ref, base_ours

    for dtype in DTYPES[args.dtype]:
        dn = DTYPE_NAMES[dtype]
        ref, ours, _, _ = models(args.indexer_stage)
        ref, ours = ref.to(dtype), ours.to(dtype)
        try:  # also each model's first warm-up step
            a, b = step(ref, ids, True), step(ours, ids, False)
        except RuntimeError as e:  # a dtype one side does not run
            print(f"\n[{dn}] does not run: {type(e).__name__}: {str(e)[:300]}")
            continue
        rel = abs(a - b) / abs(a)
        print(f"\n[{dn}] loss transformers {a:.6f}, dstrain {b:.6f}: relative difference {rel:.1e}")
        if rel > (1e-4 if dtype == torch.float32 else 2e-2):
            print("  WARNING: the losses disagree: not the same computation, the figures below compare less")
        for _ in range(args.warmup):  # oneDNN builds its kernels over the first steps (bf16: several)
            step(ref, ids, True), step(ours, ids, False)
        times = interleaved(ref, ours, ids, args.rounds)
        ratios = [t / d for t, d in zip(times["transformers"], times["dstrain"], strict=True)]
        med = {name: statistics.median(ts) for name, ts in times.items()}
        mem = memory(ref, ours, ids, kinds)
        print(f"  {'':26s} {'step s':>8s} {'tokens/s':>9s} {'saved MiB':>10s} {'peak RSS +MiB':>14s}")
        for name, row in mem.items():
            speed = f"{med[name]:8.3f} {tokens / med[name]:9.0f}" if name in med else f"{'':8s} {'':9s}"
            print(f"  {name:26s} {speed} {_mib(row['saved']):>10s} {_mib(row['rss']):>14s}")
        mid, low = statistics.median(ratios), min(ratios)
        print(f"  dstrain speed-up (transformers time / dstrain time): median {mid:.2f}x, min {low:.2f}x "
              f"over {len(ratios)} rounds")  # fmt: skip
        if "saved" in kinds:
            base = mem["transformers"]["saved"]
            print("  saved for backward, / transformers: " + ", ".join(
                f"{n} {r['saved'] / base:.2f}" for n, r in mem.items() if n != "transformers"
            ))  # fmt: skip
        del ref, ours
        gc.collect()


if __name__ == "__main__":
    main()
