"""Multi-rank trainer scenarios for tests/training/ and tests/config/, run in the test session's pool of ranks
(tests/helpers/pool.py): ZeRO 1/2/3 with resumes, evaluation, GA splits, idle experts, bf16, the NaN policies,
--compile in each layout, other projects' DeepSpeed files, LoRA under ZeRO-3, the host syncs of a step (1
rank), the indexers' gradient factor on padded rows (1 rank), and the run continued after a killed save. `python -m torch.distributed.run --nproc_per_node 2 -m tests.training.worker kill OUT` is the run
whose rank 1 kills itself during a save (DSTRAIN_TEST_KILL_DURING_SAVE): it needs processes of its own."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from tests.helpers.compile_turns import share_compiles
from tests.helpers.tiny import ROOT
from tests.helpers.trainer import GlobalRows, eval_rows, make_options, make_trainer

# What makes two DeepSpeed files of other projects the same kind of run (one step runs per kind)
TEMPLATE_KIND = ("stage", "offload", "precision", "dims", "lr_schedule")
COMMON = "--micro_batch_size 2 --max_steps 6 --clip_grad 0.5 --save_every 3 --keep_last 0 --precision fp32"


def _losses(tr) -> list[float | None]:  # noqa: ANN001
    return [r["loss"] for r in tr.history]


def _opts(args: str):  # noqa: ANN202
    return make_options(args.split())


def zero_runs(info, out: str, stage: int) -> dict[str, Any]:  # noqa: ANN001
    """ZeRO-`stage` 6 steps straight (saving at 3 and 6), resumed from step 3 into a fresh folder, and resumed
    twice (3 -> 4, saved as if interrupted, then --resume auto -> 6) -> this rank's histories and expert bias."""
    base, args = f"{out}/z{stage}", f"--config zero{stage} {COMMON}"
    tr = make_trainer(_opts(args), f"{base}/straight", info)
    tr.run()
    res: dict[str, Any] = {
        "straight": tr.history,
        "bias": [r.e_score_correction_bias.tolist() for r in tr.model.routers()],
    }
    step3 = f"{base}/straight/checkpoints/step_00000003"
    tr = make_trainer(_opts(args), f"{base}/resumed", info, resume=step3)
    tr.run()
    res["resumed"] = _losses(tr)
    tr = make_trainer(_opts(args), f"{base}/twice", info, resume=step3)
    tr.run(until=4)
    first = _losses(tr)
    tr = make_trainer(_opts(f"{args} --resume auto"), f"{base}/twice", info)
    tr.run()
    res["twice"] = first + _losses(tr)
    return res


def evaluated_every_step(info, out: str) -> dict[str, Any]:  # noqa: ANN001
    """ZeRO-3 evaluating after every step: its losses and bias, whether an evaluation left the expert bias and
    the step's loads alone, and whether evaluating again gives the same figures."""
    tr = make_trainer(
        _opts(f"--config zero3 {COMMON} --eval_split 0.5 --eval_every 1"),
        f"{out}/z3_eval",
        info,
        eval_rows=eval_rows(),
    )
    tr.run()
    bias = [r.e_score_correction_bias.clone() for r in tr.model.routers()]
    load = tr.step_load.clone()
    again = tr.evaluate()
    untouched = all(torch.equal(a, r.e_score_correction_bias) for a, r in zip(bias, tr.model.routers()))
    return {
        "losses": _losses(tr),
        "bias": [b.tolist() for b in bias],
        "evals": [e["step"] for e in tr.eval_history[:-1]],
        "repeat_equal": {k: v for k, v in again.items() if k != "eval_time_s"}
        == {k: v for k, v in tr.eval_history[-2].items() if k != "eval_time_s"},
        "untouched": untouched and torch.equal(load, tr.step_load),
    }


def ga_split(info, out: str) -> dict[str, Any]:  # noqa: ANN001
    """GA=2 x micro 2 and GA=1 x micro 4 (global batch 8 over 2 ranks), ZeRO-2, 2 steps each."""
    res = {}
    for name, mb, ga in (("ga2", 2, 2), ("ga1", 4, 1)):
        args = f"--config zero2 --micro_batch_size {mb} --gradient_accumulation_steps {ga} --max_steps 2"
        tr = make_trainer(_opts(f"{args} --clip_grad 0.5 --save_every 0"), f"{out}/{name}", info)
        tr.run()
        res[name] = tr.history
    return res


