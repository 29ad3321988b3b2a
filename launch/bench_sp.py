"""What sequence parallelism buys on 2 ranks: per-rank step memory by row length, with --sp 2 (each rank holds
half of every row) and without (each rank holds whole rows), and the longest row that stays within a memory
budget per rank.

  python launch/bench_sp.py                                  # lengths 2048..16384, budget 2 GiB per rank
  python launch/bench_sp.py --lengths 2048,4096 --budget_gb 1

Rows are single documents (causal attention without a document mask: the long-context case; on GPUs packed
rows run varlen kernels whose memory is linear in the length too, while the CPU's SDPA needs a (T, T) mask
that every rank of a sequence-parallel group builds whole). Memory: the peak bytes of tensors created during
one training step (forward, backward, AdamW) above what lived before it, from the CPU allocator's events
(`dstrain.memory.measure`, what `dstrain plan` is checked against); the max over the 2 ranks. Each (sp, length) is a fresh Trainer doing one
warm-up step, one timed step and one profiled step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ranks import torchrun

ROOT = Path(__file__).resolve().parents[1]


def worker(lengths: list[int], out: str) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    from dstrain import dist
    from dstrain.config.options import parse_options
    from dstrain.config.plan import prepare
    from dstrain.memory.measure import AllocationTracker
    from dstrain.model import ModelConfig
    from dstrain.training.trainer import Trainer

    info = dist.init_distributed()
    cfg = ModelConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, num_nextn_predict_layers=1,
    )  # fmt: skip

    class Rows:
        def __init__(self, seq: int) -> None:
            self.seq, self.g = seq, torch.Generator().manual_seed(0)

        def __next__(self) -> dict:
            ids = torch.randint(0, cfg.vocab_size, (1, self.seq), generator=self.g)
            return {
                "input_ids": ids,
                "labels": ids.clone(),
                "position_ids": torch.arange(self.seq).expand_as(ids),
            }

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for sp in (1, 2):
            for seq in lengths:
                flags = (
                    f"--config zero1 --sp {sp} --seq_len {seq} --micro_batch_size 1 --precision fp32 "
                    "--save_every 0 --max_steps 2 --num_workers 0"
                )
                plan = prepare(parse_options(flags.split()), 2, model=cfg).with_output_dir(
                    f"{tmp}/{sp}_{seq}"
                )
                tr = Trainer(plan, info, loader=Rows(seq), verbose=False)
                tr.setup()
                tr.train_step()  # warm-up
                t0 = time.perf_counter()
                tr.train_step()
                step_s = time.perf_counter() - t0
                with AllocationTracker() as mem:
                    tr.train_step()
                growth = dist.all_reduce(torch.tensor(float(mem.peak_bytes)), torch.distributed.ReduceOp.MAX)
                rows.append({"sp": sp, "seq_len": seq, "step_gib": float(growth) / 2**30, "step_s": step_s})
                del tr
    if info.rank == 0:
        Path(out).write_text(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,4096,8192,16384")
    ap.add_argument("--budget_gb", type=float, default=2.0)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.worker:
        sys.path.insert(0, str(ROOT))
        from dstrain import dist

        try:
            worker(lengths, args.worker)
        finally:
            dist.shutdown()
        dist.finish()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/sp.json"
        cmd = torchrun(2, __file__, "--lengths", args.lengths, "--worker", out)
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        rows = json.loads(Path(out).read_text())
    print("2 ranks, ZeRO-1, fp32, 1 row per step, hidden 256, 8 heads, 2 layers (1 MoE), MTP 1")
    # tokens/s: without --sp the 2 ranks train 2 rows a step, with --sp 2 one
    print(
        f"{'seq_len':>8s} {'sp1 GiB':>9s} {'sp2 GiB':>9s} {'sp2/sp1':>8s} {'sp1 tok/s':>10s} {'sp2 tok/s':>10s}"
    )
    by = {(r["sp"], r["seq_len"]): r for r in rows}
    for seq in lengths:
        a, b = by[(1, seq)], by[(2, seq)]
        print(
            f"{seq:8d} {a['step_gib']:9.3f} {b['step_gib']:9.3f} {b['step_gib'] / a['step_gib']:8.2f} "
            f"{2 * seq / a['step_s']:10.0f} {seq / b['step_s']:10.0f}"
        )
    for sp in (1, 2):
        fit = [seq for seq in lengths if by[(sp, seq)]["step_gib"] <= args.budget_gb]
        print(
            f"--sp {sp}: longest row within {args.budget_gb:g} GiB of step memory per rank: {max(fit, default=0)}"
        )


if __name__ == "__main__":
    main()
