"""Which optimizer steps each trained parameter, and the parameter groups DeepSpeed gets.

AdamW only: two groups, decayed matrices and the rest (norm gains, biases), as before Muon existed. With
Muon (Moonlight's split, which Kimi K2, GLM-5 and DeepSeek-V4 train with): every hidden matrix is Muon's,
each in a group of its own (see muon.py); the token embedding and the LM head (which MTP's heads share) and
every vector stay with AdamW. The expert bias is a buffer, never stepped. LoRA adapters are matrices too:
Muon steps each factor as its own matrix (per expert for the experts' adapters), what "Muon fine-tuning with
LoRA" means in the studies of it (Qu et al. 2026, arXiv:2605.10468); `adapters=False` keeps them on AdamW.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dstrain.model.common.lora import is_lora_key

from . import ADAMW_STATE, MUON_STATE

# The vocabulary-sized matrices (Moonlight's rule), and DeepSeek-V4's compressor position biases (a table of
# biases added to the gate logits, not a projection)
ADAMW_ONLY = ("embed_tokens.weight", "lm_head.weight", "position_bias")
# Projections whose rows are per-head blocks: name suffix -> the config field that counts the heads
PER_HEAD = {
    "self_attn.q_proj.weight": "num_attention_heads",
    "self_attn.q_b_proj.weight": "num_attention_heads",
    "self_attn.kv_b_proj.weight": "num_attention_heads",
    "indexer.wq_b.weight": "index_n_heads",
    "indexer.q_b_proj.weight": "index_n_heads",  # DeepSeek-V4's CSA indexer
}
# Block-diagonal projections, one independent matrix per group of rows whatever --muon_per_head says:
# name suffix -> the config field that counts the groups (DeepSeek-V4's grouped output projection)
BLOCK_DIAGONAL = {"self_attn.o_a_proj.weight": "o_groups"}


@dataclass(frozen=True)
class MuonSettings:
    """What a Muon group carries (the optimizer section's Muon fields, resolved)."""

    lr: float
    momentum: float
    nesterov: bool
    ns_steps: int
    scale: str
    per_head: bool
    adapters: bool


@dataclass(frozen=True)
class Assignment:
    name: str
    shape: tuple[int, ...]
    optimizer: str  # 'muon' or 'adamw'
    split: str | None  # Muon's blocks (muon.blocks), None for AdamW
    decay: bool


def shape_of(p: torch.Tensor) -> tuple[int, ...]:
    """The tensor's shape as this rank trains it (a ZeRO-3 parameter is flat; its ds_shape is the real one)."""
    return tuple(getattr(p, "ds_shape", p.shape))


def split_of(name: str, shape: tuple[int, ...], cfg: Any, per_head: bool) -> str:
    if len(shape) == 3:  # fused routed experts (and their adapters): one matrix per expert
        return "experts_gate_up" if name.endswith("experts.gate_up_proj") else "experts"
    for suffix, field in BLOCK_DIAGONAL.items():
        if name.endswith(suffix):
            return f"heads:{getattr(cfg, field)}"
    for suffix, field in PER_HEAD.items():
        if per_head and name.endswith(suffix) and hasattr(cfg, field):
            return f"heads:{getattr(cfg, field)}"
    return "matrix"


def classify(named: list[tuple[str, nn.Parameter]], cfg: Any, muon: MuonSettings | None) -> list[Assignment]:
    """Each trained parameter's optimizer. `named`: (canonical name, parameter) of the parameters this rank
    trains; `cfg`: the model config (head counts); `muon` None: AdamW for all."""
    out = []
    for name, p in named:
        shape = shape_of(p)
        matrix = len(shape) >= 2
        use_muon = (
            muon is not None
            and matrix
            and not name.endswith(ADAMW_ONLY)
            and (muon.adapters or not is_lora_key(name))
        )
        split = split_of(name, shape, cfg, muon.per_head) if use_muon else None
        out.append(Assignment(name, shape, "muon" if use_muon else "adamw", split, matrix))
    return out


def adamw_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only: norms' gains and biases are not penalised. Named, so DeepSpeed can split
    expert-parallel weights into groups of their own."""
    decay = [p for p in params if len(shape_of(p)) >= 2]
    rest = [p for p in params if len(shape_of(p)) < 2]
    return [
        {"name": "decay", "params": decay, "weight_decay": weight_decay},
        {"name": "no_decay", "params": rest, "weight_decay": 0.0},
    ]


def param_groups(
    named: list[tuple[str, nn.Parameter]], cfg: Any, weight_decay: float, muon: MuonSettings
) -> tuple[list[dict[str, Any]], list[Assignment]]:
    """-> (the groups for the optimizer, each parameter's assignment). Tags each parameter with the optimizer
    state it will have (`optimizer_state`, read by the layout-free checkpoint)."""
    table = classify(named, cfg, muon)
    params = dict(named)
    adamw = [params[a.name] for a in table if a.optimizer == "adamw"]
    groups = adamw_groups(adamw, weight_decay)
    if any(hasattr(p, "group_name") for p in adamw):  # expert parallel: DeepSpeed's split of its groups
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    for p in adamw:
        p.optimizer_state = ADAMW_STATE
    for a in table:
        if a.optimizer != "muon":
            continue
        p = params[a.name]
        p.optimizer_state = MUON_STATE
        expert = hasattr(p, "group_name")  # DeepSpeed reduces it over its expert-data-parallel group
        groups.append(
            {
                "params": [p],
                "name": p.group_name if expert else a.name,
                **({"moe": True} if expert else {}),
                "param": a.name,
                "muon": a.split,
                "shape": list(a.shape),
                "lr": muon.lr,
                "weight_decay": weight_decay,
                "momentum": muon.momentum,
                "nesterov": muon.nesterov,
                "ns_steps": muon.ns_steps,
                "scale": muon.scale,
            }
        )
    return [g for g in groups if g["params"]], table


def describe(a: Assignment) -> str:
    if a.optimizer == "adamw":
        return "adamw" if a.decay else "adamw, no decay"
    what = {"matrix": "", "experts": ", per expert", "experts_gate_up": ", per expert, gate | up"}
    if a.split in what:
        return "muon" + what[a.split]
    return f"muon, per head ({a.split.split(':')[1]})"


def table_text(table: list[Assignment]) -> str:
    """One row per (name pattern, shape, optimizer): layer and MTP indices folded into '*'."""
    rows = Counter(
        (re.sub(r"\.\d+\.", ".*.", a.name), "x".join(map(str, a.shape)), describe(a)) for a in table
    )
    head = ("parameter", "shape", "optimizer", "count")
    lines = [head] + [(*key, str(n)) for key, n in rows.items()]
    widths = [max(len(r[i]) for r in lines) for i in range(3)]
    out = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>5}" for r in lines]
    muon = sum(math.prod(a.shape) for a in table if a.optimizer == "muon")
    total = sum(math.prod(a.shape) for a in table)
    out.append(f"muon steps {muon:,} of {total:,} trained elements ({muon / max(total, 1):.1%})")
    return "\n".join(out)
