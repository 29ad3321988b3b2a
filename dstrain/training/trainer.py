"""The training loop: DeepSpeed engine, global-batch loss normalisation, expert-bias balancing, NaN policy,
checkpoints with exact resume, metrics."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import time
from collections import deque
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist

from dstrain.model import ModelConfig, flops_per_token, get_config

from . import checkpoint, dist
from .build import build_for_training
from .dist import DistInfo
from .ds_config import engine_config, parallel_dims
from .errors import CheckpointError, ConfigError, NonFiniteLossError
from .metrics import Display, MetricsSink, device_peak_tflops
from .objective import Weights, count_targets, micro_loss
from .options import Options, min_lr
from .schedule import make_scheduler_factory

log = logging.getLogger("dstrain.train")


def model_config_for(opts: Options) -> ModelConfig:
    t = opts.train
    try:
        cfg = get_config(t.model)
    except ValueError as exc:
        raise ConfigError(f"--model {t.model}: {exc}") from None
    return apply_overrides(cfg, opts)


def apply_overrides(cfg: ModelConfig, opts: Options) -> ModelConfig:
    t = opts.train
    changes = {
        "bias_update_speed": t.moe_bias_update_speed,
        "aux_loss_alpha": t.moe_aux_loss_alpha,
        "mtp_loss_weight": t.mtp_loss_weight,
    }
    return cfg.replace(**{k: v for k, v in changes.items() if v is not None})


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only: norms' gains and biases are not penalised (the expert bias is a buffer). Named, so
    DeepSpeed can split expert-parallel weights into groups of their own."""

    def ndim(p: torch.Tensor) -> int:  # a ZeRO-3 partitioned parameter is flat; its ds_shape is the real one
        return len(getattr(p, "ds_shape", p.shape))

    decay = [p for p in model.parameters() if p.requires_grad and ndim(p) >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and ndim(p) < 2]
    return [
        {"name": "decay", "params": decay, "weight_decay": weight_decay},
        {"name": "no_decay", "params": rest, "weight_decay": 0.0},
    ]


