"""A stored base as `dstrain plan` sizes it (--base_precision stored, model/common/stored.py): which of the
model's frozen weights a release keeps quantized, in which form, from its config.json's quantization keys
(a folder's own; a preset's release's: `Family.release_quantization`), and the bytes each form takes.

The estimate (estimate.py, v4.py) models a block's layers by kind; `KINDS` (`FAMILY_KINDS` for DeepSeek-V4) names
one dstrain weight of each kind, whose Hugging Face module name (the family's key table) the
quantization_config's rules are matched against. The routers, the embedding, the head, the norms and the indexer's head weights are never
quantized by the releases.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dstrain.errors import ConfigError
from dstrain.model.common.stored import EXPERT_CHUNK_BYTES
from dstrain.model.hf.quant import FP4_BLOCK, FP8_BLOCK

if TYPE_CHECKING:
    from dstrain.config.plan import RunPlan

QUANT_KEYS = ("quantization_config", "expert_dtype")


@dataclass(frozen=True)
class Form:
    """How a release stores a weight: codes of `bits` bits (packed into `word`-byte words along a row), one
    `scale`-byte scale per `block` (rows, columns), plus `shape` bytes per matrix."""

    label: str
    bits: int
    block: tuple[int, int]
    scale: int
    word: int = 1
    shape: int = 0
    peak: int = 12
    """Bytes per element while it is dequantized (hf/quant.py): FP8 and packed integers an fp32 copy of the
    codes, the scales spread per element and their product; FP4 its uint8 codes, their int64 indices and the
    fp32 values."""

    def nbytes(self, rows: int, cols: int) -> int:
        """Codes + scales of a rows x cols matrix (a scale block cut short at the edges counts whole)."""
        words = math.ceil(cols * self.bits / 8 / self.word) * self.word
        scales = math.ceil(rows / self.block[0]) * math.ceil(cols / self.block[1]) * self.scale
        return rows * words + scales + self.shape


FP8 = Form("FP8 e4m3 128x128, fp32 scales", 8, (FP8_BLOCK, FP8_BLOCK), 4)
FP8_E8M0 = Form("FP8 e4m3 128x128, e8m0 scales", 8, (FP8_BLOCK, FP8_BLOCK), 1)
FP4 = Form("FP4 e2m1 1x32, e8m0 scales", 4, (1, FP4_BLOCK), 1, peak=13)


def packed(bits: int, group: int | None) -> Form:
    """compressed-tensors' pack-quantized integers: int32 words, a bf16 scale per group of columns (None:
    per channel), an int32 (rows, cols) weight_shape."""
    return Form(f"INT{bits} g{group or 'channel'}, bf16 scales", bits, (1, group or 2**31), 2, 4, 8)


# The estimate's weight kinds -> a dstrain weight of that kind ({moe}: the first MoE block's index; {csa}:
# the first CSA block's), per family (estimate.SHAPES's families: the DeepSeek-V3 family's by default).
KINDS = {
    "attention": "layers.{moe}.self_attn.o_proj.weight",
    "indexer": "layers.{moe}.self_attn.indexer.wq_b.weight",
    "mlp": "layers.0.mlp.gate_proj.weight",
    "shared": "layers.{moe}.mlp.shared_experts.gate_proj.weight",
    "experts": "layers.{moe}.mlp.experts.gate_up_proj",
    "mtp": "mtp.0.eh_proj.weight",
}
FAMILY_KINDS = {
    "deepseek_v4": {
        "attention": "layers.{moe}.self_attn.o_b_proj.weight",  # every attention linear (compressors too)
        "indexer": "layers.{csa}.self_attn.compressor.indexer.q_b_proj.weight",
        "shared": "layers.{moe}.mlp.shared_experts.gate_proj.weight",
        "experts": "layers.{moe}.mlp.experts.gate_up_proj",
        "mtp": "mtp.0.e_proj.weight",
    },
}


@dataclass(frozen=True)
class StoredBase:
    """The form of each weight kind (KINDS) a stored base holds quantized; kinds left out are held dense."""

    forms: tuple[tuple[str, Form], ...]
    mtp: bool = True
    """Whether the MTP modules' weights are held stored too (not when they train: --train_mtp)."""

    def of(self, kind: str) -> Form | None:
        return dict(self.forms).get(kind)

    def block(
        self, cfg: Any, tp: int, ep: int, moe: bool, indexer: bool
    ) -> tuple[list[tuple[int, int]], int]:
        """A block's weights held stored on a rank: ((elements, bytes) of each stored linear, bytes of its
        routed experts)."""
        return self.linears(cfg, block_matrices(cfg, tp, moe, indexer), ep if moe else 0)

    def linears(
        self, cfg: Any, matrices: list[tuple[str, int, int]], ep: int
    ) -> tuple[list[tuple[int, int]], int]:
        """`block` of a block's (kind, rows, columns) linears, and its routed experts on a rank of
        expert-parallel size `ep` (0: none)."""
        stored = []
        for kind, rows, cols in matrices:
            form = self.of(kind)
            if form is not None:
                stored.append((rows * cols, form.nbytes(rows, cols)))
        form = self.of("experts")
        if not (ep and form is not None):
            return stored, 0
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        return stored, (cfg.n_routed_experts // ep) * (2 * form.nbytes(inter, d) + form.nbytes(d, inter))

    def dequantized(
        self, stored: list[tuple[int, int]], experts: int, each: int, a: int
    ) -> tuple[int, int, int]:
        """-> (the largest stored linear's peak while dequantized, the routed experts' dense gate_up and down
        held while they run forward and backward, their peak while dequantized: gate_up whole and down's fp32
        temporaries), for a block's `stored` linears and `experts` stored experts of `each` elements per matrix,
        `a` bytes an element. model/common/stored.py dequantizes a weight through fp32 then the compute dtype;
        the experts a group at a time (EXPERT_CHUNK_BYTES of fp32): gate, up, their concatenation, then down."""
        linear = max((e for e, _ in stored), default=0) * max(f.peak for _, f in self.forms)
        form = self.of("experts")
        if not experts or form is None:
            return linear, 0, 0
        per = min(experts, max(1, EXPERT_CHUNK_BYTES // (3 * each * 4))) * each  # a group's gate (up, down)
        return linear, 3 * per * a, per * (2 * a + form.peak)

    def describe(self) -> str:
        by_form: dict[str, list[str]] = {}
        for kind, form in self.forms:
            if kind != "mtp" or self.mtp:
                by_form.setdefault(form.label, []).append(kind)
        return "; ".join(f"{label} ({', '.join(kinds)})" for label, kinds in by_form.items())


def planned_base(plan: RunPlan, quant: dict[str, Any] | None = None) -> StoredBase | None:
    """The stored base of a run: the weights its folder's quantization keys (or `quant`, a preset's release's)
    quantize, less those that train (the indexers unless --dsa_stage frozen, the MTP modules under
    --train_mtp): store_base stores frozen weights only."""
    from dstrain.model import family_of

    cfg = plan.model
    base = stored_base(cfg, quantization_of(cfg) if quant is None else quant, family_of(cfg))
    if base is None:
        return None
    indexer_trains = cfg.sparse_attention and plan.opts.model.dsa_stage != "frozen"
    forms = tuple((k, f) for k, f in base.forms if not (k == "indexer" and indexer_trains))
    return StoredBase(forms, mtp=not plan.opts.lora.train_mtp)


def quantization_of(cfg: Any) -> dict[str, Any]:
    """A folder config's quantization keys: its own (`extra`) or those of the multimodal config around it."""
    outer = (getattr(cfg, "hf_source", None) or {}).get("outer") or {}
    extra = getattr(cfg, "extra", {}) or {}
    return {k: extra.get(k, outer.get(k)) for k in QUANT_KEYS if extra.get(k, outer.get(k)) is not None}


def stored_base(cfg: Any, quant: dict[str, Any], family: Any) -> StoredBase | None:
    """The stored base of a model `cfg` of `family` whose release has the quantization keys `quant`; None when
    they quantize none of its weights. ConfigError for a quantization_config the planner does not size."""
    q = quant.get("quantization_config") or {}
    if not q:
        return None
    names = _module_names(cfg, family)
    method = q.get("quant_method")
    if method == "fp8":
        block = list(q.get("weight_block_size") or [FP8_BLOCK, FP8_BLOCK])
        if block != [FP8_BLOCK, FP8_BLOCK]:
            raise ConfigError(
                f"quantization_config weight_block_size {block}: dstrain reads 128x128 FP8 blocks"
            )
        form = FP8_E8M0 if q.get("scale_fmt") == "ue8m0" else FP8
        # transformers' fine-grained FP8 converts every linear but those named here
        skip = list(q.get("modules_to_not_convert") or [])
        forms = {k: form for k, name in names.items() if not any(s in name for s in skip)}
        if quant.get("expert_dtype") == "fp4":
            forms["experts"] = FP4
    elif method == "compressed-tensors":
        forms = _compressed(q, names)
    else:
        raise ConfigError(
            f"quantization_config quant_method {method!r}: dstrain plan sizes fp8 and compressed-tensors stored "
            "bases; plan with --base_precision bf16"
        )
    return StoredBase(tuple(forms.items())) if forms else None


def _compressed(q: dict[str, Any], names: dict[str, str]) -> dict[str, Form]:
    """compressed-tensors: each config group's weights on the linears its targets name, but the ignored."""
    ignore = list(q.get("ignore") or [])
    forms: dict[str, Form] = {}
    for group in (q.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        if "Linear" not in (group.get("targets") or []) or w.get("type") != "int":
            raise ConfigError(
                f"quantization_config group {group}: dstrain plan sizes integer weights of Linear targets"
            )
        form = packed(int(w["num_bits"]), w.get("group_size") if w.get("strategy") == "group" else None)
        for kind, name in names.items():
            if not any(_matches(pattern, name) for pattern in ignore):
                forms.setdefault(kind, form)
    return forms


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def _module_names(cfg: Any, family: Any) -> dict[str, str]:
    """The Hugging Face module name of each kind's weight (the family's key table, on shapes alone)."""
    is_moe = getattr(cfg, "is_moe_layer", lambda i: True)  # a DeepSeek-V4 layer is always MoE
    moe = next((i for i in range(cfg.num_hidden_layers) if is_moe(i)), 0)
    has = {
        "indexer": cfg.sparse_attention,
        "mlp": not is_moe(0),
        "mtp": cfg.num_nextn_predict_layers,
    }
    out = {}
    types = getattr(cfg, "layer_types", None) or []
    csa = next((i for i, t in enumerate(types) if t == "compressed_sparse_attention"), moe)
    for kind, template in FAMILY_KINDS.get(family.name, KINDS).items():
        if not has.get(kind, True):
            continue
        key = template.format(moe=moe, csa=csa)
        shape = (cfg.n_routed_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
        t = torch.empty(shape if kind == "experts" else (1, 1), device="meta")
        try:
            hf_key = next(iter(family.to_hf([(key, t)], cfg, None)))[0]
        except (KeyError, ValueError, StopIteration):
            continue  # a kind this model lacks
        out[kind] = hf_key.removesuffix(".weight")
    return out


def block_matrices(cfg: Any, tp: int, moe: bool, indexer: bool) -> list[tuple[str, int, int]]:
    """(kind, rows, columns) of a DeepSeek-V3 block's linears as a rank of tensor-parallel size `tp` holds them
    (KINDS)."""
    h, d = cfg.num_attention_heads // tp, cfg.hidden_size
    rq, rkv = cfg.q_lora_rank, cfg.kv_lora_rank
    q = [(h * cfg.qk_head_dim, d)] if rq is None else [(rq, d), (h * cfg.qk_head_dim, rq)]
    kv = [
        (rkv + cfg.qk_rope_head_dim, d),
        (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), rkv),
        (d, h * cfg.v_head_dim),
    ]
    out = [("attention", r, k) for r, k in q + kv]
    if indexer:  # wq_b and wk (the head weights stay bf16 in the releases)
        out += [("indexer", cfg.index_n_heads * cfg.index_head_dim, rq), ("indexer", cfg.index_head_dim, d)]
    width, kind = (
        (cfg.moe_intermediate_size * cfg.n_shared_experts, "shared")
        if moe
        else (cfg.intermediate_size, "mlp")
    )
    if width:
        out += [(kind, width // tp, d)] * 2 + [(kind, d, width // tp)]
    return out
