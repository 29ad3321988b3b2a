"""Multi-rank worker for tests/test_parallel.py: `python -m torch.distributed.run --nproc_per_node N
tests/parallel_worker.py OUT LAYOUT [LAYOUT ...]` trains each layout 5 steps on the same global batches
(4 rows/step), saves at step 3 and 5, resumes from 3 in the same layout, and writes OUT/LAYOUT.json.

adam_eps 1e-6: with the default 1e-8, a weight whose gradient is ~1e-9 (a nearly dead MLP neuron of this tiny
model) gets an Adam step of ~lr * g / (|g| + eps) that turns fp32 summation-order noise into a visible
difference; the larger eps keeps the comparison about the layouts, not about that amplification."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_train_support import GlobalRows, make_options, tiny_config  # noqa: E402

GLOBAL_ROWS = 4
STEPS = 5
LAYOUTS = {  # name -> flags
    "pp2": "--config zero1 --pp 2",
    "tp2": "--config zero1 --tp 2",
    "tp2_z2": "--config zero2 --tp 2",
    "ep2_z1": "--config zero1 --ep 2",
    "ep2_z2": "--config zero2 --ep 2",
    "dp2_z1": "--config zero1",
    "dp2_z2": "--config zero2",
    "dp2_z3": "--config zero3",
    "pp2dp2": "--config zero1 --pp 2",
    "tp2dp2": "--config zero2 --tp 2",
    "ep2dp2": "--config zero2 --ep 2",
    "pp2tp2": "--config zero1 --pp 2 --tp 2",
    "dp4_z1": "--config zero1",
}


def common(dp: int) -> str:
    micro = 1 if dp > 1 else 2
    ga = GLOBAL_ROWS // (micro * dp)
    return (
        f"--micro_batch_size {micro} --gradient_accumulation_steps {ga} --max_steps {STEPS} --clip_grad 0.5 "
        "--save_every 3 --keep_last 0 --precision fp32 --adam_eps 1e-6"
    )


def trainer(flags: str, out_dir: str, info, resume: str | None = None):  # noqa: ANN001
    from dstrain.training.ds_config import load_ds_config, parallel_dims, resolve_ds_config
    from dstrain.training.trainer import Trainer

    cfg = tiny_config()
    probe = make_options(flags.split())
    _, raw = load_ds_config(probe.train.config)
    ds0 = resolve_ds_config(raw, probe.train, world_size=info.world_size, precision="fp32", hidden_size=32)
    dims = parallel_dims(ds0, info.world_size)
    opts = make_options(f"{flags} {common(dims.dp)}".split())
    ds = resolve_ds_config(raw, opts.train, world_size=info.world_size, precision="fp32", hidden_size=32)
    dims.validate(cfg, int(ds["zero_optimization"]["stage"]))
    opts.train.output_dir = out_dir
    _, dp_rank, _ = dims.coords(info.rank)
    t = opts.train
    loader = GlobalRows(t.micro_batch_size, t.gradient_accumulation_steps, dp_rank, dims.dp)
    tr = Trainer(opts, info, ds, out_dir, model_config=cfg, loader=loader, resume_path=resume, verbose=False)
    tr.setup()
    return tr


def main(out: str, layouts: list[str]) -> None:
    from dstrain.training import dist

    info = dist.init_distributed()
    for name in layouts:
        base = f"{out}/{name}"
        t0 = time.perf_counter()
        tr = trainer(LAYOUTS[name], f"{base}/straight", info)
        tr.run()
        wall = time.perf_counter() - t0
        hist = [{k: r[k] for k in ("loss", "grad_norm", "step_time_s")} for r in tr.history]
        tr = trainer(
            LAYOUTS[name], f"{base}/resumed", info, resume=f"{base}/straight/checkpoints/step_00000003"
        )
        tr.run()
        resumed = [r["loss"] for r in tr.history]
        if info.rank == 0:
            Path(f"{base}.json").write_text(json.dumps({"history": hist, "resumed": resumed, "wall_s": wall}))
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
