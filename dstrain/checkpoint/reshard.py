"""Resuming a checkpoint on another world size or layout (data-parallel size, ZeRO stage, PP/TP/EP degrees).

DeepSpeed's own files are per rank and per layout; they are used when the layout is unchanged (bit-exact). On
another layout every rank rebuilds its share from the checkpoint's layout-free tensors (weights.py): the fp32
master weights in weights/ and AdamW's moments in optimizer/, each full tensor cut to what this rank holds
(its TP/EP slice, its ZeRO partition), written into the module, DeepSpeed's fp32 master copy and the
optimizer state. AdamW's step count and the learning-rate schedule come from dstrain's state. DeepSpeed's
universal checkpoint is not used: it converts offline, and knows neither dstrain's TP and EP slices nor its
pipeline layers, while these tensors are written anyway for export.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dstrain.errors import CheckpointError
from dstrain.model.sources import local_tensors
from dstrain.optim import ADAMW_STATE, MUON_STATE, state_keys

from .weights import iter_weights, link_moments, local_slice, moments_dir, weights_index


def base_optimizer(engine: Any) -> torch.optim.Optimizer:
    """torch's AdamW, under DeepSpeed's ZeRO / bf16 wrapper if there is one."""
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def optimizer_progress(engine: Any) -> dict[str, Any]:
    """What a resharded resume needs beside the tensors: AdamW's step count (0 before its first update) and
    the schedule's counters. JSON."""
    steps = [s["step"] for s in base_optimizer(engine).state.values() if "step" in s]
    sched = engine.lr_scheduler
    return {
        "adam_step": float(steps[0]) if steps else 0.0,
        "lr_epoch": int(sched.last_epoch),
        "lr_step_count": int(sched._step_count),
    }


