"""The optimizer a run hands deepspeed.initialize: DeepSpeed's configured AdamW (two groups), or dstrain's Muon
with AdamW beside it (dstrain.optim) as a client optimizer, classified on the model's canonical names."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from dstrain.checkpoint.store import read_state
from dstrain.config.plan import RunPlan
from dstrain.errors import CheckpointError
from dstrain.optim.groups import MuonSettings, adamw_groups, classify, param_groups, table_text
from dstrain.optim.muon import MuonAdamW, bind

TABLE_FILE = "optimizer_groups.txt"


@dataclass
class Choice:
    """What deepspeed.initialize gets: `optimizer` (Muon) or `model_parameters` (DeepSpeed's AdamW), the
    config without the optimizer section when dstrain's own optimizer runs, and the classification table."""

    config: dict[str, Any]
    model_parameters: list[dict[str, Any]] | None = None
    optimizer: MuonAdamW | None = None
    table: str | None = None


def muon_settings(plan: RunPlan) -> MuonSettings:
    t, s = plan.opts.optimizer, plan.opts.schedule
    return MuonSettings(
        lr=float(t.muon_lr if t.muon_lr is not None else s.lr),
        momentum=t.muon_momentum,
        nesterov=t.muon_nesterov,
        ns_steps=t.muon_ns_steps,
        scale=t.muon_scale,
        per_head=t.muon_per_head,
        adapters=t.muon_adapters,
    )


def choose(plan: RunPlan, model: nn.Module, module: nn.Module) -> Choice:
    """`model`: the single-device view with canonical names (other pipeline stages' layers on meta); `module`:
    what DeepSpeed trains (the same parameter objects, this rank's)."""
    t = plan.opts.optimizer
    if t.optimizer == "adamw":
        trained = [p for p in module.parameters() if p.requires_grad]
        return Choice(plan.ds, model_parameters=adamw_groups(trained, t.weight_decay))
    held = {id(p) for p in module.parameters()}
    everywhere = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    mine = [(n, p) for n, p in everywhere if id(p) in held]
    muon = muon_settings(plan)
    groups, _ = param_groups(mine, plan.model, t.weight_decay, muon)
    betas = (t.adam_beta1, t.adam_beta2)
    lr = plan.opts.schedule.lr
    fused = all(p.device.type in ("cpu", "cuda") for g in groups for p in g["params"])
    opt = MuonAdamW(groups, lr=lr, betas=betas, eps=t.adam_eps, weight_decay=t.weight_decay, fused=fused)
    config = {k: v for k, v in plan.ds.items() if k != "optimizer"}
    return Choice(config, optimizer=opt, table=table_text(classify(everywhere, plan.model, muon)))


def check_resume(path: Path, optimizer: str) -> None:
    """A checkpoint continues only with the optimizer that wrote its state (before Muon: AdamW)."""
    saved = read_state(path).get("optimizer", "adamw")
    if saved != optimizer:
        raise CheckpointError(
            f"checkpoint {path} was trained with --optimizer {saved}, this run has --optimizer {optimizer}: its "
            "optimizer state cannot continue; start a new run from its export (--model FOLDER) to switch"
        )


DEEPSPEED_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_deepspeed_muon() -> None:
    """Import DeepSpeed's Muon module with its `@torch.compile` decorators deferred to each function's first call.

    DeepSpeed's ZeRO and bf16 optimizers import that module to test the optimizer's type, whatever it is, and
    its decorators import Inductor there: about 1 s of every engine's process start (deepspeed.initialize of
    the tiny preset on a CPU: 1.19 -> 0.13 s) for functions that run only with DeepSpeed's own Muon, which
    dstrain never hands it (its Muon is dstrain/optim/muon.py). Deferred, they compile at their first call as
    before. A DeepSpeed without that module or decorator is left to import what it imports."""
    if DEEPSPEED_MUON in sys.modules:
        return
    from deepspeed.runtime import compiler

    eager = getattr(compiler, "compile", None)
    if eager is None:
        return

    def deferred():  # noqa: ANN202 - the decorator compiler.compile() returns
        def decorate(fn):  # noqa: ANN001, ANN202
            compiled = None

            @functools.wraps(fn)
            def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                nonlocal compiled
                if compiled is None:
                    compiled = eager()(fn)
                return compiled(*args, **kwargs)

            return call

        return decorate

    compiler.compile = deferred
    try:
        __import__(DEEPSPEED_MUON)
    except ImportError:
        pass
    finally:
        compiler.compile = eager


def initialize(choice: Choice, module: nn.Module, **kwargs: Any) -> Any:
    """deepspeed.initialize with the optimizer `choice` (`kwargs`: its other arguments) -> the engine, with
    Muon bound to where each parameter's slices live under the engine's ZeRO / bf16 optimizer."""
    import deepspeed

    import_deepspeed_muon()
    engine, _, _, _ = deepspeed.initialize(
        model=module,
        model_parameters=choice.model_parameters,
        optimizer=choice.optimizer,
        config=choice.config,
        **kwargs,
    )
    if choice.optimizer is not None:
        bind(engine.optimizer, choice.optimizer)
    return engine
