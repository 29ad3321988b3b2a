"""The training loop: DeepSpeed engine, global-batch loss normalisation, expert-bias balancing, NaN policy,
checkpoints with exact resume, evaluation, metrics, profiler traces and plots."""

from __future__ import annotations

import logging
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist

from dstrain import collector, dist
from dstrain.batch import host_to_device, sequence_halo, sequence_shard, to_device
from dstrain.checkpoint import store
from dstrain.checkpoint.reshard import optimizer_progress
from dstrain.config.plan import RunPlan
from dstrain.dist import DistInfo
from dstrain.errors import CheckpointError, ConfigError, NonFiniteLossError
from dstrain.model import combine_losses
from dstrain.model.registry import model_class

from . import objective, optimizer, reference, watchdog
from .build import build_for_training
from .collapse import CollapseWatch
from .dpo import DPO
from .evaluate import Evaluator, eval_line, local_batches
from .metrics import Display, MetricsSink, Profiler, RunLog, device_peak_tflops, finite_or_none
from .objective import LossWeights, StepStats, count_targets, read_once
from .preempt import Preemption
from .schedule import make_scheduler_factory

log = logging.getLogger("dstrain.train")


class Trainer:
    """One run of `plan` on this rank: setup() builds the loader, the model and the DeepSpeed engine (and
    resumes), run() trains to max_steps, saving and logging."""

    def __init__(
        self,
        plan: RunPlan,
        info: DistInfo,
        *,
        loader: Any = None,
        tokenizer: Any = None,
        eval_rows: dict[str, torch.Tensor] | None = None,
        resume_path: str | None = None,
        verbose: bool = True,
    ) -> None:
        """`loader` / `eval_rows` replace the ones --data / --eval_data would build (tests)."""
        assert plan.output_dir is not None, "plan.with_output_dir(...) first"
        self.plan, self.opts, self.info = plan, plan.opts, info
        self.cfg, self.dims = plan.model, plan.dims
        self.output_dir = plan.output_dir
        self.loader, self.tokenizer = loader, tokenizer
        self.eval_rows = eval_rows
        self.evaluator: Evaluator | None = None
        self.resume_path = resume_path
        self.verbose = verbose and info.is_main
        self.step = 0
        self.tokens = 0
        self.target_tokens = 0
        self.wandb_run_id: str | None = None
        self.history: list[dict[str, Any]] = []
        self.eval_history: list[dict[str, Any]] = []
        self.step_load: torch.Tensor | None = None  # the last step's global expert loads (MoE layers, E)
        self.collapse = CollapseWatch(plan.model.n_routed_experts, plan.model.num_experts_per_tok)
        self.ga = plan.opts.layout.gradient_accumulation_steps
        self._stage0_norm = 0.0
        self.step_preemption: Preemption | None = None  # set by run() for a step that checks it in its read
        _, _, self.tp_rank = self.dims.coords(info.rank)
        self.data_rank, self.sp_rank = self.dims.data_coords(info.rank)  # sequence-parallel ranks share data
        self.groups: Any = None
        self.load_stats: dict[str, Any] = {}
        self.pipe = self.dims.pp > 1
        self.mtp_depth = int(self.cfg.num_nextn_predict_layers)
        self.weights = LossWeights.of(self.cfg)
        # micro_loss's `scale`: undoes DeepSpeed's 1/GA and its average over data-parallel ranks
        self.scale = float(self.ga * self.dims.dp)
        # --objective dpo: the loss of preference pairs (dpo.py) in place of the targets' mean cross-entropy
        # a stored base (--base_precision stored): checkpoints hold no copy of it, resuming reads this folder
        self.base = None
        if plan.stored_base:
            from dstrain.model.hf import folder_identity

            folder = os.path.abspath(plan.model_folder)
            self.base = {"folder": folder, "identity": folder_identity(folder)}
        self.dpo = (
            DPO(plan.opts.objective, self.scale, self.weights, self.sp_rank, self.tp_rank)
            if plan.opts.objective.objective == "dpo"
            else None
        )

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        # torch.optim imports torch._dynamo at the first optimizer; not frozen (Triton: see collector.py)
        with collector.paused():
            import deepspeed
            import torch._dynamo  # noqa: F401

        opts = self.opts
        if self.loader is None:  # first: a data error surfaces before the model is built
            self.loader = self._build_loader()
        if self.eval_rows is None and opts.data.evaluates:
            from dstrain.data import build_eval_rows

            self.eval_rows = build_eval_rows(opts.data, self._tokenizer(), opts.objective.objective)
        if self.eval_rows is not None:
            micro = opts.layout.micro_batch_size
            rows, pairs = local_batches(self.eval_rows, micro, self.data_rank, self.dims.data), None
            if self.dpo is not None:  # documents numbered on whole rows, as a step's
                rows, pairs = self.dpo.number(rows)
            batches, weights = [self._shard(b) for b in rows], self._stat_weights()
            self.evaluator = Evaluator(batches, self.mtp_depth, self.info.device, *weights, self.dpo, pairs)
        seed_everything(opts.run.seed, self.info.rank)
        # DeepSpeed keeps the last engine's grid in a module global; a data-parallel engine must not see it.
        deepspeed.utils.groups.mpu = None
        built = build_for_training(self.plan, self.info.rank, self.info.device, self._pipe_objective)
        model, module, mpu = built.model, built.module, built.mpu
        self.groups, self.load_stats = built.groups, built.load
        model.set_activation_checkpointing(opts.model.activation_checkpointing)
        if self.cfg.sparse_attention:
            model.set_sparse_attention(opts.model.dsa_stage)
        if opts.model.compile:
            if self.pipe:
                # DeepSpeed's pipeline runs backward from each stage output with retain_graph=True, which
                # backward graphs compiled with donated buffers refuse.
                torch._functorch.config.donated_buffer = False
            model.compile_blocks()
        model.train()
        choice = optimizer.choose(self.plan, model, module)
        self._show_optimizer_table(choice.table)
        self.engine = optimizer.initialize(
            choice,
            module,
            lr_scheduler=make_scheduler_factory(opts.schedule),
            mpu=None if self.pipe else mpu,
            dist_init_required=False,
        )
        if self.dims.model_parallel:
            from dstrain.parallel.gradnorm import install_global_grad_norm

            install_global_grad_norm(self.engine, self.groups)
        if self.plan.stage == 0 and self.plan.precision == "fp32":
            self._clip_with_the_exact_norm()
        self.model = model
        store.install_safe_loading(self.engine)
        if self.dpo is not None and self.dpo.precomputed:  # before the checkpoint: extending it needs the
            self.dpo.table = reference.open_table(self)  # initial model, which the engine holds until then
        if self.resume_path is not None:
            self._resume(self.resume_path)

    def _show_optimizer_table(self, table: str | None) -> None:
        """Which optimizer steps each parameter (Muon runs only): printed, and written to the run folder."""
        if table is None or not self.info.is_main:
            return
        from dstrain.atomic import write_atomic

        os.makedirs(self.output_dir, exist_ok=True)
        write_atomic(os.path.join(self.output_dir, optimizer.TABLE_FILE), table + "\n")
        if self.verbose:
            print(f"dstrain: optimizer groups\n{table}", flush=True)

    def _pipe_objective(self, out: Any, n_global: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        if self.dpo is not None:  # extra: each target's document
            return self.dpo.pipe_loss(out, n_global, *extra)
        return objective.micro_loss(out, n_global, self.scale, self.weights)

    def _tokenizer(self) -> Any:
        if self.tokenizer is None:
            from dstrain.data import load_tokenizer

            model = self.opts.model.model
            tok = load_tokenizer(self.opts.data.tokenizer, model_path=self.plan.model_folder)
            if len(tok) > self.cfg.vocab_size:
                raise ConfigError(
                    f"tokenizer has {len(tok)} tokens but model {model} has vocab_size {self.cfg.vocab_size}"
                )
            self.tokenizer = tok
        return self.tokenizer

    def _build_loader(self) -> Any:
        from dstrain.data import build_loader

        return build_loader(
            self.opts.data,
            self._tokenizer(),
            self.opts.layout.micro_batch_size,
            dp_rank=self.data_rank,
            dp_world=self.dims.data,
            seed=self.opts.run.seed,
            objective=self.opts.objective.objective,
        )

    def _shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's sequence-parallel slice of a batch (the batch itself without --sp)."""
        if self.dims.sp == 1:
            return batch
        return sequence_shard(batch, self.sp_rank, self.dims.sp, sequence_halo(self.mtp_depth))

    def layout(self) -> dict[str, Any]:
        return store.layout_record(self.dims, self.plan.stage, self.plan.precision)

    def _resume(self, path: str) -> None:
        from pathlib import Path

        optimizer.check_resume(Path(path), self.opts.optimizer.optimizer)
        saved_base = store.read_state(Path(path), 0).get("base")
        if saved_base is not None:
            store.check_base(saved_base, f"resuming {path}")
            if self.base is None or self.base["identity"] != saved_base["identity"]:
                raise CheckpointError(
                    f"resuming {path}: it trained LoRA on the stored base {saved_base['folder']}; run with "
                    "--model set to that folder (and --base_precision stored)"
                )
        state = store.load(self.engine, Path(path), self.info.rank, self.layout(), self.model)
        resharded = state.get("resharded")
        if self.dims.model_parallel and not resharded:
            from dstrain.checkpoint.weights import load_local_weights

            load_local_weights(self.model, Path(path))
        self.step = int(state["step"])
        self.tokens = int(state["tokens"])
        self.target_tokens = int(state["target_tokens"])
        self.wandb_run_id = state.get("wandb_run_id")
        if hasattr(self.loader, "load_state_dict"):
            if resharded:
                from dstrain.data import merge_states

                saved = [s for s in state["loaders"] if s is not None]
                if saved:
                    self.loader.load_state_dict(merge_states(saved))
            elif state.get("loader") is not None:
                self.loader.load_state_dict(state["loader"])
        if "rng" in state:  # a rank the saving run did not have keeps its fresh seed
            store.set_rng_state(state["rng"])
        if self.engine.global_steps != self.step:
            raise CheckpointError(
                f"checkpoint {path}: DeepSpeed is at step {self.engine.global_steps}, dstrain at {self.step}"
            )
        if resharded and self.verbose:
            print(
                f"dstrain: resumed step {self.step} of {path} on another layout: saved "
                f"{store.describe_layout(resharded)}, now {store.describe_layout(self.layout())} "
                "(weights, AdamW moments, schedule and data position re-sharded)",
                flush=True,
            )

    # ------------------------------------------------------------------ one optimizer step
    def train_step(self) -> dict[str, Any]:
        step = self.step + 1
        t0 = time.perf_counter()
        dev = self.info.device
        batches = [next(self.loader) for _ in range(self.ga)]
        seq_len = int(batches[0]["input_ids"].shape[1])
        if self.dpo is not None:  # documents numbered on whole rows (sharded with them), pairs counted
            batches = self.dpo.begin_step(batches, self._dp_sum, dev)
        batches = [self._shard(b) for b in batches]
        halo = sequence_halo(self.mtp_depth) if self.dims.sp > 1 else 0
        local_counts = torch.stack([count_targets(b, self.mtp_depth, halo) for b in batches]).sum(0)
        dsa = self.cfg.sparse_attention
        counts = local_counts
        if dsa:  # and the step's queries that hold a token, in the same reduction
            queries = torch.stack([objective.count_queries(b, halo) for b in batches]).sum()
            counts = torch.cat([local_counts, queries.view(1)])
        n_global = self._dp_sum(host_to_device(counts.to(torch.float64), dev)).to(torch.float32)
        lr = float(self.engine.get_lr()[0])
        # Ranks holding a copy of another's numbers (tensor-parallel peers) count them with weight 0.
        stats = StepStats(self.mtp_depth, dev, *self._stat_weights())
        if dsa:
            # The indexers' KL: a mean over the step's real queries (as its logged figure: padding is in no KL),
            # times the coefficient; the injected gradient sees neither DeepSpeed's 1 / GA nor the loss. A
            # device tensor: no host sync.
            n_global, queries = n_global[:-1], n_global[-1].clamp(min=1)
            coef = self.opts.model.indexer_loss_coef
            self.model.set_indexer_grad_scale(coef * self.scale / self.ga / queries)
        run = self._pipe_batches if self.pipe else self._micro_batches
        bad, grad_norm = run(step, batches, n_global, stats)
        if grad_norm is None:
            grad_norm = self.engine.get_global_grad_norm()
        preemption, self.step_preemption = self.step_preemption, None
        stop = preemption.local_flags(time.perf_counter() - t0) if preemption is not None else None
        # One collective for every statistic (and the ranks' preemption flags); pipeline stages without the
        # loss send zeros.
        red = stats.all_reduced(self.model.moe_layer_ids, self.cfg.n_routed_experts, stop)
        g_load = red.load
        host = read_once(
            dev,
            bad=bad,
            counted=stats.counts if stats.seen else None,
            lm=red.lm,
            mtp=red.mtp,
            aux=red.aux,
            n=n_global,
            indexer=red.indexer,
            norm=grad_norm if isinstance(grad_norm, torch.Tensor) else None,
            imbalance=self._imbalance_ratios(g_load),
            stop=red.extra,
        )
        if stats.seen and host["counted"] != local_counts.numpy().tolist():  # numpy: the CPU batch's counts
            raise RuntimeError(
                f"step {step}: the model counted {host['counted']} targets, the trainer {local_counts.numpy()}"
            )
        flags, g_lm = host["bad"], host["lm"][0]
        skip = any(flags)
        if skip and self.opts.run.nan_policy == "stop":  # the update was dropped (see _micro_batches)
            raise NonFiniteLossError(
                f"step {step}: non-finite loss (micro batch {flags.index(1.0) + 1}/{self.ga}); stopped before the "
                "update (--nan_policy skip to skip such steps)"
            )
        if self.pipe and not math.isfinite(g_lm):
            skip = True
            if self.opts.run.nan_policy == "stop":
                raise NonFiniteLossError(
                    f"step {step}: non-finite loss (--nan_policy skip to skip such steps)"
                )
        if skip and self.engine.was_step_applied():
            raise RuntimeError(f"step {step}: DeepSpeed applied an update with non-finite gradients")
        if preemption is not None:
            preemption.agree(host["stop"])
        if g_load is not None and not skip:
            self.model.update_expert_bias(g_load.to(torch.float32))
        self.step_load = g_load
        n = [max(x, 1.0) for x in host["n"]]
        lm_loss = g_lm / n[0]
        mtp_loss = (
            sum(x / c for x, c in zip(host["mtp"], n[1:], strict=True)) / self.mtp_depth
            if self.mtp_depth
            else None
        )
        aux_loss = host["aux"][0] / self.scale
        total = combine_losses(lm_loss, mtp_loss, aux_loss, self.weights.alpha, self.weights.lam)
        if isinstance(grad_norm, torch.Tensor):
            grad_norm = host["norm"][0]
        step_tokens = self.plan.global_batch_rows * seq_len
        step_time = time.perf_counter() - t0
        self.step = step
        self.tokens += step_tokens
        self.target_tokens += int(host["n"][0])
        return {
            "step": step,
            "loss": finite_or_none(total),
            "lm_loss": finite_or_none(lm_loss),
            "mtp_loss": finite_or_none(mtp_loss),
            "aux_loss": finite_or_none(aux_loss),
            "lr": lr,
            "grad_norm": finite_or_none(float(grad_norm)) if grad_norm is not None else None,
            "tokens": self.tokens,
            "target_tokens": int(host["n"][0]),
            "skipped": skip,
            "step_time_s": step_time,
            "tokens_per_s": step_tokens / step_time,
            "seq_len": seq_len,
            "moe_imbalance": {
                f"layer_{i}": round(r, 4)
                for i, r in zip(self.model.moe_layer_ids, host["imbalance"], strict=False)
            },
            **red.indexer_figures(host["indexer"]),
            **(self.dpo.end_step(total - lm_loss) if self.dpo is not None else {}),
        }

    def _stat_weights(self) -> tuple[float, float]:
        """(weight of this rank's loss figures, of its indexer figures): tensor-parallel peers hold copies of
        both, sequence-parallel peers copies of the indexers' where those are computed for whole rows (DSA's;
        DeepSeek-V4's are each rank's own queries')."""
        first = 1.0 if self.tp_rank == 0 else 0.0
        per_slice = model_class(self.cfg).indexer_figures_per_slice
        return first, first if self.sp_rank == 0 or per_slice else 0.0

    def _dp_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel group (every rank of a pipeline / tensor-parallel group reads the same
        batches)."""
        if self.groups is None:
            return dist.all_reduce(x)
        if self.groups.dp is not None:
            tdist.all_reduce(x, group=self.groups.dp)
        return x

    def _micro_batches(self, step: int, batches: list, n_global: torch.Tensor, stats: StepStats) -> tuple:
        dev = self.info.device
        n_dev = n_global.to(dev)
        bad = torch.zeros(self.ga, device=dev)  # non-finite loss per micro batch, kept on the device
        grad_norm = None
        for i, batch in enumerate(batches):
            batch = to_device(batch, dev)
            if self.dpo is not None:
                out, loss = self.dpo.micro(self.engine, self.model, batch, i, n_dev)
            else:
                out = self.engine(
                    input_ids=batch["input_ids"],
                    position_ids=batch.get("position_ids"),
                    labels=batch["labels"],
                )
                loss = objective.micro_loss(out, n_dev, self.scale, self.weights)
            bad[i] = (~torch.isfinite(loss)).float()
            if i == self.ga - 1:
                # Decided on the device, read with the step's figures: a non-finite loss in any micro batch
                # of any rank makes the last loss NaN everywhere, whose NaN gradients make DeepSpeed's overflow
                # check drop this step's update on every rank (both policies: "stop" raises after it).
                bad = dist.all_reduce(bad, tdist.ReduceOp.MAX)
                loss = loss + torch.where(bad.any(), float("nan"), 0.0)
            stats.add(out)
            self.engine.backward(loss)
            if self.plan.stage == 0 and i == self.ga - 1:
                grad_norm = self._local_full_grad_norm()
            self.engine.step()
        return bad, grad_norm

    def _pipe_data(self, batches: list, n_global: torch.Tensor) -> list:
        """The pipeline's (inputs, labels) of each micro batch."""
        dev = self.info.device
        n_dev = n_global.to(dev)

        def feed(batch: dict[str, torch.Tensor]) -> tuple:
            ids = host_to_device(batch["input_ids"], dev)
            pos = batch.get("position_ids")
            pos = torch.arange(ids.shape[1]).expand_as(ids).contiguous() if pos is None else pos
            return (ids, host_to_device(pos, dev)), (host_to_device(batch["labels"], dev), n_dev)

        return [feed(b) for b in batches]

    def _pipe_batches(self, step: int, batches: list, n_global: torch.Tensor, stats: StepStats) -> tuple:
        """One train_batch of DeepSpeed's pipeline engine; the last stage hands back its outputs."""
        data = self._pipe_data(batches, n_global)
        if self.dpo is not None:  # the reference pass first; the targets' documents travel with the labels
            data = self.dpo.pipe_reference(self.engine, self.model, batches, data)
        self.engine.train_batch(data_iter=iter(data))
        for out in self.engine.module.take_outputs():
            stats.add(out)
        stats.add_indexer(self.engine.module.take_indexer_stats())
        return None, None

    def _local_full_grad_norm(self) -> torch.Tensor:
        """ZeRO stage 0 keeps whole, already averaged gradients on every rank; DeepSpeed reports no norm
        there. Exact (gradnorm.sum_of_squares), on the device: read with the step's other figures."""
        from dstrain.parallel.gradnorm import sum_of_squares

        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self._stage0_norm = sum_of_squares(grads).sqrt()
        return self._stage0_norm

    def _clip_with_the_exact_norm(self) -> None:
        """ZeRO stage 0 in fp32: DeepSpeed clips with a norm of fp32 per-parameter norms; clip with the
        float64 norm the step reports instead (the trainer computes it before engine.step)."""
        max_norm = float(self.engine.gradient_clipping())

        def clip() -> None:
            # DeepSpeed's (and torch's) rule, decided on the device: a factor of exactly 1 changes nothing
            coef = (max_norm / (self._stage0_norm + 1e-6)).clamp(max=1.0).to(torch.float32)
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            torch._foreach_mul_(grads, coef.to(grads[0].device) if grads else coef)

        self.engine.clip_fp32_gradients = clip

    def _imbalance_ratios(self, load: torch.Tensor | None) -> torch.Tensor | None:
        """Each MoE layer's busiest expert's load over the mean load (on the device)."""
        if load is None:
            return None
        return load.max(dim=1).values / load.mean(dim=1).clamp(min=1e-9)

    def evaluate(self) -> dict[str, Any]:
        """The eval figures of the current weights (see evaluate.py); every rank must call it."""
        assert self.evaluator is not None, "no eval set"
        moe, experts = self.model.moe_layer_ids, self.cfg.n_routed_experts
        rec = {
            "step": self.step,
            "tokens": self.tokens,
            **self.evaluator.run(self.engine, moe, experts, self.pipe, self.model),
        }
        self.eval_history.append(rec)
        return rec

    # ------------------------------------------------------------------ the run
    def state(self) -> dict[str, Any]:
        return {
            "version": 1,
            "step": self.step,
            "tokens": self.tokens,
            "target_tokens": self.target_tokens,
            "rank": self.info.rank,
            "world_size": self.info.world_size,
            "layout": self.layout(),
            "progress": optimizer_progress(self.engine),
            "loader": self.loader.state_dict() if hasattr(self.loader, "state_dict") else None,
            "rng": store.rng_state(),
            "wandb_run_id": self.wandb_run_id,
            "model": self.opts.model.model,
            "tokenizer": self.opts.data.tokenizer,  # the export ships it where --model is no folder
            "optimizer": self.opts.optimizer.optimizer,
            "base": self.base,  # a stored base: the folder the checkpoint reads its frozen weights from
        }

    def save(self) -> str:
        path = store.save(
            self.engine,
            self.output_dir,
            self.step,
            self.state(),
            self.opts.checkpoint.keep_last,
            self.cfg,
            model=self.model,
            groups=self.groups,
            moments=self.opts.checkpoint.save_moments,
        )
        return str(path)

    def run(self, until: int | None = None) -> dict[str, Any]:
        """Train to max_steps (or stop, saved, at step `until`, as an interrupted run would have): each step
        is step -> log -> eval -> save -> maybe stop."""
        end = self.opts.schedule.max_steps if until is None else min(until, self.opts.schedule.max_steps)
        run = self._open_run()
        try:
            if self.step >= end:
                self._nothing_to_run(run)
            while self.step < end:
                if self._plain_step(end):  # its preemption check rides in the step's all-reduce and read
                    self.step_preemption = run.preemption
                rec = self._step(run)
                self._log(run, rec, end)
                if self.evaluator is not None and (
                    self._every(self.opts.eval.eval_every) or self.step == end
                ):
                    self._evaluate(run)
                saved_now = self._every(self.opts.checkpoint.save_every) or self.step == end
                if saved_now:
                    run.last_saved = self._timed_save(run.preemption)
                if self.step < end and run.preemption.should_stop(rec["step_time_s"]):
                    self._stop(run, saved_now)
                    break
        finally:
            if run.profiler is not None:  # the run ended inside the window: keep what was recorded
                run.profiler.finish(self.output_dir, self.info.rank, run.profile_window)
            run.close()
            # the data workers stopped now, not by the garbage collector (Loader.close says why)
            getattr(self.loader, "close", lambda: None)()
        if self.opts.logging.plots and self.info.is_main:
            self._plots(run.display)
        return {
            "step": self.step,
            "checkpoint": run.last_saved,
            "peak_tflops": run.log.peak,
            "peak_source": run.log.peak_source,
            "stopped": run.stopped,
        }

    def _open_run(self) -> _Run:
        opts, info = self.opts, self.info
        log_opts = opts.logging
        sink = MetricsSink(self.output_dir, info.is_main, self.step, getattr(self.engine, "monitor", None),
                           tensorboard=log_opts.tensorboard)  # fmt: skip
        if log_opts.wandb_project and info.is_main:
            name = log_opts.wandb_run_name or os.path.basename(os.path.normpath(self.output_dir))
            config = {**opts.as_dict(), "model_config": self.cfg.to_hf_dict()}
            self.wandb_run_id = sink.start_wandb(
                log_opts.wandb_project, log_opts.wandb_mode, name, self.wandb_run_id, config
            )
        self.wandb_run_id = dist.broadcast_object(self.wandb_run_id)
        display = Display(opts.schedule.max_steps, self.step, log_opts.log_every, self.verbose)
        peak, source = device_peak_tflops(info.device, self.plan.precision, log_opts.peak_tflops)
        display.write(f"dstrain: MFU against {peak:.3g} TFLOP/s per {info.device.type} device ({source})")
        log = RunLog(sink, self.cfg, info.world_size, peak, source, log_opts.log_every)
        window = log_opts.profile_window if log_opts.profiled(info.rank) else None
        preemption = Preemption(opts.run.time_limit, info.device)
        preemption.start()
        return _Run(sink, display, log, preemption, window)

    def _every(self, n: int, step: int | None = None) -> bool:
        return bool(n) and (self.step if step is None else step) % n == 0

    def _plain_step(self, end: int) -> bool:
        """Whether the next step is followed by neither an evaluation nor a save (nor the end): its
        preemption check may be decided before them, inside the step (Preemption.local_flags)."""
        nxt = self.step + 1
        evaluates = self.evaluator is not None and self._every(self.opts.eval.eval_every, nxt)
        return nxt < end and not evaluates and not self._every(self.opts.checkpoint.save_every, nxt)

    def _nothing_to_run(self, run: _Run) -> None:
        if self.resume_path is None:  # --max_steps 0: the initial model, as a checkpoint
            run.last_saved = self.save()
        run.display.write(
            f"dstrain: no steps to run (at step {self.step}, --max_steps {self.opts.schedule.max_steps})"
        )
        if self.evaluator is not None:
            self._evaluate(run)

    def _step(self, run: _Run) -> dict[str, Any]:
        """One optimizer step, inside the --profile_steps window if it covers it."""
        watchdog.heartbeat(self.step)
        window = run.profile_window
        if window and run.profiler is None and window[0] <= self.step + 1 <= window[1]:
            run.profiler = Profiler(self.info.device)
        rec = self.train_step()
        if run.profiler is not None and self.step == window[1]:
            trace = run.profiler.finish(self.output_dir, self.info.rank, window)
            run.display.write(f"dstrain: profiler trace {trace}")
            run.profiler = None
        if self.opts.model.compile and not self.history:
            run.display.write(
                f"dstrain: --compile: the first step, compiling the blocks, took {rec['step_time_s']:.1f} s"
            )
        return rec

    def _log(self, run: _Run, rec: dict[str, Any], end: int) -> None:
        rec["mfu"] = run.log.mfu(rec)
        if note := run.log.over_peak(rec["mfu"]):
            run.display.write(note)
        self.history.append(rec)
        if rec["moe_imbalance"] and (warning := self.collapse.update(rec["moe_imbalance"], rec["lr"])):
            run.display.write(warning)
        run.sink.log(rec)
        run.display.update(rec, run.log.eta_s(rec, self.opts.schedule.max_steps - self.step))
        if self.step_load is not None:
            run.log.expert_load(self.step, self.model.moe_layer_ids, self.step_load, flush=self.step == end)

    def _evaluate(self, run: _Run) -> None:
        rec = self.evaluate()
        run.sink.log(rec)
        run.display.write(eval_line(rec))

    def _stop(self, run: _Run, saved_now: bool) -> None:
        """Preempted (a signal or --time_limit): a complete checkpoint of this step, then out."""
        run.stopped = run.preemption.reason
        if not saved_now:
            run.last_saved = self._timed_save(run.preemption)
        run.display.write(
            f"dstrain: stopped after step {self.step} ({run.stopped}): checkpoint {run.last_saved} is complete; "
            "continue with --resume auto"
        )

    def _plots(self, display: Display) -> None:
        from .plots import write_plots

        try:
            written = write_plots(self.output_dir)
            if written:
                display.write(f"dstrain: plots in {os.path.dirname(written[0])}")
        except Exception as exc:  # plots are a convenience: never fail a finished run over one
            log.warning("dstrain: plots not written: %s", exc)

    def _timed_save(self, preemption: Preemption) -> str:
        t0 = time.perf_counter()
        path = self.save()
        preemption.save_s = max(preemption.save_s, time.perf_counter() - t0)
        return path


@dataclass
class _Run:
    """What one `Trainer.run` holds open: its records, console, preemption watch and profiler window."""

    sink: MetricsSink
    display: Display
    log: RunLog
    preemption: Preemption
    profile_window: tuple[int, int] | None
    profiler: Profiler | None = None
    last_saved: str | None = None
    stopped: str | None = None

    def close(self) -> None:
        if self.stopped is None:  # stopping: later signals stay ignored up to the process's exit
            self.preemption.stop()
        self.display.close()
        self.sink.close()


def seed_everything(seed: int, rank: int) -> None:
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed + rank)