class Trainer:
    def __init__(
        self,
        opts: Options,
        info: DistInfo,
        ds_config: dict[str, Any],
        output_dir: str,
        *,
        model_config: ModelConfig | None = None,
        loader: Any = None,
        tokenizer: Any = None,
        resume_path: str | None = None,
        verbose: bool = True,
    ) -> None:
        self.opts, self.t, self.info, self.ds = opts, opts.train, info, ds_config
        self.output_dir = output_dir
        self.cfg = model_config if model_config is not None else model_config_for(opts)
        self.loader, self.tokenizer = loader, tokenizer
        self.resume_path = resume_path
        self.verbose = verbose and info.is_main
        self.step = 0
        self.tokens = 0
        self.target_tokens = 0
        self.wandb_run_id: str | None = None
        self.history: list[dict[str, Any]] = []
        self.ga = int(ds_config["gradient_accumulation_steps"])
        self.stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
        self.precision = "bf16" if ds_config.get("bf16", {}).get("enabled") else "fp32"
        self.dims = parallel_dims(ds_config, info.world_size)
        _, self.dp_rank, self.tp_rank = self.dims.coords(info.rank)
        self.groups: Any = None
        self.load_stats: dict[str, Any] = {}
        self.pipe = self.dims.pp > 1

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        import deepspeed

        t = self.t
        if self.loader is None:  # first: a data error surfaces before the model is built
            self.loader, self.tokenizer = self._build_loader()
        seed_everything(t.seed, self.info.rank)
        # DeepSpeed keeps the last engine's grid in a module global; a data-parallel engine must not see it.
        deepspeed.utils.groups.mpu = None
        built = build_for_training(t, self.cfg, self.dims, self.info.rank, self.info.device, self.ds)
        model, module, mpu = built.model, built.module, built.mpu
        self.groups, self.load_stats = built.groups, built.load
        model.set_activation_checkpointing(t.activation_checkpointing)
        model.train()
        sched = make_scheduler_factory(
            lr=t.lr,
            min_lr=min_lr(t),
            warmup_steps=t.warmup_steps,
            max_steps=t.max_steps,
            schedule=t.lr_schedule,
        )
        self.engine, _, _, _ = deepspeed.initialize(
            model=module,
            model_parameters=param_groups(module, t.weight_decay),
            config=engine_config(self.ds),
            lr_scheduler=sched,
            mpu=None if self.pipe else mpu,
            dist_init_required=False,
        )
        if self.dims.model_parallel:
            from dstrain.parallel.gradnorm import install_global_grad_norm

            install_global_grad_norm(self.engine, self.groups)
        self.model = model
        checkpoint.install_safe_loading(self.engine)
        if self.resume_path is not None:
            self._resume(self.resume_path)
        self.mtp_depth = int(self.cfg.num_nextn_predict_layers)
        self.weights = Weights(alpha=float(self.cfg.aux_loss_alpha), lam=float(self.cfg.mtp_loss_weight))

    def _build_loader(self) -> tuple[Any, Any]:
        from dstrain.data import build_loader, load_tokenizer

        model_path = self.t.model if os.path.isdir(self.t.model) else None
        tok = load_tokenizer(self.opts.data.tokenizer, model_path=model_path)
        vocab = len(tok)
        if vocab > self.cfg.vocab_size:
            raise ConfigError(
                f"tokenizer has {vocab} tokens but model {self.t.model} has vocab_size {self.cfg.vocab_size}"
            )
        loader = build_loader(
            self.opts.data,
            tok,
            self.t.micro_batch_size,
            dp_rank=self.dp_rank,
            dp_world=self.dims.dp,
            seed=self.t.seed,
        )
        return loader, tok

    def _resume(self, path: str) -> None:
        from pathlib import Path

        state = checkpoint.load(self.engine, Path(path), self.info.rank, self.info.world_size)
        if self.dims.model_parallel:
            from .weights import load_local_weights

            load_local_weights(self.model, Path(path))
        self.step = int(state["step"])
        self.tokens = int(state["tokens"])
        self.target_tokens = int(state["target_tokens"])
        self.wandb_run_id = state.get("wandb_run_id")
        if state.get("loader") is not None and hasattr(self.loader, "load_state_dict"):
            self.loader.load_state_dict(state["loader"])
        checkpoint.set_rng_state(state["rng"])
        if self.engine.global_steps != self.step:
            raise CheckpointError(
                f"checkpoint {path}: DeepSpeed is at step {self.engine.global_steps}, dstrain at {self.step}"
            )

    # ------------------------------------------------------------------ one optimizer step
    def train_step(self) -> dict[str, Any]:
        step = self.step + 1
        t0 = time.perf_counter()
        dev = self.info.device
        batches = [next(self.loader) for _ in range(self.ga)]
        local_counts = torch.stack([count_targets(b, self.mtp_depth) for b in batches]).sum(0)
        n_global = self._dp_sum(local_counts.to(dev, torch.float64)).to(torch.float32)
        scale = float(self.ga * self.dims.dp)
        lr = float(self.engine.get_lr()[0])
        run = self._pipe_batches if self.pipe else self._micro_batches
        acc, skip, grad_norm = run(step, batches, n_global, scale)
        if acc["counts"] is not None and not torch.equal(acc["counts"].cpu(), local_counts):
            raise RuntimeError(
                f"step {step}: the model counted {acc['counts'].tolist()} targets, the trainer {local_counts.tolist()}"
            )
        # One collective for every statistic: [lm_sum, mtp_sum..., aux_sum, expert load...]. Ranks holding a
        # copy of another's numbers (tensor-parallel peers, pipeline stages without the loss) send zeros.
        load = acc["load"]
        parts = [acc["lm"].view(1) * acc["w"], acc["mtp"] * acc["w"], acc["aux"].view(1) * acc["w"]]
        if load is not None:
            parts.append(load.flatten())
        stats = dist.all_reduce(torch.cat(parts))
        d = self.mtp_depth
        g_lm, g_mtp, g_aux = stats[0], stats[1 : 1 + d], stats[1 + d]
        g_load = stats[2 + d :].view(load.shape) if load is not None else None
        if self.pipe and not math.isfinite(float(g_lm)) and not skip:
            skip = True
            if self.t.nan_policy == "stop":
                raise NonFiniteLossError(
                    f"step {step}: non-finite loss (--nan_policy skip to skip such steps)"
                )
        if skip and self.engine.was_step_applied():
            raise RuntimeError(f"step {step}: DeepSpeed applied an update with non-finite gradients")
        if g_load is not None and not skip:
            self.model.update_expert_bias(g_load.to(torch.float32))
        if grad_norm is None:
            grad_norm = self.engine.get_global_grad_norm()
        n = n_global.double().clamp(min=1)
        lm_loss = float(g_lm / n[0])
        mtp_loss = float((g_mtp / n[1:]).mean()) if d else None
        aux_loss = float(g_aux / scale)
        total = lm_loss + self.weights.lam * (mtp_loss or 0.0) + self.weights.alpha * aux_loss
        seq_len = int(batches[0]["input_ids"].shape[1])
        step_tokens = self.t.micro_batch_size * seq_len * self.ga * self.dims.dp
        self.step = step
        self.tokens += step_tokens
        self.target_tokens += int(n_global[0])
        return {
            "step": step,
            "loss": _num(total),
            "lm_loss": _num(lm_loss),
            "mtp_loss": _num(mtp_loss),
            "aux_loss": _num(aux_loss),
            "lr": lr,
            "grad_norm": _num(float(grad_norm)) if grad_norm is not None else None,
            "tokens": self.tokens,
            "target_tokens": int(n_global[0]),
            "skipped": skip,
            "step_time_s": time.perf_counter() - t0,
            "seq_len": seq_len,
            "moe_imbalance": self._imbalance(g_load),
        }

    def _dp_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel group (every rank of a pipeline / tensor-parallel group reads the same
        batches)."""
        if self.groups is None:
            return dist.all_reduce(x)
        if self.groups.dp is not None:
            tdist.all_reduce(x, group=self.groups.dp)
        return x

    def _accumulator(self) -> dict[str, Any]:
        dev = self.info.device
        return {
            "lm": torch.zeros((), dtype=torch.float64, device=dev),
            "mtp": torch.zeros(self.mtp_depth, dtype=torch.float64, device=dev),
            "aux": torch.zeros((), dtype=torch.float64, device=dev),
            "counts": torch.zeros(1 + self.mtp_depth, dtype=torch.int64, device=dev),
            "load": None,
            "w": 1.0 if self.tp_rank == 0 else 0.0,
        }

    def _add_output(self, acc: dict[str, Any], out: Any) -> None:
        acc["lm"] += out.lm_loss_sum.detach().double()
        acc["counts"][0] += out.lm_tokens.detach().to(torch.int64)
        if self.mtp_depth and out.mtp_loss_sum is not None:
            acc["mtp"] += out.mtp_loss_sum.detach().double()
            acc["counts"][1:] += out.mtp_tokens.detach().to(torch.int64)
        if out.aux_loss is not None:
            acc["aux"] += out.aux_loss.detach().double()

    def _micro_batches(self, step: int, batches: list, n_global: torch.Tensor, scale: float) -> tuple:
        dev = self.info.device
        acc = self._accumulator()
        skip = False
        grad_norm = None
        for i, batch in enumerate(batches):
            batch = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
            out = self.engine(
                input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), labels=batch["labels"]
            )
            loss = micro_loss(out, n_global.to(dev), scale, self.weights)
            bad = torch.tensor([0.0 if torch.isfinite(loss).item() else 1.0], device=dev)
            if dist.all_reduce(bad, tdist.ReduceOp.MAX).item() > 0:
                if self.t.nan_policy == "stop":
                    raise NonFiniteLossError(
                        f"step {step}: non-finite loss (micro batch {i + 1}/{self.ga}); stopped before the "
                        "update (--nan_policy skip to skip such steps)"
                    )
                skip = True
            if skip:
                # NaN gradients make DeepSpeed's overflow check drop this step's update on every rank.
                loss = loss * float("nan")
            self._add_output(acc, out)
            if out.expert_load is not None:
                load = out.expert_load.detach().double() * acc["w"]
                acc["load"] = load if acc["load"] is None else acc["load"] + load
            self.engine.backward(loss)
            if self.stage == 0 and i == self.ga - 1:
                grad_norm = self._local_full_grad_norm()
            self.engine.step()
        return acc, skip, grad_norm

    def _pipe_batches(self, step: int, batches: list, n_global: torch.Tensor, scale: float) -> tuple:
        """One train_batch of DeepSpeed's pipeline engine; statistics live on the stages that computed them."""
        from dstrain.parallel.pipe import BlockLayer, Tail

        dev = self.info.device
        layers = list(self.engine.module.forward_funcs)
        tail = next((m for m in layers if isinstance(m, Tail)), None)
        blocks = [m for m in layers if isinstance(m, BlockLayer) and m.is_moe]
        for b in blocks:
            b.load = None
        if tail is not None:
            tail.outputs = []
            n_dev = n_global.to(dev)
            tail.objective = lambda out: micro_loss(out, n_dev, scale, self.weights)

        def feed(batch: dict[str, torch.Tensor]) -> tuple:
            ids = batch["input_ids"].to(dev)
            pos = batch.get("position_ids")
            pos = torch.arange(ids.shape[1]).expand_as(ids).contiguous() if pos is None else pos
            return (ids, pos.to(dev)), batch["labels"].to(dev)

        self.engine.train_batch(data_iter=iter([feed(b) for b in batches]))
        acc = self._accumulator()
        moe_ids = self.model.moe_layer_ids
        e = self.cfg.n_routed_experts
        load = torch.zeros(len(moe_ids), e, dtype=torch.float64, device=dev) if moe_ids else None
        for b in blocks:
            load[moe_ids.index(b.index)] += b.load.to(dev) * acc["w"]
        if tail is None:
            acc["w"], acc["counts"] = 0.0, None
        else:
            for out in tail.outputs:
                self._add_output(acc, out)
                if out.expert_load is not None:  # the MTP blocks' MoE layers, after the main ones
                    rows = out.expert_load.double() * acc["w"]
                    load[len(moe_ids) - rows.shape[0] :] += rows
        acc["load"] = load
        return acc, False, None

    def _local_full_grad_norm(self) -> float:
        # ZeRO stage 0 keeps whole, already averaged gradients on every rank; DeepSpeed reports no norm there.
        sq = sum(
            float(p.grad.detach().double().pow(2).sum())
            for p in self.model.parameters()
            if p.grad is not None
        )
        return math.sqrt(sq)

    def _imbalance(self, load: torch.Tensor | None) -> dict[str, float]:
        if load is None:
            return {}
        mean = load.mean(dim=1).clamp(min=1e-9)
        ratio = (load.max(dim=1).values / mean).tolist()
        return {f"layer_{i}": round(r, 4) for i, r in zip(self.model.moe_layer_ids, ratio)}

    # ------------------------------------------------------------------ the run
    def state(self) -> dict[str, Any]:
        return {
            "version": 1,
            "step": self.step,
            "tokens": self.tokens,
            "target_tokens": self.target_tokens,
            "rank": self.info.rank,
            "world_size": self.info.world_size,
            "loader": self.loader.state_dict() if hasattr(self.loader, "state_dict") else None,
            "rng": checkpoint.rng_state(),
            "wandb_run_id": self.wandb_run_id,
            "model": self.t.model,
        }

    def save(self) -> str:
        path = checkpoint.save(
            self.engine,
            self.output_dir,
            self.step,
            self.state(),
            self.t.keep_last,
            self.cfg.to_hf_dict(),
            model=self.model,
            groups=self.groups,
        )
        return str(path)

    def run(self, until: int | None = None) -> dict[str, Any]:
        """Train to max_steps (or stop, saved, at step `until`, as an interrupted run would have)."""
        t = self.t
        end = t.max_steps if until is None else min(until, t.max_steps)
        info = self.info
        sink = MetricsSink(self.output_dir, info.is_main, self.step, getattr(self.engine, "monitor", None))
        if t.wandb_project and info.is_main:
            name = t.wandb_run_name or os.path.basename(os.path.normpath(self.output_dir))
            config = {
                "train": dataclasses.asdict(t),
                "data": _asdict(self.opts.data),
                "model": self.cfg.to_hf_dict(),
            }
            self.wandb_run_id = sink.start_wandb(
                t.wandb_project, t.wandb_mode, name, self.wandb_run_id, config
            )
        self.wandb_run_id = dist.broadcast_object(self.wandb_run_id)
        display = Display(t.max_steps, self.step, t.log_every, self.verbose)
        peak, source = device_peak_tflops(info.device, self.precision, t.peak_tflops)
        display.write(f"dstrain: MFU against {peak:.3g} TFLOP/s per {info.device.type} device ({source})")
        last_saved = None
        try:
            if self.step >= end:
                if self.resume_path is None:  # --max_steps 0: the initial model, as a checkpoint
                    last_saved = self.save()
                display.write(f"dstrain: no steps to run (at step {self.step}, --max_steps {t.max_steps})")
            recent: deque[float] = deque(maxlen=20)
            fpt_cache: dict[int, float] = {}
            while self.step < end:
                rec = self.train_step()
                recent.append(rec["step_time_s"])
                rec["tokens_per_s"] = (
                    rec["seq_len"] * t.micro_batch_size * self.ga * info.world_size / rec["step_time_s"]
                )
                if rec["seq_len"] not in fpt_cache:
                    fpt_cache[rec["seq_len"]] = flops_per_token(self.cfg, rec["seq_len"])
                fpt = fpt_cache[rec["seq_len"]]
                rec["mfu"] = (
                    _num(rec["tokens_per_s"] / info.world_size * fpt / (peak * 1e12)) if peak > 0 else None
                )
                self.history.append(rec)
                sink.log(rec)
                display.update(rec, (t.max_steps - self.step) * sum(recent) / len(recent))
                if (t.save_every and self.step % t.save_every == 0) or self.step == end:
                    last_saved = self.save()
        finally:
            display.close()
            sink.close()
        return {"step": self.step, "checkpoint": last_saved, "peak_tflops": peak, "peak_source": source}


def seed_everything(seed: int, rank: int) -> None:
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed + rank)


def _num(x: float | None) -> float | None:
    """JSON has no NaN/Inf: non-finite values are recorded as null."""
    if x is None or not math.isfinite(x):
        return None
    return x


def _asdict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else dict(vars(obj))
