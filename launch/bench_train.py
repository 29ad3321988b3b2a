"""Trainer overhead and ZeRO memory benchmark.

  python launch/bench_train.py                  # both parts (the memory part launches 2 ranks itself)
  python launch/bench_train.py --part time      # dstrain step time / bare PyTorch step time, 1 rank, ZeRO-1
  python launch/bench_train.py --part memory    # model-state bytes per rank, ZeRO 1/2/3 vs 0, 2 ranks, bf16

time: one process holds both a dstrain Trainer (DeepSpeed ZeRO-1, 1 rank) and a bare loop (forward,
backward, clip_grad_norm_, torch AdamW, expert-bias update) on the same model shape and the same batch, and
alternates them A B B A so machine noise hits both alike; the figure is the median of per-cycle ratios.

memory: after the backward of a step and before its optimizer step (when parameters, gradients and
optimizer states all exist), the distinct tensor storages reachable from the engine's parameters (data,
ZeRO-3 partitions, grads) and from its ZeRO optimizer, in bytes per model parameter on one rank. DeepSpeed's
communication bucket buffers (ipg_buckets) are shown apart: they are scratch space, not model states.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ranks import torchrun

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dstrain.model import ModelConfig, build_model  # noqa: E402

# Tokens per rank per step: 8 x 512 = 4096, a modest GPU micro batch. ZeRO-1's own work (copying gradients
# into its flat fp32 partition, the flat optimizer step, copying parameters back) grows with the parameter
# count, not with tokens, so its relative cost shrinks as the batch grows: --micro_batch_size/--seq_len.
SEQ = 512
MICRO = 8


def bench_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        num_nextn_predict_layers=1,
    )


def fixed_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 8192, (MICRO, SEQ), generator=g)
    return {
        "input_ids": ids,
        "labels": ids.clone(),
        "position_ids": torch.arange(SEQ).expand(MICRO, SEQ).clone(),
    }


class Repeat:
    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        self.batch = batch

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.batch

    def state_dict(self) -> dict:
        return {}


def _trainer(stage: int, precision: str, world: int, out_dir: str, info, cfg: ModelConfig):  # noqa: ANN001
    """A set-up Trainer for ZeRO `stage` (0-3: the shipped config of that stage, or zero1's set to 0)."""
    from dstrain.config.ds_config import load_ds_config
    from dstrain.config.options import parse_options
    from dstrain.config.plan import prepare
    from dstrain.training.trainer import Trainer

    _, raw = load_ds_config(f"zero{max(stage, 1)}")
    raw["zero_optimization"]["stage"] = stage
    config = Path(out_dir) / "ds_config.json"
    config.write_text(json.dumps(raw))
    flags = f"--config {config} --micro_batch_size {MICRO} --seq_len {SEQ} --max_steps 1000"
    opts = parse_options([*flags.split(), "--precision", precision, "--save_every", "0"])
    plan = prepare(opts, world, model=cfg).with_output_dir(out_dir)
    tr = Trainer(plan, info, loader=Repeat(fixed_batch(info.rank)), verbose=False)
    tr.setup()
    return tr


# ---------------------------------------------------------------------- time
def part_time(cycles: int) -> dict:
    import tempfile

    from dstrain import dist
    from dstrain.training.metrics import MetricsSink

    info = dist.init_distributed()
    cfg = bench_config()
    out = tempfile.mkdtemp(prefix="bench_train_")
    tr = _trainer(1, "fp32", 1, out, info, cfg)
    sink = MetricsSink(out, True)

    model = build_model(cfg, dtype=torch.float32, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    batch = fixed_batch()

    def step_a() -> float:
        t0 = time.perf_counter()
        sink.log(tr.train_step())
        return time.perf_counter() - t0

    def step_b() -> float:
        t0 = time.perf_counter()
        out_ = model(**batch)
        out_.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_expert_bias(out_.expert_load)
        float(out_.loss.detach())
        return time.perf_counter() - t0

    for _ in range(2):
        step_a(), step_b()
    ratios, ta, tb = [], [], []
    for _ in range(cycles):
        a1, b1, b2, a2 = step_a(), step_b(), step_b(), step_a()
        ta += [a1, a2]
        tb += [b1, b2]
        ratios.append((a1 + a2) / (b1 + b2))
    sink.close()
    return {
        "threads": torch.get_num_threads(),
        "dstrain_median_s": statistics.median(ta),
        "bare_median_s": statistics.median(tb),
        "median_ratio": statistics.median(ratios),
        "ratios": [round(r, 4) for r in ratios],
    }


# ---------------------------------------------------------------------- memory
def _reachable(obj, path: str, out: list, seen: set, depth: int = 0) -> None:  # noqa: ANN001
    if depth > 8 or id(obj) in seen:
        return
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
        return
    if (
        isinstance(obj, (torch.nn.Module, str, bytes, int, float, bool, type(None)))
        or "ProcessGroup" in type(obj).__name__
    ):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for v in obj.values():
            _reachable(v, path, out, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            _reachable(v, path, out, seen, depth + 1)
    elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("deepspeed", "torch"):
        for k, v in vars(obj).items():
            _reachable(v, f"{path}.{k}", out, seen, depth + 1)


def held_bytes(engine) -> dict[str, int]:  # noqa: ANN001
    """Distinct storages by where they were found (first finder wins), in bytes."""
    found = []
    for p in engine.module.parameters():
        found.append(("param", p.data))
        if hasattr(p, "ds_tensor"):
            found.append(("param.ds_tensor", p.ds_tensor))
        if p.grad is not None:
            found.append(("param.grad", p.grad))
    _reachable(engine.optimizer, "optimizer", found, set())
    seen, by = set(), collections.Counter()
    for path, t in found:
        st = t.untyped_storage()
        if st.data_ptr() == 0 or st.data_ptr() in seen or t.device.type == "meta":
            continue
        seen.add(st.data_ptr())
        by[path] += st.nbytes()
    return dict(by)


def memory_worker(out_json: str) -> None:
    import tempfile

    from dstrain import dist

    info = dist.init_distributed()
    cfg = bench_config()
    result = {}
    for stage in (0, 1, 2, 3):
        tr = _trainer(stage, "bf16", info.world_size, tempfile.mkdtemp(prefix="bench_mem_"), info, cfg)
        tr.train_step()  # optimizer states exist from the first step on
        engine = tr.engine
        out = engine(**{k: v for k, v in fixed_batch(info.rank).items()})
        engine.backward(out.loss)
        by = held_bytes(engine)
        n = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
        comm = sum(v for k, v in by.items() if "ipg_bucket" in k)
        states = sum(by.values()) - comm
        result[stage] = {
            "params": n,
            "bytes_per_param": states / n,
            "comm_buffers_per_param": comm / n,
            "breakdown": {k: round(v / n, 3) for k, v in sorted(by.items(), key=lambda kv: -kv[1])},
        }
        engine.step()
        del tr, engine, out
    gathered = dist.broadcast_object(result)  # rank 0's view; ranks hold the same amounts
    if info.rank == 0:
        Path(out_json).write_text(json.dumps(gathered))


def part_memory(port: int) -> dict:
    import tempfile

    out = os.path.join(tempfile.mkdtemp(prefix="bench_mem_"), "memory.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = torchrun(2, __file__, "--part", "memory-worker", "--out", out, "--micro_batch_size", "2", "--seq_len", "64",
                   port=port)  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-4000:])
    res = {int(k): v for k, v in json.loads(Path(out).read_text()).items()}
    base = res[0]["bytes_per_param"]
    for stage in (1, 2, 3):
        res[stage]["ratio_vs_stage0"] = res[stage]["bytes_per_param"] / base
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["all", "time", "memory", "memory-worker"], default="all")
    ap.add_argument("--cycles", type=int, default=8, help="ABBA cycles for the time part")
    ap.add_argument("--port", type=int, default=29771, help="master port of the 2-rank memory launch")
    ap.add_argument("--micro_batch_size", type=int, default=MICRO, help="rows per step (time part)")
    ap.add_argument("--seq_len", type=int, default=SEQ, help="tokens per row (time part)")
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    globals().update(MICRO=args.micro_batch_size, SEQ=args.seq_len)
    if args.part == "memory-worker":
        memory_worker(args.out)
        return
    if args.part in ("all", "time"):
        t = part_time(args.cycles)
        print(
            f"time: {MICRO} x {SEQ} tokens per step; dstrain ZeRO-1 step {t['dstrain_median_s'] * 1e3:.1f} ms, bare PyTorch step "
            f"{t['bare_median_s'] * 1e3:.1f} ms, median ABBA ratio {t['median_ratio']:.3f} (target <= 1.05; "
            f"{t['threads']} threads; per cycle {t['ratios']})",
            flush=True,
        )
    if args.part in ("all", "memory"):
        m = part_memory(args.port)
        targets = {1: 0.625, 2: 0.5625, 3: 0.55}
        print(
            f"memory: stage 0 holds {m[0]['bytes_per_param']:.2f} bytes/param per rank "
            f"({m[0]['params'] / 1e6:.1f}M params, bf16 mixed precision, 2 ranks)"
        )
        for stage in (1, 2, 3):
            r = m[stage]
            print(
                f"memory: ZeRO-{stage} {r['bytes_per_param']:.2f} bytes/param = {r['ratio_vs_stage0']:.4f} x stage 0 "
                f"(target <= {targets[stage]}); comm buckets {r['comm_buffers_per_param']:.2f} B/param apart; "
                f"{r['breakdown']}"
            )


if __name__ == "__main__":
    main()