class _PaddedRows(GlobalRows):
    """GlobalRows whose row r of each micro batch ends in 5 + r padding positions (PAD_POSITION, no target)."""

    def __next__(self) -> dict[str, torch.Tensor]:
        from dstrain.batch import IGNORE_INDEX, PAD_POSITION

        batch = super().__next__()
        pos = batch["position_ids"].clone()
        for r in range(pos.shape[0]):
            pos[r, -(5 + r) :] = PAD_POSITION
        return {
            **batch,
            "position_ids": pos,
            "labels": batch["labels"].masked_fill(pos == PAD_POSITION, IGNORE_INDEX),
        }


def dsa_grad_scale(info, out: str) -> dict[str, float]:  # noqa: ANN001
    """One step of the tiny DSA model (sparse stage, 2 micro batches) on rows that end in padding -> the factor
    the indexers' KL gradient got, the coefficient, and the step's positions and those that hold a token."""
    from tests.helpers.tiny import tiny_dsa_config

    loader = _PaddedRows(2, 2, info.rank, info.world_size)
    args = "--config zero1 --micro_batch_size 2 --gradient_accumulation_steps 2 --max_steps 1 --save_every 0"
    args += " --dsa_stage sparse --indexer_loss_coef 0.5"
    tr = make_trainer(_opts(args), f"{out}/dsa", info, cfg=tiny_dsa_config(), loader=loader)
    probe = _PaddedRows(2, 2, info.rank, info.world_size)
    rows = [next(probe) for _ in range(2)]
    rec = tr.train_step()
    (scale,) = {float(s.grad_scale) for s in tr.model.sparse_settings()}
    return {
        "scale": scale,
        "coef": tr.opts.model.indexer_loss_coef,
        "positions": sum(r["position_ids"].numel() for r in rows) * info.world_size,
        "real": sum(int((r["position_ids"] >= 0).sum()) for r in rows) * info.world_size,
        "indexer_loss": rec["indexer_loss"],
    }


def idle_experts(info, out: str) -> dict[str, Any]:  # noqa: ANN001
    """ZeRO-3 where rank 1 routes every token identically (most experts get nothing there): must not hang."""
    same = 7 if info.rank == 1 else None
    loader = GlobalRows(2, 1, info.rank, info.world_size, same_token=same)
    args = "--config zero3 --max_steps 2 --micro_batch_size 2 --save_every 0"
    tr = make_trainer(_opts(args), f"{out}/z3skip", info, loader=loader)
    tr.run()
    probe = GlobalRows(2, 1, info.rank, info.world_size, same_token=same)
    with torch.no_grad():
        load = tr.engine(**next(probe)).expert_load
    return {"zero_experts": int((load == 0).sum()), "losses": _losses(tr)}


def bf16_run(info, out: str, stage: int) -> dict[str, Any]:  # noqa: ANN001
    """bf16 under ZeRO-`stage`, 3 steps: losses, the dtypes, this rank's expert bias."""
    args = f"--config zero{stage} --precision bf16 --max_steps 3 --micro_batch_size 2 --save_every 0"
    tr = make_trainer(_opts(args), f"{out}/bf16_z{stage}", info)
    tr.run()
    biases = [r.e_score_correction_bias for r in tr.model.routers()]
    return {
        "losses": _losses(tr),
        "bias_dtypes": sorted({str(b.dtype) for b in biases}),
        "param_dtype": str(next(tr.model.parameters()).dtype),
        "bias": [b.tolist() for b in biases],
    }


