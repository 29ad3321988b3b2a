"""Kimi Linear configuration: transformers' `KimiLinearConfig` field names, read from config.json as Moonshot
publishes it (`linear_attn_config` with 1-indexed `kda_layers` / `full_attn_layers`, `num_experts`,
`num_experts_per_token`, `moe_renormalize`, ...) or as transformers writes it, and written back in the form it
came in (only the keys of changed fields rewritten)."""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from ..common.config import TRAINING_FIELDS, config_from_folder
from ..common.kda import CHUNK

MODEL_TYPE = "kimi_linear"
ARCHITECTURE = "KimiLinearForCausalLM"
KDA, MLA = "linear_attention", "full_attention"
DENSE, SPARSE = "dense", "sparse"
# field -> the config.json keys it is read from, the first being the one a new file is written with
# (transformers' attribute_map names, which it writes and Moonshot's files use).
ALIASES: dict[str, tuple[str, ...]] = {
    "num_local_experts": ("num_experts", "num_local_experts"),
    "num_experts_per_tok": ("num_experts_per_token", "num_experts_per_tok"),
    "n_shared_experts": ("num_shared_experts", "n_shared_experts"),
    "n_group": ("num_expert_group", "n_group"),
    "norm_topk_prob": ("moe_renormalize", "norm_topk_prob"),
    "max_position_embeddings": ("model_max_length", "max_position_embeddings"),
}
# field -> its key inside `linear_attn_config` (which transformers reads before the flat key)
LINEAR_KEYS = {"linear_head_dim": "head_dim", "linear_num_heads": "num_heads", "linear_conv_kernel_dim": "short_conv_kernel_size"}  # fmt: skip
# config.json keys with one meaning in Kimi Linear: kept as the file has them, another value refused
FIXED = {
    "hidden_act": "silu",
    "mla_use_nope": True,
    "moe_router_activation_func": "sigmoid",
    "moe_layer_freq": 1,
}
# 0 in the published files; transformers builds no MTP for this model
_NOT_BUILT = ("num_nextn_predict_layers",)
SIMPLE = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
    "qk_nope_head_dim", "v_head_dim", "topk_group", "routed_scaling_factor", "rms_norm_eps", "initializer_range",
    "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_id", "pad_token_id", "aux_loss_alpha",
)  # fmt: skip
# keys derived from fields, rewritten when present (transformers writes them)
DERIVED = ("qk_head_dim", "layer_types", "mlp_layer_types", "first_k_dense_replace", "linear_attn_config",
           *LINEAR_KEYS, *(k for keys in ALIASES.values() for k in keys))  # fmt: skip
_STRUCTURE = ("layer_types", "mlp_layer_types", *LINEAR_KEYS)


