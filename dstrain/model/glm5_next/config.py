"""GLM-5.3-Flash configuration: transformers' `Glm5NextTextConfig` field names, read from config.json as
transformers writes it (the multimodal `glm5_next` form, the text model's fields under `text_config` beside
`vision_config`) or flat (the text fields at the top level, `glm5_next` or `glm5_next_text`), with transformers'
precedence for the derived schedules (`indexer_types`, then `index_topk_pattern`, then `index_topk_freq` /
`index_skip_topk_offset`; `linear_attn_config` over the flat `linear_*` keys), and written back in the form it
came in (only the keys of changed fields rewritten)."""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from ..common.config import TRAINING_FIELDS, config_from_folder
from ..common.kda import CHUNK

MODEL_TYPE, TEXT_TYPE = "glm5_next", "glm5_next_text"
ARCHITECTURE = "Glm5NextForConditionalGeneration"
KDA, DSA = "linear_attention", "indexed_attention"
DENSE, SPARSE = "dense", "sparse"
FULL, SHARED = "full", "shared"
# field -> the config.json keys it is read from, the first the one a new file is written with
ALIASES: dict[str, tuple[str, ...]] = {"n_routed_experts": ("n_routed_experts", "num_local_experts")}
# field -> its key inside `linear_attn_config` (which transformers reads over the flat key)
LINEAR_KEYS = {"linear_head_dim": "head_dim", "linear_num_heads": "num_heads",
               "linear_conv_kernel_dim": "short_conv_kernel_size", "linear_lower_bound": "gate_lower_bound"}  # fmt: skip
SIMPLE = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "n_shared_experts", "routed_scaling_factor", "kv_lora_rank",
    "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group",
    "num_experts_per_tok", "norm_topk_prob", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "attention_bias", "index_topk",
    "index_head_dim", "index_n_heads", "swiglu_limit", "hc_mult", "hc_eps", "hc_sinkhorn_iters",
    "router_aux_loss_coef", "index_kpool", "index_kpool_always_select_tail", "num_nextn_predict_layers",
    "aux_loss_alpha",
)  # fmt: skip
_STRUCTURE = ("layer_types", "mlp_layer_types", "indexer_types", *LINEAR_KEYS)
# keys transformers derives (rewritten from the fields where present) or ignores
DERIVED = ("head_dim", "qk_head_dim", "linear_attn_config", "index_topk_pattern", "index_topk_freq",
           "index_skip_topk_offset", *_STRUCTURE, *(k for keys in ALIASES.values() for k in keys))  # fmt: skip
FIXED = {"hidden_act": "silu"}