def nan_policies(info, out: str) -> dict[str, Any]:  # noqa: ANN001
    """Rank 1 alone sees a non-finite loss at step 2, under --nan_policy stop and skip."""
    import dstrain.training.objective as objective_mod

    real = objective_mod.micro_loss
    state = {"tr": None}

    def poisoned(out_, n, scale, w):  # noqa: ANN001, ANN202
        loss = real(out_, n, scale, w)
        if state["tr"].step == 1 and info.rank == 1:
            loss = loss * float("nan")
        return loss

    res = {}
    objective_mod.micro_loss = poisoned
    try:
        for policy in ("stop", "skip"):
            args = f"--config zero1 --max_steps 3 --micro_batch_size 2 --save_every 0 --nan_policy {policy}"
            tr = make_trainer(_opts(args), f"{out}/nan_{policy}", info)
            state["tr"] = tr
            history, sums, error = [], [], None
            try:
                for _ in range(3):
                    history.append(tr.train_step())
                    sums.append(float(sum(p.double().sum() for p in tr.model.parameters())))
            except Exception as exc:  # noqa: BLE001 - recorded for the test to assert on
                error = f"{type(exc).__name__}: {exc}"
            res[policy] = {"history": history, "param_sums": sums, "error": error}
    finally:
        objective_mod.micro_loss = real
    return res


# --compile in each layout: 20 steps against the same run eager (ZeRO-2, with activation checkpointing), 4 steps
# elsewhere (against the one-process reference, in the test)
COMPILED = {
    "eager_z2": "--config zero2 --max_steps 20",
    "compiled_z2": "--config zero2 --max_steps 20 --compile --activation_checkpointing",
    "compiled_z3": "--config zero3 --max_steps 4 --compile",
    "compiled_pp2": "--config zero1 --pp 2 --max_steps 4 --compile --activation_checkpointing mlp",
    "compiled_tp2": "--config zero1 --tp 2 --max_steps 4 --compile --activation_checkpointing attention",
    "compiled_ep2": "--config zero2 --ep 2 --max_steps 4 --compile --activation_checkpointing mlp",
}


def compiled(info, out: str, name: str) -> list[dict[str, float]]:  # noqa: ANN001
    share_compiles()  # the ranks compile each graph they have in common once (tests/helpers/compile_turns.py)
    args = f"{COMPILED[name]} --micro_batch_size 2 --save_every 0 --clip_grad 0.5 --precision fp32"
    tr = make_trainer(_opts(args), f"{out}/{name}", info)
    tr.run()
    return [{"loss": r["loss"], "grad_norm": r["grad_norm"]} for r in tr.history]


