"""`dstrain plan`'s predicted peak memory per rank against the peak measured on this machine.

  python launch/bench_plan.py                 # one 2-rank launch over every layout, then the table
  python launch/bench_plan.py --json OUT      # also write the figures (the test reads them)

Each layout builds a fresh Trainer (hidden 256, 4 layers of which 3 MoE with 16 experts top-4 and 1 shared,
MTP 1, vocabulary 8192; fp32; micro batch 2 x 256 tokens) and trains 3 steps under
`dstrain.memory.measure.AllocationTracker`: the peak of live tensor bytes allocated by torch on the rank,
from before the model is built through the third step (the CPU analogue of torch.cuda.max_memory_allocated,
which is what the estimate predicts; see dstrain/memory/measure.py). Step 1 creates AdamW's moments and step 2 runs with
ZeRO-3's complete parameter trace, so the peak counted is max(setup, step 3) (see `steady_peak`). The DeepSpeed configs are the
shipped ones with 4M-element buckets (the shipped 2e8 would be 763 MiB in fp32 and hide everything else; the
estimate predicts buckets of any size the same way).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ranks import torchrun

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {  # name -> flags (2 ranks)
    "ZeRO-1": "--config zero1",
    "ZeRO-2": "--config zero2",
    "ZeRO-3": "--config zero3",
    "PP2": "--config zero1 --pp 2",
    "PP2 GA2": "--config zero1 --pp 2 --gradient_accumulation_steps 2",
    "TP2": "--config zero1 --tp 2",
    "EP2": "--config zero2 --ep 2",
    "ZeRO-1 ckpt": "--config zero1 --activation_checkpointing full",
    "ZeRO-3 ckpt": "--config zero3 --activation_checkpointing full",
    "EP2 ckpt": "--config zero2 --ep 2 --activation_checkpointing full",
    "ZeRO-2 bf16": "--config zero2 --precision bf16",
    "TP2 bf16 ckpt": "--config zero2 --tp 2 --precision bf16 --activation_checkpointing full",
}
SEQ, MICRO, STEPS = 256, 2, 3
BUCKET = 4_000_000


def model_config():  # noqa: ANN201 - a dstrain ModelConfig
    from dstrain.model import ModelConfig

    return ModelConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=1, topk_group=1,
        first_k_dense_replace=1, num_nextn_predict_layers=1,
    )  # fmt: skip


def small_bucket_config(name: str, out: str) -> str:
    """The shipped config `name` with BUCKET-element reduce / all-gather / prefetch buckets."""
    from dstrain.config.ds_config import config_path

    ds = json.loads(config_path(name).read_text())
    zero = ds["zero_optimization"]
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
        if key in zero or (key.startswith("stage3") and zero["stage"] == 3):
            zero[key] = BUCKET
    path = os.path.join(out, f"{name}_small.json")
    with open(path, "w") as f:
        json.dump(ds, f)
    return path


def options(flags: str, tmp: str):  # noqa: ANN201 - dstrain Options
    from dstrain.config.options import parse_options

    args = flags.split()
    i = args.index("--config")
    args[i + 1] = small_bucket_config(args[i + 1], tmp)
    if "--precision" not in args:
        args += ["--precision", "fp32"]
    return parse_options([*args, "--seq_len", str(SEQ), "--micro_batch_size",
                          str(MICRO), "--max_steps", str(STEPS), "--save_every", "0", "--no-tensorboard",
                          "--no-plots"])  # fmt: skip


def steady_peak(phases: dict) -> int:
    """max(setup, the last step): the last step's rise above its own start, on top of what was live when
    step 2 began. A gloo worker's free that the tracker missed (and no later allocation revealed) would
    otherwise carry into the next step as bytes that are not there; steps 2 and 3 start with the same
    live tensors (the moments exist from step 1 on)."""
    last = phases[f"step {STEPS}"]
    return max(phases["setup"].peak_bytes, phases["step 2"].start_bytes + last.peak_bytes - last.start_bytes)


def measure(info, names: list[str], cfg=None, layouts: dict[str, str] | None = None) -> dict:  # noqa: ANN001 - a dstrain.dist.DistInfo, a model config
    """This rank's measured and predicted peak (bytes) and the estimate's peak phase, for each layout (of
    `layouts`, LAYOUTS by default) of the model `cfg` (`model_config()` by default)."""
    import gc

    import torch

    from dstrain import dist
    from dstrain.config.plan import prepare
    from dstrain.memory.estimate import Workload, estimate
    from dstrain.memory.measure import AllocationTracker
    from dstrain.training.trainer import Trainer

    cfg = cfg or model_config()
    layouts = layouts or LAYOUTS

    class Rows:
        def __init__(self) -> None:
            self.g = torch.Generator().manual_seed(0)

        def __next__(self) -> dict:
            ids = torch.randint(0, cfg.vocab_size, (MICRO, SEQ), generator=self.g)
            return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(SEQ).expand_as(ids)}

    results = {}
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            plan = prepare(options(layouts[name], tmp), info.world_size, model=cfg).with_output_dir(tmp)
            with AllocationTracker() as tracker:
                with tracker.phase("setup"):
                    trainer = Trainer(plan, info, loader=Rows(), verbose=False)
                    trainer.setup()
                for step in range(1, STEPS + 1):
                    with tracker.phase(f"step {step}"):
                        trainer.train_step()
            del trainer
            gc.collect()
            dist.barrier()
        measured = steady_peak({p.name: p for p in tracker.phases})
        est = estimate(Workload.of(plan))
        results[name] = {"measured": measured, "predicted": est.per_rank[info.rank], "phase": est.phase}
    return results


def worker(names: list[str], out: str) -> None:
    """One rank of the launch: `measure`, every rank's results written by rank 0 to `out`."""
    sys.path.insert(0, str(ROOT))
    import torch.distributed as tdist

    from dstrain import dist

    info = dist.init_distributed()
    results = measure(info, names)
    gathered: list = [None] * info.world_size
    tdist.all_gather_object(gathered, results)
    if info.rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f, indent=1)


def table(per_rank: list[dict]) -> str:
    lines = ["| layout | rank | predicted MiB | measured MiB | error |", "|---|---|---|---|---|"]
    for name in per_rank[0]:
        for rank, res in enumerate(per_rank):
            r = res[name]
            err = r["predicted"] / r["measured"] - 1
            lines.append(
                f"| {name} | {rank} | {r['predicted'] / 2**20:.1f} | {r['measured'] / 2**20:.1f} | {err:+.1%} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the per-rank figures here")
    ap.add_argument("--layouts", help="comma-separated subset of: " + ", ".join(LAYOUTS))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    names = args.layouts.split(",") if args.layouts else list(LAYOUTS)
    if args.worker:
        sys.path.insert(0, str(ROOT))
        from dstrain import dist

        try:
            worker(names, args.worker)
        finally:
            dist.shutdown()
        dist.finish()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        out = args.json or os.path.join(tmp, "plan.json")
        cmd = torchrun(2, __file__, "--worker", out, "--layouts", ",".join(names))
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        per_rank = json.loads(Path(out).read_text())
    print(table(per_rank))


if __name__ == "__main__":
    main()