@dataclass
class Glm5NextConfig:
    """The text model of GLM-5.3-Flash: KDA layers and DSA (NoPE MLA + k-pool indexer) layers (`layer_types`),
    mHC residual streams, a dense or routed feed-forward per layer (`mlp_layer_types`), MTP. Defaults:
    transformers' Glm5NextTextConfig's (the published shape), one MTP layer."""

    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 288
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 1536
    qk_rope_head_dim: int = 0
    """Must be 0: the DSA layers apply no rotary embedding (NoPE)."""
    v_head_dim: int = 256
    qk_nope_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    max_position_embeddings: int = 1048576
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = 154820
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    index_topk: int = 2048
    """Keys each query attends in a DSA layer: index_topk / index_kpool whole k-pools (plus the tail)."""
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    """Tokens per k-pool: the indexer scores pools (a learned gated average of their keys), not tokens."""
    index_kpool_always_select_tail: bool = True
    """Every query also attends its own incomplete pool's tokens (only True is built)."""
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    """KDA's bounded forget gate g = L sigmoid(exp(A_log) x) in (L, 0); None: Kimi's softplus form."""
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    router_aux_loss_coef: float = 0.001
    """transformers' Switch-style balance coefficient (inference only there; dstrain trains with aux_loss_alpha)."""
    layer_types: list[str] | None = None
    """Per layer: "linear_attention" (KDA) or "indexed_attention" (DSA); None: DSA at every 4th layer (3, 7..)."""
    mlp_layer_types: list[str] | None = None
    """Per layer: "dense" or "sparse"; None: the first 3 dense."""
    indexer_types: list[str] | None = None
    """Per layer: "full" (a DSA layer with its own indexer) or "shared" (the previous full DSA layer's
    selection); None: every layer full. KDA layers' entries are not read. MTP blocks are full."""
    num_nextn_predict_layers: int = 1
    aux_loss_alpha: float = 1e-4
    """α of the sequence-wise balance loss (training only)."""
    bias_update_speed: float = 1e-3
    """γ of aux-loss-free balancing (training only)."""
    mtp_loss_weight: float = 0.3
    extra: dict[str, Any] = field(default_factory=dict)
    """config.json keys dstrain does not interpret (of the text part), written back unchanged."""
    hf_source: dict[str, Any] | None = field(default=None, compare=False)
    """The config.json this came from ({"config": the dict, "folder"}): to_hf_dict rewrites only changed keys."""

    model_type = MODEL_TYPE
    # what the shared router and experts read (common/layers.py)
    scoring_func, topk_method, uses_expert_bias = "sigmoid", "noaux_tc", True

    def __post_init__(self) -> None:
        self._check_sizes()
        n = self.num_hidden_layers
        types = default_layer_types(n) if self.layer_types is None else list(self.layer_types)
        types = [DSA if t == "full_attention" else t for t in types]  # transformers' older name
        if len(types) != n or set(types) - {KDA, DSA}:
            raise ValueError(f"layer_types: one of {KDA!r}, {DSA!r} per layer ({n}), got {types!r}")
        mlp = default_mlp_layer_types(n) if self.mlp_layer_types is None else list(self.mlp_layer_types)
        if len(mlp) != n or set(mlp) - {DENSE, SPARSE}:
            raise ValueError(f"mlp_layer_types: one of {DENSE!r}, {SPARSE!r} per layer ({n}), got {mlp!r}")
        idx = [FULL] * n if self.indexer_types is None else list(self.indexer_types)
        if len(idx) != n or set(idx) - {FULL, SHARED}:
            raise ValueError(f"indexer_types: one of {FULL!r}, {SHARED!r} per layer ({n}), got {idx!r}")
        first = next((i for i, t in enumerate(types) if t == DSA), None)
        if first is not None and idx[first] != FULL:
            raise ValueError(
                f"indexer_types[{first}]: the first DSA layer must be 'full' (shared ones reuse it)"
            )
        self.layer_types, self.mlp_layer_types, self.indexer_types = types, mlp, idx
        for name in TRAINING_FIELDS:
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")

    def _check_sizes(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim",
                     "n_routed_experts", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "n_group",
                     "topk_group", "index_topk", "index_head_dim", "index_n_heads", "index_kpool", "hc_mult",
                     "hc_sinkhorn_iters"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.qk_rope_head_dim != 0:
            raise ValueError(
                f"qk_rope_head_dim={self.qk_rope_head_dim}: GLM-5.3-Flash's DSA layers are NoPE (0)"
            )
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads}: MLA has one key and value per head "
                f"(num_attention_heads={self.num_attention_heads})"
            )
        if self.index_topk % self.index_kpool:
            raise ValueError(
                f"index_topk={self.index_topk} must be a multiple of index_kpool={self.index_kpool}"
            )
        if not self.index_kpool_always_select_tail:
            raise ValueError(
                "index_kpool_always_select_tail=False is not built (the published model selects it)"
            )
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..{self.n_routed_experts}"
            )
        if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(
                f"n_group={self.n_group} must divide the experts and hold topk_group={self.topk_group}"
            )
        if self.n_shared_experts < 0 or self.num_nextn_predict_layers < 0:
            raise ValueError("n_shared_experts and num_nextn_predict_layers must be >= 0")

    # ----------------------------------------------------------------- what the shared code reads
    @property
    def num_local_experts(self) -> int:
        return self.n_routed_experts

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def wrapper(self) -> None:
        """The vision tower is carried by `copied_tensors` (state_dict.py), not through a V3 wrapper."""
        return None

    @property
    def sparse_attention(self) -> bool:
        return DSA in self.layer_types

    @property
    def is_moe(self) -> bool:
        return True

    @property
    def attention_kernel(self) -> str:
        return (f"KDA: chunked delta rule in torch ({CHUNK}-token chunks, fp32 state), flash-linear-attention's "
                "chunk_kda on a GPU where installed; DSA: torch k-pool indexer, dstrain's attention kernels over "
                "the selected keys")  # fmt: skip

    def is_kda_layer(self, layer_idx: int) -> bool:
        """Layer `layer_idx` is KDA (MTP blocks, >= num_hidden_layers, are DSA)."""
        return layer_idx < self.num_hidden_layers and self.layer_types[layer_idx] == KDA

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.num_hidden_layers or self.mlp_layer_types[layer_idx] == SPARSE

    def has_indexer(self, layer_idx: int) -> bool:
        """A DSA layer (MTP blocks included) that runs its own k-pool indexer."""
        if self.is_kda_layer(layer_idx):
            return False
        return layer_idx >= self.num_hidden_layers or self.indexer_types[layer_idx] == FULL

    def indexer_source(self, layer_idx: int) -> int:
        """The layer whose selection DSA layer `layer_idx` attends with: itself, or for a shared layer the
        previous full DSA layer (across the KDA layers between them)."""
        while not self.has_indexer(layer_idx):
            layer_idx -= 1
        return layer_idx

    def replace(self, **changes: Any) -> Glm5NextConfig:
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------- config.json
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Glm5NextConfig:
        """A glm5_next config.json (nested `text_config` or flat) or a glm5_next_text one; keys it leaves out
        take transformers' defaults (`num_nextn_predict_layers`, which transformers does not read: 0)."""
        if d.get("model_type") not in (MODEL_TYPE, TEXT_TYPE):
            raise ValueError(
                f"config.json model_type={d.get('model_type')!r}: {cls.__name__} reads {MODEL_TYPE}"
            )
        text = d.get("text_config") if d.get("model_type") == MODEL_TYPE else None
        text = d if text is None else text
        for key, value in FIXED.items():
            if text.get(key, value) != value:
                raise ValueError(
                    f"config.json {key}={text[key]!r}: GLM-5.3-Flash is built with {key}={value!r}"
                )
        kwargs: dict[str, Any] = {k: text[k] for k in SIMPLE if k in text}
        kwargs.setdefault("num_nextn_predict_layers", 0)
        for name, keys in ALIASES.items():
            found = [k for k in keys if k in text]
            if found:
                kwargs[name] = text[found[0]]
        linear = text.get("linear_attn_config") or {}
        for name, sub in LINEAR_KEYS.items():
            if sub in linear:
                kwargs[name] = linear[sub]
            elif name in text:
                kwargs[name] = text[name]
        if linear and linear.get("safe_gate", True) and kwargs.get("linear_lower_bound", -5.0) is None:
            kwargs["linear_lower_bound"] = -5.0  # transformers: a safe gate without a bound takes -5
        n = kwargs.get("num_hidden_layers", cls.num_hidden_layers)
        for name in ("layer_types", "mlp_layer_types"):
            if text.get(name) is not None:
                kwargs[name] = text[name]
        kwargs["indexer_types"] = _indexer_types(text, n)
        if kwargs.get("num_key_value_heads") is None:
            kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", cls.num_attention_heads)
        kwargs["extra"] = {k: v for k, v in text.items() if k not in _read_keys() and k != "text_config"}
        kwargs["hf_source"] = {"config": copy.deepcopy(d)}
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json this came from with the keys of changed fields rewritten; made in code: the flat
        text-only form (`glm5_next`, which transformers reads into `text_config`)."""
        source = (self.hf_source or {}).get("config")
        if source is None:
            out = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **FIXED}
            out.update({k: getattr(self, k) for k in SIMPLE})
            out.update({keys[0]: getattr(self, name) for name, keys in ALIASES.items()})
            out.update(
                {
                    name: list(getattr(self, name))
                    for name in ("layer_types", "mlp_layer_types", "indexer_types")
                }
            )
            out.update({name: getattr(self, name) for name in LINEAR_KEYS})
            out.update(self.extra)
            return out
        out = copy.deepcopy(source)
        nested = source.get("model_type") == MODEL_TYPE and isinstance(source.get("text_config"), dict)
        text = out["text_config"] if nested else out
        base = Glm5NextConfig.from_hf_dict(source)
        changed = {f.name for f in dataclasses.fields(self) if f.name not in ("extra", "hf_source")
                   and getattr(self, f.name) != getattr(base, f.name)}  # fmt: skip
        for name in changed & set(SIMPLE):
            text[name] = getattr(self, name)
        for name in changed & set(ALIASES):
            text[next((k for k in ALIASES[name] if k in text), ALIASES[name][0])] = getattr(self, name)
        for name in changed & set(_STRUCTURE):
            if name in LINEAR_KEYS and isinstance(text.get("linear_attn_config"), dict):
                text["linear_attn_config"][LINEAR_KEYS[name]] = getattr(self, name)
            value = getattr(self, name)
            text[name] = list(value) if isinstance(value, list) else value
        for k in [k for k in text if k not in _read_keys() and k not in self.extra and k != "text_config"]:
            del text[k]  # an extra key dropped since
        text.update(self.extra)
        return out

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> Glm5NextConfig:
        return config_from_folder(cls, path)


# the outer (multimodal) config's own keys, kept where they are
_OUTER = ("model_type", "architectures", "vision_config", "image_token_id", "video_token_id", "image_start_token_id",
          "image_end_token_id", "video_start_token_id", "video_end_token_id", "transformers_version", "dtype",
          "torch_dtype")  # fmt: skip


def _read_keys() -> set[str]:
    """Every config.json key the config reads or keeps in place (the rest are `extra`)."""
    return {*_OUTER, *FIXED, *SIMPLE, *DERIVED}


def _indexer_types(text: dict[str, Any], n: int) -> list[str]:
    """transformers' per-layer indexer modes: `indexer_types`, else `index_topk_pattern` ("FSS.." or a list),
    else every `index_topk_freq`-th layer full counting from `index_skip_topk_offset`."""
    if text.get("indexer_types") is not None:
        return list(text["indexer_types"])
    pattern = text.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            if set(pattern) - {"F", "S"}:
                raise ValueError(
                    f"config.json index_topk_pattern={pattern!r}: letters F (full) and S (shared)"
                )
            return [{"F": FULL, "S": SHARED}[c] for c in pattern]
        return list(pattern)
    freq = max(int(text.get("index_topk_freq", 1)), 1)
    offset = int(text.get("index_skip_topk_offset", 2))
    return [FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(n)]


def default_layer_types(n: int) -> list[str]:
    """transformers' schedule: DSA at layers 3, 7, 11, ... (0-indexed), KDA elsewhere (3:1)."""
    return [DSA if i % 4 == 3 else KDA for i in range(n)]


def default_mlp_layer_types(n: int) -> list[str]:
    return [DENSE] * min(3, n) + [SPARSE] * max(n - 3, 0)
