"""The multi-rank trainer worker: `python -m torch.distributed.run --nproc_per_node 2 -m tests.training.worker
MODE OUT` (run from the repository root). MODE main: ZeRO 1/2/3 runs with resumes, GA splits, uneven
routing, bf16 and the NaN policies; MODE kill: a run continued with --resume auto (after a killed save);
MODE compile: --compile in each layout; MODE templates: other projects' DeepSpeed files."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from tests.helpers.tiny import ROOT, tiny_config
from tests.helpers.trainer import GlobalRows, eval_rows, make_options, make_trainer

# What makes two DeepSpeed files of other projects the same kind of run (one step runs per kind)
TEMPLATE_KIND = ("stage", "offload", "precision", "dims", "lr_schedule")


def _losses(tr) -> list[float | None]:
    return [r["loss"] for r in tr.history]


def worker(mode: str, out: str) -> None:
    from dstrain import dist

    info = dist.init_distributed()
    res: dict[str, Any] = {}
    common = (
        "--micro_batch_size 2 --max_steps 6 --clip_grad 0.5 --save_every 3 --keep_last 0 --precision fp32"
    )

    def opts_for(args: str):
        return make_options(args.split())

    if mode == "main":
        for stage in (1, 2, 3):
            base, args = f"{out}/z{stage}", f"--config zero{stage} {common}"
            tr = make_trainer(opts_for(args), f"{base}/straight", info)
            tr.run()
            res[f"z{stage}_straight"] = tr.history
            res[f"z{stage}_bias"] = [r.e_score_correction_bias.tolist() for r in tr.model.routers()]
            step3 = f"{base}/straight/checkpoints/step_00000003"
            # N + resume + N, from the straight run's step-3 checkpoint into a fresh folder
            tr = make_trainer(opts_for(args), f"{base}/resumed", info, resume=step3)
            tr.run()
            res[f"z{stage}_resumed"] = _losses(tr)
            # resumed twice: 3 -> 4 (saved, as if interrupted) -> 6
            tr = make_trainer(opts_for(args), f"{base}/twice", info, resume=step3)
            tr.run(until=4)
            first = _losses(tr)
            tr = make_trainer(opts_for(f"{args} --resume auto"), f"{base}/twice", info)
            tr.run()
            res[f"z{stage}_twice"] = first + _losses(tr)
        # ZeRO-3 evaluating after every step trains exactly as without: eval leaves the expert bias, the
        # step's loads and every RNG alone
        args = f"--config zero3 {common} --eval_split 0.5 --eval_every 1"
        tr = make_trainer(opts_for(args), f"{out}/z3_eval", info, eval_rows=eval_rows())
        tr.run()
        bias = [r.e_score_correction_bias.clone() for r in tr.model.routers()]
        load = tr.step_load.clone()
        again = tr.evaluate()
        untouched = all(torch.equal(a, r.e_score_correction_bias) for a, r in zip(bias, tr.model.routers()))
        res["z3_eval"] = {
            "losses": _losses(tr),
            "bias": [b.tolist() for b in bias],
            "evals": [e["step"] for e in tr.eval_history[:-1]],
            "repeat_equal": {k: v for k, v in again.items() if k != "eval_time_s"}
            == {k: v for k, v in tr.eval_history[-2].items() if k != "eval_time_s"},
            "untouched": untouched and torch.equal(load, tr.step_load),
        }
        # GA=2 x micro 2 vs GA=1 x micro 4 (global batch 8 over 2 ranks), ZeRO-2
        for name, mb, ga in (("ga2", 2, 2), ("ga1", 4, 1)):
            args = f"--config zero2 --micro_batch_size {mb} --gradient_accumulation_steps {ga} --max_steps 2"
            tr = make_trainer(opts_for(f"{args} --clip_grad 0.5 --save_every 0"), f"{out}/{name}", info)
            tr.run()
            res[name] = tr.history
        # ZeRO-3, rank 1 routes every token identically (most experts get nothing there): must not hang
        same = 7 if info.rank == 1 else None
        loader = GlobalRows(2, 1, info.rank, info.world_size, same_token=same)
        args = "--config zero3 --max_steps 2 --micro_batch_size 2 --save_every 0"
        tr = make_trainer(opts_for(args), f"{out}/z3skip", info, loader=loader)
        tr.run()
        probe = GlobalRows(2, 1, info.rank, info.world_size, same_token=same)
        with torch.no_grad():
            load = tr.engine(**next(probe)).expert_load
        res[f"z3skip_zero_experts_rank{info.rank}"] = int((load == 0).sum())
        res["z3skip_losses"] = _losses(tr)
        # bf16: trains, expert bias stays fp32 and identical on every rank
        for stage in (2, 3):
            args = f"--config zero{stage} --precision bf16 --max_steps 3 --micro_batch_size 2 --save_every 0"
            tr = make_trainer(opts_for(args), f"{out}/bf16_z{stage}", info)
            tr.run()
            biases = [r.e_score_correction_bias for r in tr.model.routers()]
            res[f"bf16_z{stage}"] = {
                "losses": _losses(tr),
                "bias_dtypes": sorted({str(b.dtype) for b in biases}),
                "param_dtype": str(next(tr.model.parameters()).dtype),
                f"bias_rank{info.rank}": [b.tolist() for b in biases],
            }
        # NaN: rank 1 alone sees a non-finite loss at step 2
        import dstrain.training.objective as objective_mod

        real = objective_mod.micro_loss
        state = {"tr": None}

        def poisoned(out_, n, scale, w):
            loss = real(out_, n, scale, w)
            if state["tr"].step == 1 and info.rank == 1:
                loss = loss * float("nan")
            return loss

        objective_mod.micro_loss = poisoned
        for policy in ("stop", "skip"):
            args = f"--config zero1 --max_steps 3 --micro_batch_size 2 --save_every 0 --nan_policy {policy}"
            tr = make_trainer(opts_for(args), f"{out}/nan_{policy}", info)
            state["tr"] = tr
            history, sums, error = [], [], None
            try:
                for _ in range(3):
                    history.append(tr.train_step())
                    sums.append(float(sum(p.double().sum() for p in tr.model.parameters())))
            except Exception as exc:  # noqa: BLE001 - recorded for the test to assert on
                error = f"{type(exc).__name__}: {exc}"
            res[f"nan_{policy}"] = {"history": history, "param_sums": sums, "error": error}
        objective_mod.micro_loss = real
    elif mode == "compile":
        # --compile in each layout: 20 steps against the same run eager (ZeRO-2, with activation
        # checkpointing), 4 steps elsewhere (against the one-process reference, in the test)
        runs = {
            "eager_z2": "--config zero2 --max_steps 20",
            "compiled_z2": "--config zero2 --max_steps 20 --compile --activation_checkpointing",
            "compiled_z3": "--config zero3 --max_steps 4 --compile",
            "compiled_pp2": "--config zero1 --pp 2 --max_steps 4 --compile --activation_checkpointing mlp",
            "compiled_tp2": "--config zero1 --tp 2 --max_steps 4 --compile --activation_checkpointing attention",
            "compiled_ep2": "--config zero2 --ep 2 --max_steps 4 --compile --activation_checkpointing mlp",
        }
        for name, flags in runs.items():
            args = f"{flags} --micro_batch_size 2 --save_every 0 --clip_grad 0.5 --precision fp32"
            tr = make_trainer(opts_for(args), f"{out}/{name}", info)
            tr.run()
            res[name] = [{"loss": r["loss"], "grad_norm": r["grad_norm"]} for r in tr.history]
    elif mode == "templates":
        # Other projects' DeepSpeed files as users bring them (tests/config/ds_templates): each resolved (and
        # read by DeepSpeed's config parser), or a one-line refusal; 1 step on the defaults for the first file
        # of each kind of run (stage, offload, precision, layout, schedule): the others resolve to the same
        from deepspeed.runtime.config import DeepSpeedConfig

        from dstrain.config.plan import prepare
        from dstrain.errors import ConfigError

        kinds: set[tuple] = set()
        for path in sorted(Path(ROOT, "tests", "config", "ds_templates").glob("*.json")):
            opts = opts_for(f"--config {path} --max_steps 1 --save_every 0")
            try:
                plan = prepare(opts, info.world_size, model=tiny_config())
            except ConfigError as exc:
                res[path.stem] = {"refused": str(exc)}
                continue
            got = {
                "loss": None,
                "stage": plan.stage,
                "dims": plan.dims.describe(),
                "offload": plan.offload,
                "precision": plan.precision,
                "train_batch_size": plan.ds["train_batch_size"],
                "lr_schedule": plan.opts.schedule.lr_schedule,
            }
            kind = tuple(got[k] for k in TEMPLATE_KIND)
            if kind not in kinds:
                kinds.add(kind)
                tr = make_trainer(opts, f"{out}/{path.stem}", info)
                tr.run()
                got["loss"] = tr.history[-1]["loss"]
            else:  # what deepspeed.initialize would parse first
                DeepSpeedConfig(plan.ds)
            res[path.stem] = got
    elif mode == "kill":
        tr = make_trainer(opts_for(f"--config zero1 {common} --resume auto"), f"{out}/killed", info)
        res["start_step"] = tr.step
        tr.run()
        res["losses"] = _losses(tr)
    if info.rank == 0 or mode == "main":
        with open(f"{out}/result_{mode}_rank{info.rank}.json", "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    from dstrain import dist

    try:
        worker(sys.argv[1], sys.argv[2])
    finally:
        dist.shutdown()
    dist.finish()