@torch.no_grad()
def load_resharded(engine: Any, model: nn.Module, path: Path, progress: dict[str, Any], step: int) -> None:
    """Every rank: its share of the checkpoint's weights and moments into `engine` (built for this layout),
    then AdamW's step count, the schedule and DeepSpeed's step counters."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    base = base_optimizer(engine)
    mine = {n: t for n, t in local_tensors(model, adapters=True) if t.device.type != "meta"}
    saved = weights_index(path)
    missing = sorted(set(mine) - set(saved))
    if missing:
        raise CheckpointError(
            f"checkpoint {path}: weights/ lacks {len(missing)} tensor(s) of this model: {missing[:3]}"
        )
    for name, full in iter_weights(path, list(mine)):
        t = mine[name]
        value = local_slice(full, t)
        if value.numel() != getattr(t, "ds_numel", t.numel()):
            raise CheckpointError(
                f"checkpoint {path}: {name} has shape {list(full.shape)}, this model's is another (same model?)"
            )
        _set_module_value(t, value)
        if _trained(t) and _has_master(t):  # without one (no ZeRO, fp32) the module weight is the master
            _set_master(t, value, safe_set_full_fp32_param)
    trained = [n for n, t in mine.items() if _trained(t)]
    adam_step = float(progress.get("adam_step", 0.0))  # updates taken (AdamW's count, Muon's alike)
    if adam_step > 0 and trained:
        keys = {key: [n for n in trained if key in state_keys(mine[n])] for key in ADAMW_STATE + MUON_STATE}
        keys = {key: names for key, names in keys.items() if names}
        for key in keys:
            if not (path / moments_dir(key)).is_dir():
                raise CheckpointError(
                    f"checkpoint {path}: no layout-free optimizer state {key} (saved with --no-save_moments, "
                    "by another --optimizer, or by an older dstrain): it resumes on its own layout only"
                )
        _create_state(engine.optimizer, base)
        for key, names in keys.items():
            for name, full in iter_weights(path, names, moments_dir(key)):
                t = mine[name]
                value = local_slice(full, t)
                if _has_master(t):
                    _set_master(t, value, partial(safe_set_full_optimizer_state, optim_state_key=key), key)
                else:
                    base.state[t][key].copy_(value.view_as(base.state[t][key]))
        for state in base.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"].fill_(adam_step)
            elif "step" in state:
                state["step"] = type(state["step"])(adam_step)
    _set_schedule(engine.lr_scheduler, progress)
    engine.global_steps = step
    engine.global_samples = step * engine.train_batch_size()
    engine.micro_steps = step * engine.gradient_accumulation_steps()


def _set_master(t: torch.Tensor, value: torch.Tensor, set_full: Any, key: str | None = None) -> None:
    """The optimizer's fp32 copy of `t` (its master weight, or state `key`) from the whole `value`. ZeRO-3's
    own setter slices the whole tensor without its padding, so a tensor whose size the ranks do not divide
    (DeepSeek-V4's mHC scales: 3 elements) is written here, this rank's padded partition."""
    z3 = getattr(t, "_z3_optimizer", None)
    if z3 is None or not t.requires_grad:
        set_full(t, value)
        return
    part, group = z3._get_fp32_opt_state_partition(t, release_swap_buffers=False, optim_state_key=key)
    n, rank = part.numel(), z3._get_param_partition_rank(t)
    if n * z3.partition_count == t.ds_numel:
        set_full(t, value)
        return
    piece = value.flatten()[n * rank : n * (rank + 1)]
    part.data.zero_()
    part.data[: piece.numel()].copy_(piece)
    if z3._swappable_optimizer_subgroup(group):
        z3._optimizer_states_and_gradient_swap_out(group)


def _trained(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) and t.requires_grad


def _has_master(t: torch.Tensor) -> bool:
    """Managed by a ZeRO / bf16 optimizer (its master fragment may sit on another rank: `_hp_mapping` None)."""
    return hasattr(t, "ds_id") or hasattr(t, "_hp_mapping")


def _set_module_value(t: torch.Tensor, value: torch.Tensor) -> None:
    if hasattr(t, "ds_tensor"):  # ZeRO-3: this rank's partition of the flattened, padded tensor
        import torch.distributed as tdist

        part = t.ds_tensor
        start = part.numel() * tdist.get_rank(group=t.ds_process_group)
        seg = value.flatten()[start : start + part.numel()]
        part.data[: seg.numel()].copy_(seg.to(part.dtype))
    else:
        t.data.copy_(value.to(t.dtype))


def _create_state(wrapper: Any, base: torch.optim.Optimizer) -> None:
    """AdamW creates its moments at its first step: take one with zero gradients at learning rate 0 (no
    change to any weight, weight decay included), then let DeepSpeed link the new state to its parameters."""
    groups = base.param_groups
    lrs, params = [g["lr"] for g in groups], [g["params"] for g in groups]
    flats = getattr(wrapper, "fp32_partitioned_groups_flat", None)
    if flats is not None:  # ZeRO-3 hands each sub-group's flat partition to AdamW only while stepping it
        for g in groups:
            g["params"] = []
        for i, flat in enumerate(flats):
            groups[wrapper.sub_group_to_group_id[i]]["params"].append(flat)
    grads = {}
    for g in groups:
        g["lr"] = 0.0
        for p in g["params"]:
            grads[p] = p.grad
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    base.step()
    for g, lr, ps in zip(groups, lrs, params):
        for p in g["params"]:
            p.grad = grads[p]
        g["lr"], g["params"] = lr, ps
    link_moments(wrapper)


def _set_schedule(sched: Any, progress: dict[str, Any]) -> None:
    """LambdaLR at the saved count, and the optimizer's groups at its learning rate (the group count may
    differ between layouts: expert parallelism splits groups; all follow one schedule)."""
    sched.last_epoch = int(progress.get("lr_epoch", 0))
    sched._step_count = int(progress.get("lr_step_count", sched.last_epoch + 1))
    lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
    for g, lr in zip(sched.optimizer.param_groups, lrs):
        g["lr"] = lr
    sched._last_lr = lrs