def templates(info, out: str) -> dict[str, Any]:  # noqa: ANN001
    """Other projects' DeepSpeed files as users bring them (tests/config/ds_templates): each resolved (and read by
    DeepSpeed's config parser), or a one-line refusal; 1 step on the defaults for the first file of each kind of
    run (stage, offload, precision, layout, schedule): the others resolve to the same."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from dstrain.config.plan import prepare
    from dstrain.errors import ConfigError
    from tests.helpers.tiny import tiny_config

    res: dict[str, Any] = {}
    kinds: set[tuple] = set()
    for path in sorted(Path(ROOT, "tests", "config", "ds_templates").glob("*.json")):
        opts = _opts(f"--config {path} --max_steps 1 --save_every 0")
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
            opt = tr.engine.basic_optimizer  # the torch optimizer inside DeepSpeed's ZeRO wrapper
            got["optimizer"] = [f"{type(opt).__module__}.{type(opt).__name__}", opt.defaults.get("fused")]
        else:  # what deepspeed.initialize would parse first
            DeepSpeedConfig(plan.ds)
        res[path.stem] = got
    return res


def zero3_lora(info, out: str) -> dict[str, Any]:  # noqa: ANN001
    """LoRA under ZeRO-3, 4 steps on one repeated token (the adapters alone must lower the loss whatever their
    initial values): which parameters changed, which train, the losses."""
    import deepspeed

    args = "--config zero3 --micro_batch_size 2 --max_steps 4 --save_every 0 --lr 1e-2 --lora_r 4"
    opts = make_options([*args.split(), "--no-train_router", "--no-train_mtp"])
    loader = GlobalRows(2, 1, info.rank, info.world_size, same_token=7)
    tr = make_trainer(opts, f"{out}/run", info, loader=loader)
    params = dict(tr.model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        start = {n: p.detach().clone() for n, p in params.items()}
    tr.run()
    with deepspeed.zero.GatheredParameters(list(params.values())):
        changed = sorted(n for n, p in params.items() if not torch.equal(p.detach(), start[n]))
    adapters = sorted(n for n, p in params.items() if p.requires_grad)
    return {"changed": changed, "adapters": adapters, "losses": [r["loss"] for r in tr.history]}


def cli_run(info, argv: list[str]) -> int:  # noqa: ANN001
    """`dstrain train ARGV` on the pool's ranks (their process group already there): the command's run of its
    resolved plan -> its exit code."""
    from dstrain.config.options import parse_options
    from dstrain.config.plan import prepare
    from dstrain.training.cli import train

    return train(prepare(parse_options(argv)))


def cli_out(info, argv: list[str]) -> dict[str, Any]:  # noqa: ANN001
    """`dstrain train ARGV` under the command line's error policy (a user's mistake: its one line on stderr and
    the exit code), with its output captured -> {"rc", "stdout", "stderr"}: what a `python dstrain/train.py`
    process would have printed, without starting one (tests/helpers/runs.py). The process group stays."""
    import contextlib
    import io

    from dstrain.cli import invoke
    from dstrain.config.options import parse_options
    from dstrain.config.plan import prepare
    from dstrain.training.cli import train

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = invoke(parse_options, lambda opts: train(prepare(opts)), argv)
    return {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}


def killed_run(info, out: str) -> dict[str, Any]:  # noqa: ANN001
    """ZeRO-1 with --resume auto into OUT/killed: where it started, its losses."""
    tr = make_trainer(_opts(f"--config zero1 {COMMON} --resume auto"), f"{out}/killed", info)
    start = tr.step
    tr.run()
    return {"start_step": start, "losses": _losses(tr)}


if __name__ == "__main__":  # the killed run, in processes of its own
    from dstrain import dist

    try:
        assert sys.argv[1] == "kill", sys.argv
        killed_run(dist.init_distributed(), sys.argv[2])
    finally:
        dist.shutdown()
    dist.finish()


def host_syncs(info, out: str, steps: int) -> dict[str, Any]:  # noqa: ANN001
    """`steps` optimizer steps of the tiny model (ZeRO-1, 2 micro batches a step) under the CUDA kernel policy
    after a first one, the run loop's preemption check included, counting host syncs (tests/helpers/syncs.py)
    -> the calls from dstrain's code and from DeepSpeed's, and the steps' records."""
    import dstrain.model.common.kernels as kernels
    from tests.helpers.syncs import HostSyncs

    policy = kernels.KERNEL_POLICY
    kernels.KERNEL_POLICY = "cuda"
    try:
        args = (
            "--config zero1 --precision bf16 --micro_batch_size 2 --gradient_accumulation_steps 2 --save_every 0 "
            "--max_steps 99"
        )
        tr = make_trainer(_opts(args), f"{out}/syncs", info)
        run = tr._open_run()
        try:
            tr._log(run, tr._step(run), 99)
            with HostSyncs() as syncs:
                for _ in range(steps):
                    tr.step_preemption = run.preemption  # as run() does for a step without a save or an eval
                    rec = tr._step(run)
                    tr._log(run, rec, 99)
                    run.preemption.should_stop(rec["step_time_s"])
        finally:
            run.close()
    finally:
        kernels.KERNEL_POLICY = policy
    return {
        "dstrain": [list(c) for c in syncs.calls if c[1].startswith("dstrain/")],
        "deepspeed": [list(c) for c in syncs.calls if c[1].startswith("deepspeed/")],
        "other": [list(c) for c in syncs.calls if not c[1].startswith(("dstrain/", "deepspeed/"))],
        "history": tr.history,
    }


def dpo_run(info, out: str, name: str, args: str, cycle: int = 0) -> list[dict[str, Any]]:  # noqa: ANN001
    """--objective dpo with LoRA on the tiny model, on learnable pair rows (tests.helpers.pairs; `cycle` rows
    repeated) -> the history."""
    return _dpo_trainer(info, out, name, args, cycle).history


