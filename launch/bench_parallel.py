"""Step time of each parallel layout relative to plain data parallelism, on this machine.

  python launch/bench_parallel.py            # launches 2 ranks (dp2, pp2, tp2, ep2), then 4 (dp4, pp2dp2, ...)
  python launch/bench_parallel.py --nproc 2

One launch per world size; inside it every layout trains the same model (hidden 256, 4 layers, 8 experts
top-2, 1 shared, MTP 1) on the same random batches, in ABBA order over the layouts (the first slot of a round
runs slower here), each slot a fresh Trainer doing 2 warm-up + 6 timed steps. Printed: median step time per
layout and its ratio to DP (median over rounds of per-round ratios). CPU ranks share 2 cores: the figures
say what the layouts cost in communication and bookkeeping here, not what they buy on GPUs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ranks import torchrun

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    2: {"dp2": "", "pp2": "--pp 2", "tp2": "--tp 2", "ep2": "--ep 2"},
    4: {"dp4": "", "pp2dp2": "--pp 2", "tp2dp2": "--tp 2", "ep2dp2": "--ep 2", "pp2tp2": "--pp 2 --tp 2"},
}
WARMUP, TIMED, ROUNDS = 2, 6, 2
SEQ, ROWS = 128, 8  # global batch: 8 rows of 128 tokens


def worker(nproc: int) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    from dstrain import dist
    from dstrain.config.options import parse_options
    from dstrain.config.plan import prepare
    from dstrain.model import ModelConfig
    from dstrain.training.trainer import Trainer

    info = dist.init_distributed()
    cfg = ModelConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, num_nextn_predict_layers=1,
    )  # fmt: skip

    class Rows:
        def __init__(self, micro: int) -> None:
            self.micro, self.g = micro, torch.Generator().manual_seed(0)

        def __next__(self) -> dict:
            ids = torch.randint(0, cfg.vocab_size, (self.micro, SEQ), generator=self.g)
            return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(SEQ).expand_as(ids)}

    names = list(LAYOUTS[nproc])
    order = [n for _ in range(ROUNDS) for n in (names + names[::-1])]
    times: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for slot, name in enumerate(order):
            flags = f"--config zero1 {LAYOUTS[nproc][name]} --precision fp32 --save_every 0 --seq_len {SEQ}"
            dp = prepare(parse_options(flags.split()), nproc, model=cfg).dims.dp
            micro = 2 if dp * 2 <= ROWS else 1
            ga = ROWS // (micro * dp)
            flags += (
                f" --micro_batch_size {micro} --gradient_accumulation_steps {ga} --max_steps {WARMUP + TIMED}"
            )
            plan = prepare(parse_options(flags.split()), nproc, model=cfg).with_output_dir(f"{tmp}/{slot}")
            tr = Trainer(plan, info, loader=Rows(micro), verbose=False)
            tr.setup()
            for _ in range(WARMUP):
                tr.train_step()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(TIMED):
                tr.train_step()
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / TIMED)
            del tr
    if info.rank == 0:
        base = names[0]
        print(f"{'layout':8s} {'step s':>8s} {'vs ' + base:>8s}")
        for n in names:
            ratios = [a / b for a, b in zip(times[n], times[base])]
            print(f"{n:8s} {statistics.median(times[n]):8.3f} {statistics.median(ratios):8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, choices=(2, 4), action="append")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    for n in args.nproc or (2, 4):
        print(f"== {n} ranks, ZeRO-1, fp32, global batch {ROWS} x {SEQ} tokens", flush=True)
        cmd = torchrun(n, __file__, "--worker", str(n))
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)


if __name__ == "__main__":
    main()