@dataclass
class KimiLinearConfig:
    """Architecture of a Kimi Linear model: KDA layers and NoPE MLA layers (`layer_types`), a dense MLP or a
    V3-style MoE per layer (`mlp_layer_types`). Defaults: transformers' KimiLinearConfig's."""

    vocab_size: int = 163840
    hidden_size: int = 2304
    intermediate_size: int = 9216
    """Hidden width of the dense MLP layers."""
    moe_intermediate_size: int = 1024
    """Hidden width of one routed expert (the shared experts: times n_shared_experts)."""
    num_hidden_layers: int = 27
    num_attention_heads: int = 32
    """MLA heads."""
    num_key_value_heads: int = 32
    """Must equal num_attention_heads (MLA expands its latent into one key and value per head)."""
    kv_lora_rank: int = 512
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 64
    """The shared key part of MLA that other DeepSeek models rotate; Kimi Linear applies no rotation (NoPE)."""
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    num_local_experts: int = 256
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.446
    linear_head_dim: int = 128
    """KDA head dimension (queries, keys, values and the per-channel forget gate)."""
    linear_num_heads: int = 32
    linear_conv_kernel_dim: int = 4
    """Taps of KDA's short causal convolutions."""
    layer_types: list[str] | None = None
    """Per layer: "linear_attention" (KDA) or "full_attention" (MLA); None: transformers' default (MLA at
    every 4th layer past the first)."""
    mlp_layer_types: list[str] | None = None
    """Per layer: "dense" or "sparse" (MoE); None: the first `first_k_dense_replace` (1) dense."""
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = 163584
    eos_token_id: int | list[int] | None = 163586
    pad_token_id: int | None = 163839
    aux_loss_alpha: float = 1e-4
    """α of the sequence-wise balance loss (training only)."""
    bias_update_speed: float = 1e-3
    """γ of aux-loss-free balancing (training only)."""
    mtp_loss_weight: float = 0.3
    """No MTP in Kimi Linear; kept for the training fields every family has."""
    extra: dict[str, Any] = field(default_factory=dict)
    """config.json keys dstrain does not interpret, written back unchanged."""
    hf_source: dict[str, Any] | None = field(default=None, compare=False)
    """The config.json this came from ({"config": the dict, "folder", "dense_prefix"}): to_hf_dict writes it
    back, rewriting only the keys of changed fields."""

    model_type = MODEL_TYPE
    num_nextn_predict_layers = 0  # no MTP
    # what the shared router and experts read (common/layers.py)
    scoring_func, topk_method, uses_expert_bias = "sigmoid", "noaux_tc", True

    def __post_init__(self) -> None:
        self._check_sizes()
        n = self.num_hidden_layers
        types = default_layer_types(n) if self.layer_types is None else list(self.layer_types)
        if len(types) != n or set(types) - {KDA, MLA}:
            raise ValueError(f"layer_types: one of {KDA!r}, {MLA!r} per layer ({n}), got {types!r}")
        mlp = default_mlp_layer_types(n, 1) if self.mlp_layer_types is None else list(self.mlp_layer_types)
        if len(mlp) != n or set(mlp) - {DENSE, SPARSE}:
            raise ValueError(f"mlp_layer_types: one of {DENSE!r}, {SPARSE!r} per layer ({n}), got {mlp!r}")
        self.layer_types, self.mlp_layer_types = types, mlp
        for name in TRAINING_FIELDS:
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")

    def _check_sizes(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "num_local_experts",
                     "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "n_group", "topk_group"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.qk_rope_head_dim < 0 or self.n_shared_experts < 0:
            raise ValueError("qk_rope_head_dim and n_shared_experts must be >= 0")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads}: MLA has one key and value per head "
                f"(num_attention_heads={self.num_attention_heads})"
            )
        if not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..{self.num_local_experts}"
            )
        if self.num_local_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(
                f"n_group={self.n_group} must divide the experts and hold topk_group={self.topk_group}"
            )

    # ----------------------------------------------------------------- what the shared code reads
    @property
    def n_routed_experts(self) -> int:
        return self.num_local_experts

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def wrapper(self) -> None:
        """No multimodal checkpoint wraps a Kimi Linear text model."""
        return None

    @property
    def sparse_attention(self) -> bool:
        return False

    @property
    def is_moe(self) -> bool:
        return SPARSE in self.mlp_layer_types

    @property
    def attention_kernel(self) -> str:
        """What runs the attention layers (dstrain env, a run's first lines)."""
        return (
            f"KDA: chunked delta rule in torch ({CHUNK}-token chunks, fp32 state), flash-linear-attention's "
            "chunk_kda on a GPU where installed (dstrain env); MLA: dstrain's attention kernels"
        )

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.mlp_layer_types[layer_idx] == SPARSE

    def is_kda_layer(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == KDA

    def replace(self, **changes: Any) -> KimiLinearConfig:
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------- config.json
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> KimiLinearConfig:
        """A kimi_linear config.json as Moonshot or transformers writes it; keys it leaves out take
        transformers' defaults, and transformers' precedence holds (`linear_attn_config` over the flat
        `linear_*` keys; `layer_types`, then its layer lists, then the default schedule)."""
        if d.get("model_type") != MODEL_TYPE:
            raise ValueError(
                f"config.json model_type={d.get('model_type')!r}: {cls.__name__} reads {MODEL_TYPE}"
            )
        if d.get("architectures") not in (None, [], [ARCHITECTURE]):
            raise ValueError(f"config.json architectures={d['architectures']!r}: expected [{ARCHITECTURE!r}]")
        for key, value in FIXED.items():
            if d.get(key, value) != value:
                raise ValueError(f"config.json {key}={d[key]!r}: Kimi Linear is built with {key}={value!r}")
        for key in _NOT_BUILT:
            if d.get(key):
                raise ValueError(f"config.json {key}={d[key]!r}: Kimi Linear's MTP layers are not built")
        linear = d.get("linear_attn_config") or {}
        if linear.get("gate_lower_bound") is not None:
            raise ValueError(
                "config.json linear_attn_config.gate_lower_bound: transformers' Kimi Linear has no bounded "
                "forget gate (GLM-5.3-Flash's form); refusing rather than ignoring it"
            )
        kwargs: dict[str, Any] = {k: d[k] for k in SIMPLE if k in d}
        for name, keys in ALIASES.items():
            found = [k for k in keys if k in d]
            if found:
                kwargs[name] = d[found[0]]
        for name, sub in LINEAR_KEYS.items():
            if sub in linear or name in d:
                kwargs[name] = linear.get(sub, d.get(name))
        n = kwargs.get("num_hidden_layers", cls.num_hidden_layers)
        if d.get("layer_types") is not None:
            kwargs["layer_types"] = d["layer_types"]
        elif "full_attn_layers" in linear and "kda_layers" in linear:
            kwargs["layer_types"] = _types_from_lists(linear, n)
        if d.get("mlp_layer_types") is not None:
            kwargs["mlp_layer_types"] = d["mlp_layer_types"]
        else:
            kwargs["mlp_layer_types"] = default_mlp_layer_types(n, d.get("first_k_dense_replace", 1))
        if kwargs.get("num_key_value_heads") is None:
            kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", cls.num_attention_heads)
        kwargs["extra"] = {k: v for k, v in d.items() if k not in _read_keys()}
        kwargs["hf_source"] = {"config": copy.deepcopy(d)}
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json this came from with the keys of changed fields rewritten (keys it lacked added in
        the published form); made in code: the published form, which transformers reads."""
        source = (self.hf_source or {}).get("config")
        if source is None:
            out = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **FIXED}
            out.update({k: getattr(self, k) for k in SIMPLE})
            out.update({keys[0]: getattr(self, name) for name, keys in ALIASES.items()})
            out["first_k_dense_replace"] = self._first_dense()
            out["linear_attn_config"] = self._linear_attn_config({})
            if self.mlp_layer_types != default_mlp_layer_types(self.num_hidden_layers, self._first_dense()):
                out["mlp_layer_types"] = list(self.mlp_layer_types)
            out.update(self.extra)
            return out
        base = KimiLinearConfig.from_hf_dict(source)
        changed = {f.name for f in dataclasses.fields(self) if f.name not in ("extra", "hf_source")
                   and getattr(self, f.name) != getattr(base, f.name)}  # fmt: skip
        out = copy.deepcopy(source)
        for name in changed & set(SIMPLE):
            out[name] = getattr(self, name)
        for name in changed & set(ALIASES):
            out[next((k for k in ALIASES[name] if k in source), ALIASES[name][0])] = getattr(self, name)
        if changed & set(_STRUCTURE):
            self._write_structure(out, source)
        if "qk_head_dim" in out:
            out["qk_head_dim"] = self.qk_head_dim
        for k in [k for k in out if k not in _read_keys() and k not in self.extra]:
            del out[k]  # an extra key dropped since
        out.update(self.extra)
        return out

    def _write_structure(self, out: dict[str, Any], source: dict[str, Any]) -> None:
        """The layer schedules and KDA sizes, under every key the source stated them with."""
        out["linear_attn_config"] = self._linear_attn_config(source.get("linear_attn_config") or {})
        for name in LINEAR_KEYS:
            if name in source:
                out[name] = getattr(self, name)
        if "layer_types" in source:
            out["layer_types"] = list(self.layer_types)
        if "mlp_layer_types" in source or self.mlp_layer_types != default_mlp_layer_types(
            self.num_hidden_layers, source.get("first_k_dense_replace", 1)
        ):
            out["mlp_layer_types"] = list(self.mlp_layer_types)

    def _linear_attn_config(self, old: dict[str, Any]) -> dict[str, Any]:
        new = dict(old)
        new.update({sub: getattr(self, name) for name, sub in LINEAR_KEYS.items()})
        new["kda_layers"] = [i + 1 for i, t in enumerate(self.layer_types) if t == KDA]
        new["full_attn_layers"] = [i + 1 for i, t in enumerate(self.layer_types) if t == MLA]
        return new

    def _first_dense(self) -> int:
        return next((i for i, t in enumerate(self.mlp_layer_types) if t != DENSE), self.num_hidden_layers)

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> KimiLinearConfig:
        return config_from_folder(cls, path)


def _read_keys() -> set[str]:
    """Every config.json key the config reads (the rest are `extra`)."""
    return {"model_type", "architectures", *FIXED, *_NOT_BUILT, *SIMPLE, *DERIVED}


def _types_from_lists(linear: dict[str, Any], n: int) -> list[str]:
    types: list[str | None] = [None] * n
    for kind, key in ((MLA, "full_attn_layers"), (KDA, "kda_layers")):
        for layer in linear[key]:
            if not 1 <= layer <= n:
                raise ValueError(f"config.json linear_attn_config.{key}: layer {layer} outside 1..{n}")
            types[layer - 1] = kind
    if None in types:
        raise ValueError(f"config.json linear_attn_config: layer {types.index(None) + 1} is in neither list")
    return types  # type: ignore[return-value]


def default_layer_types(n: int) -> list[str]:
    """transformers' schedule when the file gives none: MLA at layers 4, 8, ... (0-indexed), KDA elsewhere."""
    return [MLA if i and i % 4 == 0 else KDA for i in range(n)]


def default_mlp_layer_types(n: int, first_k_dense_replace: int) -> list[str]:
    return [DENSE if i < first_k_dense_replace else SPARSE for i in range(n)]