def dpo_eval_run(info, out: str, name: str, args: str) -> dict[str, Any]:  # noqa: ANN001
    """dpo_run evaluating pair rows (tests.helpers.pairs.pair_eval_rows) at its end -> the eval history and,
    on one process, the file of the trained weights (torch.save)."""
    from tests.helpers.pairs import pair_eval_rows

    tr = _dpo_trainer(info, out, name, args, eval_rows=pair_eval_rows())
    weights = None
    if info.world_size == 1:
        weights = f"{out}/{name}/weights.pt"
        torch.save(tr.model.state_dict(), weights)
    return {"eval": tr.eval_history, "weights": weights}


def dpo_full_run(info, out: str, name: str, args: str, resume: str | None = None) -> dict[str, Any]:  # noqa: ANN001
    """--objective dpo fine-tuning every weight (the precomputed reference), optionally resumed from a checkpoint
    -> the history and the checkpoints' paths."""
    tr = _dpo_trainer(info, out, name, f"--lr 1e-3 {args}", lora=False, resume=resume)
    root = Path(out) / name / "checkpoints"
    return {"history": tr.history, "checkpoints": sorted(str(p) for p in root.glob("step_*"))}


def dpo_v4_run(
    info, out: str, name: str, args: str, cycle: int = 0, model: str = "v4"
) -> list[dict[str, Any]]:  # noqa: ANN001
    """dpo_full_run's DPO (every weight, the precomputed reference, unless `args` asks for adapters) on the tiny
    DeepSeek-V4 (`model` "v4"), Kimi Linear ("kimi") or GLM-5.3-Flash ("glm5n"), over `cycle` rows repeated as dpo_run's -> the history."""
    from tests.helpers.tiny import tiny_glm5_next_config, tiny_kimi_linear_config, tiny_v4_config

    cfg = {"v4": tiny_v4_config, "kimi": tiny_kimi_linear_config, "glm5n": tiny_glm5_next_config}[model]()
    tr = _dpo_trainer(info, out, name, f"--lr 1e-3 {args}", cycle, lora=False, cfg=cfg)
    return tr.history


def dpo_data_run(info, out: str, data: str, steps: int) -> dict[str, Any]:  # noqa: ANN001
    """Full fine-tune DPO on a preference jsonl through the data package's loader (byte tokenizer, chat
    template) -> the history and the reference table's size."""
    from tests.helpers.tiny import byte_tokenizer, tiny_config

    flags = (
        f"--config zero1 --data {data} --num_workers 0 --shuffle_buffer 8 --pack_buffer 4 --micro_batch_size 2 --seq_len 128 "
        f"--max_steps {steps} --objective dpo --lr 1e-3 --save_every 0 --precision fp32"
    )
    opts = make_options(flags.split())
    cfg = tiny_config(vocab_size=272)  # the byte tokenizer's specials too
    tr = make_trainer(opts, f"{out}/data", info, cfg=cfg, tokenizer=byte_tokenizer())
    tr.run()
    return {"history": tr.history, "table": len(tr.dpo.table)}


def _dpo_trainer(info, out: str, name: str, args: str, cycle: int = 0, eval_rows=None, lora: bool = True,  # noqa: ANN001, ANN202
                 resume: str | None = None, cfg=None):  # fmt: skip
    from dstrain.parallel import ParallelDims
    from tests.helpers.pairs import PairRows

    adapters = "--lora_r 8 --lora_alpha 16 --lora_targets q_b_proj,kv_b_proj,o_proj,shared_experts,experts"
    flags = f"--lr 1e-2 --save_every 0 {args} --objective dpo {adapters if lora else ''} --precision fp32"
    opts = _opts(flags)
    layout = opts.layout
    # ranks of one sequence-, tensor- or pipeline-parallel group read the same rows
    sizes = {k: getattr(layout, k) or 1 for k in ("pp", "tp", "ep", "sp")}
    dims = ParallelDims(info.world_size, **sizes)
    data_rank, _ = dims.data_coords(info.rank)
    loader = PairRows(
        layout.micro_batch_size, layout.gradient_accumulation_steps, data_rank, dims.data, cycle
    )
    tr = make_trainer(opts, f"{out}/{name}", info, cfg=cfg, loader=loader, eval_rows=eval_rows, resume=resume)
    tr.run()
    return tr
