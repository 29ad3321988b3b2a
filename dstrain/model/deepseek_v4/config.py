"""DeepSeek-V4 configuration: V4Config with Hugging Face field names, read from both config.json forms
(DeepSeek's own and transformers') and written back in the form it came in."""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import Any

from ..common.config import DEEPSEEK_V3_VOCAB, TRAINING_FIELDS, config_from_folder

MODEL_TYPE = "deepseek_v4"
ARCHITECTURE = "DeepseekV4ForCausalLM"
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
DEFAULT_NUM_HASH_LAYERS = 3
# DeepSeek's `compress_ratios` (one per layer, main then MTP): 0 is a sliding-window layer; transformers maps
# only these values to a layer type (the rates themselves then come from `compress_rates`).
RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}
TYPE_RATIOS = {t: r for r, t in RATIO_TYPES.items()}
# config.json keys the published weights' quantisation is declared in: an export written dequantized drops
# them (as hf.write_hf_config drops quantization_config); to_hf_dict keeps them.
QUANTIZATION_KEYS = ("quantization_config", "expert_dtype")
# config.json keys with one meaning in DeepSeek-V4: kept as the file has them, any other value refused.
FIXED = {
    "num_key_value_heads": 1,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "hidden_act": "silu",
}
_FIXED_WHY = {
    "num_key_value_heads": "attention has one key/value head (the key is the value)",
    "n_shared_experts": "each MoE layer has one shared expert",
    "scoring_func": "routing scores are sqrt(softplus(logits))",
    "hidden_act": "the experts are SwiGLU (silu)",
}
# Keys with one value whatever the config (written as the source had them, or not at all).
CONSTANT_KEYS = ("model_type", "architectures", *FIXED)
# Which config.json form carries a V4 config: DeepSeek's own (what the published checkpoints ship) or the one
# transformers' DeepseekV4Config writes; a file with neither's own keys reads as transformers'.
TRANSFORMERS_KEYS = (
    "layer_types",
    "mlp_layer_types",
    "compress_rates",
    "rope_parameters",
    "partial_rotary_factor",
)
DEEPSEEK_KEYS = (
    "compress_ratios",
    "num_hash_layers",
    "rope_scaling",
    "compress_rate_csa",
    "compress_rate_hca",
)
# Fields whose config.json key is their own name with the same value.
SIMPLE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "q_lora_rank",
    "qk_rope_head_dim",
    "n_routed_experts",
    "num_experts_per_tok",
    "routed_scaling_factor",
    "rope_theta",
    "compress_rope_theta",
    "hc_mult",
    "hc_sinkhorn_iters",
    "hc_eps",
    "swiglu_limit",
    "sliding_window",
    "o_groups",
    "o_lora_rank",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "num_nextn_predict_layers",
    "rms_norm_eps",
    "initializer_range",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "tie_word_embeddings",
    "aux_loss_alpha",
)
_ROPE = ("rope_theta", "compress_rope_theta", "rope_scaling", "qk_rope_head_dim", "head_dim")
# The fields each derived config.json key is written from: a key is rewritten when one of them changed.
CARRIES: dict[str, set[str]] = {
    **{name: {name} for name in SIMPLE_FIELDS},
    "layer_types": {"layer_types"},
    "mlp_layer_types": {"mlp_layer_types"},
    "mtp_layer_types": {"mtp_layer_types"},
    "compress_rates": {"compress_rates"},
    "compress_rate_csa": {"compress_rates"},
    "compress_rate_hca": {"compress_rates"},
    "compress_ratios": {"layer_types", "mtp_layer_types"},
    "num_hash_layers": {"mlp_layer_types"},
    "rope_scaling": {"rope_scaling"},
    "rope_parameters": set(_ROPE),
    "partial_rotary_factor": {"qk_rope_head_dim", "head_dim"},
}


@functools.cache
def hf_defaults() -> dict[str, Any]:
    """What transformers' DeepseekV4Config gives a field that config.json leaves out."""
    import inspect

    import transformers

    params = inspect.signature(transformers.DeepseekV4Config.__init__).parameters.values()
    base = set(inspect.signature(transformers.PretrainedConfig.__init__).parameters)
    return {
        p.name: p.default
        for p in params
        if p.name not in base
        and p.name not in ("self", "kwargs")
        and p.default is not inspect.Parameter.empty
    }


def default_layer_types(num_hidden_layers: int) -> list[str]:
    """transformers' schedule when a config.json gives neither layer_types nor compress_ratios: HCA, HCA, then
    HCA and CSA alternating from HCA (HCA, HCA, HCA, CSA, HCA, ...)."""
    n = num_hidden_layers
    return [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]


def default_mlp_layer_types(
    num_hidden_layers: int, num_hash_layers: int = DEFAULT_NUM_HASH_LAYERS
) -> list[str]:
    """The first `num_hash_layers` layers route by token id (hash_moe), the others by score (moe)."""
    n = num_hidden_layers
    return ["hash_moe"] * min(n, num_hash_layers) + ["moe"] * max(n - num_hash_layers, 0)


@dataclass
class V4Config:
    """Architecture of a DeepSeek-V4 model (hybrid compressed attention, mHC, hash and sqrtsoftplus MoE, MTP).
    Field names follow Hugging Face `config.json` (transformers' DeepseekV4Config)."""

    vocab_size: int = DEEPSEEK_V3_VOCAB
    """Rows of the embedding and of the output head."""
    hidden_size: int = 64
    """Width of one residual stream (the model carries `hc_mult` of them)."""
    moe_intermediate_size: int = 32
    """Hidden width of one routed expert and of the shared expert."""
    num_hidden_layers: int = 3
    """Transformer blocks of the main model (MTP blocks come on top)."""
    num_attention_heads: int = 4
    """Query heads; all share one key/value head (the key is the value)."""
    head_dim: int = 32
    """Dimension of a query head and of the shared key/value head."""
    q_lora_rank: int = 32
    """Rank of the query compression (its normed output also feeds the lightning indexer)."""
    qk_rope_head_dim: int = 8
    """Rotary dimensions: the last qk_rope_head_dim of each head (and of each indexer head)."""
    n_routed_experts: int = 8
    """Routed experts per MoE layer (every layer is MoE, with one shared expert beside them)."""
    num_experts_per_tok: int = 2
    """Routed experts each token is sent to (top-k; a hash layer's table also holds k experts per token)."""
    routed_scaling_factor: float = 1.5
    """Multiplier on the routed experts' normalised weights."""
    rope_theta: float = 10000.0
    """Rotary base of the sliding-window layers (no scaling)."""
    compress_rope_theta: float = 160000.0
    """Rotary base of the compressed layers (their attention, compressors and indexer), with `rope_scaling`."""
    rope_scaling: dict[str, Any] | None = None
    """None, or the YaRN parameters of the compressed layers' rotary embedding: {"rope_type": "yarn", "factor",
    "original_max_position_embeddings", "beta_fast", "beta_slow"} (V4 applies no YaRN mscale: attention_factor is
    1.0 unless given)."""
    layer_types: list[str] | None = None
    """Per main layer: "sliding_attention" (the window alone), "compressed_sparse_attention" (CSA: the window
    plus the indexer's top-k compressed entries) or "heavily_compressed_attention" (HCA: the window plus every
    visible compressed entry). None: transformers' default schedule (`default_layer_types`)."""
    compress_rates: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_COMPRESS_RATES))
    """Tokens pooled into one compressed entry, per compressed layer type (CSA's windows overlap by one rate)."""
    mlp_layer_types: list[str] | None = None
    """Per main layer: "hash_moe" (experts fixed per token id by a table) or "moe" (sqrtsoftplus scores plus
    the expert bias). None: the first 3 layers hash_moe."""
    mtp_layer_types: list[str] | None = None
    """Attention type of each MTP layer (DeepSeek's `compress_ratios` past the main layers); None, or fewer
    than `num_nextn_predict_layers`: sliding_attention for the rest."""
    hc_mult: int = 2
    """Residual streams of the manifold-constrained hyper-connections (mHC)."""
    hc_sinkhorn_iters: int = 20
    """Sinkhorn-Knopp iterations that make mHC's stream mixing doubly stochastic."""
    hc_eps: float = 1e-6
    """Epsilon of mHC's pre/mixing weights and Sinkhorn normalisations."""
    swiglu_limit: float = 10.0
    """Clamp of the experts' SwiGLU inputs (gate at most L, up within ±L), routed and shared."""
    sliding_window: int = 16
    """Keys of the sliding window, the query's own included."""
    o_groups: int = 2
    """Head groups of the grouped output projection."""
    o_lora_rank: int = 16
    """Per-group rank of the grouped output projection."""
    index_n_heads: int = 8
    """Heads of the lightning indexer (CSA layers)."""
    index_head_dim: int = 16
    """Dimension of an indexer head (its last qk_rope_head_dim dims are rotary)."""
    index_topk: int = 4
    """Compressed entries each query of a CSA layer attends to, chosen by the indexer."""
    num_nextn_predict_layers: int = 1
    """Multi-token-prediction depth (0 = no MTP)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    initializer_range: float = 0.02
    """Std of the normal init of linear and embedding weights."""
    max_position_embeddings: int = 4096
    """Longest sequence the rotary embeddings are configured for."""
    bos_token_id: int | None = 0
    """Beginning-of-sequence token id (written to config.json)."""
    eos_token_id: int | list[int] | None = 1
    """End-of-sequence token id(s) (written to config.json)."""
    pad_token_id: int | None = None
    """Padding token id (written to config.json)."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with the output head."""
    aux_loss_alpha: float = 1e-4
    """α of the sequence-wise balance loss; 0 disables it. Training only (read from config.json if there)."""
    bias_update_speed: float = 1e-3
    """γ of aux-loss-free balancing of the non-hash routers' expert bias; 0 disables. Training only."""
    mtp_loss_weight: float = 0.3
    """λ: weight of the mean MTP loss over depths. Training only."""
    extra: dict[str, Any] = field(default_factory=dict)
    """config.json keys dstrain does not interpret (quantization_config, torch_dtype, ...), written back
    unchanged."""
    hf_source: dict[str, Any] | None = field(default=None, compare=False)
    """The config.json this came from ({"form": "deepseek" or "transformers", "keys": its keys, "config": the
    file's dict; "folder": where it was read, "key_style": its tensor names}): to_hf_dict writes that file back,
    rewriting only the keys of changed fields; None: transformers' form."""

    # not a field: a V4 config has one (code that holds either config class tells them apart by it)
    model_type = MODEL_TYPE

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        for name in (
            "vocab_size",
            "hidden_size",
            "moe_intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "head_dim",
            "q_lora_rank",
            "qk_rope_head_dim",
            "n_routed_experts",
            "sliding_window",
            "o_groups",
            "o_lora_rank",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "hc_mult",
            "hc_sinkhorn_iters",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.qk_rope_head_dim % 2 or self.head_dim % 2:
            raise ValueError(
                f"head_dim={self.head_dim} qk_rope_head_dim={self.qk_rope_head_dim}: both must be even"
            )
        if self.qk_rope_head_dim >= self.head_dim:
            raise ValueError(
                f"qk_rope_head_dim={self.qk_rope_head_dim} must be below head_dim={self.head_dim}"
            )
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError(
                f"index_head_dim={self.index_head_dim} must hold qk_rope_head_dim={self.qk_rope_head_dim} rotary dims"
            )
        if self.num_attention_heads % self.o_groups:
            raise ValueError(
                f"o_groups={self.o_groups} must divide num_attention_heads={self.num_attention_heads}"
            )
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..n_routed_experts={self.n_routed_experts}"
            )
        for name in ("hc_eps", "rms_norm_eps", "swiglu_limit", "routed_scaling_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.num_nextn_predict_layers < 0:
            raise ValueError(f"num_nextn_predict_layers={self.num_nextn_predict_layers} must be >= 0")
        for name in TRAINING_FIELDS:
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        rates = self.compress_rates
        if not isinstance(rates, dict) or set(rates) != {CSA, HCA}:
            raise ValueError(f"compress_rates={rates!r}: expected a rate for {CSA} and {HCA}")
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in rates.values()):
            raise ValueError(f"compress_rates={rates!r}: rates must be positive integers")
        self.compress_rates = dict(rates)
        types = default_layer_types(n) if self.layer_types is None else list(self.layer_types)
        if len(types) != n or set(types) - set(LAYER_TYPES):
            raise ValueError(f"layer_types: one of {LAYER_TYPES} per main layer ({n}), got {types!r}")
        self.layer_types = types
        mlp = default_mlp_layer_types(n) if self.mlp_layer_types is None else list(self.mlp_layer_types)
        if len(mlp) != n or set(mlp) - set(MLP_LAYER_TYPES):
            raise ValueError(f"mlp_layer_types: one of {MLP_LAYER_TYPES} per main layer ({n}), got {mlp!r}")
        self.mlp_layer_types = mlp
        mtp = list(self.mtp_layer_types or [])
        if set(mtp) - set(LAYER_TYPES):
            raise ValueError(f"mtp_layer_types: each one of {LAYER_TYPES}, got {mtp!r}")
        # a file may list more (DeepSeek-V4-Flash-0731's compress_ratios has 3 past the main layers for 1 MTP
        # layer): kept as written
        self.mtp_layer_types = mtp + [SLIDING] * (self.num_nextn_predict_layers - len(mtp))
        self.rope_scaling = _normalised_scaling(self.rope_scaling)
        for key in CONSTANT_KEYS:
            if key in self.extra:
                raise ValueError(
                    f"extra[{key!r}]: written by to_hf_dict itself (DeepSeek-V4's {key} is fixed)"
                )

    # ----------------------------------------------------------------- per layer
    @property
    def wrapper(self) -> None:
        """No multimodal checkpoint wraps a V4 text model (ModelConfig.wrapper's question, answered)."""
        return None

    @property
    def attention_kernel(self) -> str:
        """What runs V4's attention on every device (dstrain env, a run's first lines)."""
        return "window + compressed entries, blocks of 64 query rows (torch ops), any packing"

    @property
    def sparse_attention(self) -> bool:
        """Some layer attends through a lightning indexer (CSA): the sparse-attention stages apply."""
        return CSA in self.layer_types or CSA in self.mtp_layer_types

    @property
    def finetune_dsa_stage(self) -> str:
        """--dsa_stage auto's stage for a full fine-tune of a V4 checkpoint: 'frozen' (no published rule for
        V4's post-training indexer; its indexers already follow its attention)."""
        return "frozen"

    @property
    def is_moe(self) -> bool:
        """Every V4 layer is MoE (the balancing acts on the biased, non-hash ones)."""
        return True

    @property
    def uses_expert_bias(self) -> bool:
        """Its routers past the hash layers select with `e_score_correction_bias`."""
        return True

    def attention_type(self, layer_idx: int) -> str:
        """The attention of layer `layer_idx`; MTP layers are layer_idx >= num_hidden_layers."""
        n = self.num_hidden_layers
        if layer_idx < 0 or layer_idx >= n + self.num_nextn_predict_layers:
            raise IndexError(
                f"layer {layer_idx}: the model has {n} + {self.num_nextn_predict_layers} MTP layers"
            )
        return self.layer_types[layer_idx] if layer_idx < n else self.mtp_layer_types[layer_idx - n]

    def compress_rate(self, layer_idx: int) -> int:
        """Tokens per compressed entry of layer `layer_idx` (0: a sliding-window layer, nothing compressed)."""
        kind = self.attention_type(layer_idx)
        return 0 if kind == SLIDING else self.compress_rates[kind]

    def is_hash_layer(self, layer_idx: int) -> bool:
        """Layer `layer_idx` routes by token id; MTP layers never do."""
        return layer_idx < self.num_hidden_layers and self.mlp_layer_types[layer_idx] == "hash_moe"

    def replace(self, **changes: Any) -> V4Config:
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------- HF config.json
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> V4Config:
        """A deepseek_v4 config.json in either form: DeepSeek's (compress_ratios with the MTP layers' entries
        past the main ones, num_hash_layers, rope_scaling spelled with "type", expert_dtype,
        quantization_config) or transformers' (layer_types, mlp_layer_types, compress_rates, rope_parameters
        {"main", "compress"}, partial_rotary_factor). Fields it leaves out take transformers' DeepseekV4Config
        defaults; keys that contradict each other are errors naming them."""
        source = copy.deepcopy(d)
        d = copy.deepcopy(d)
        if d.get("model_type") != MODEL_TYPE:
            raise ValueError(f"config.json model_type={d.get('model_type')!r}: V4Config reads {MODEL_TYPE}")
        if d.get("architectures") not in (None, [], [ARCHITECTURE]):
            raise ValueError(
                f"config.json architectures={d['architectures']!r} for {MODEL_TYPE}: expected {ARCHITECTURE}"
            )
        defaults = hf_defaults()

        def get(key: str) -> Any:
            return d[key] if key in d else defaults[key]

        kwargs: dict[str, Any] = {name: get(name) for name in SIMPLE_FIELDS if name in d or name in defaults}
        n = kwargs["num_hidden_layers"]
        rates = dict(d.get("compress_rates") or DEFAULT_COMPRESS_RATES)
        for key, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if key in d:
                rates[kind] = d[key]
        kwargs["compress_rates"] = rates
        ratios = d.get("compress_ratios")
        if ratios is not None:
            bad = sorted({r for r in ratios if r not in RATIO_TYPES})
            if bad:
                raise ValueError(f"config.json compress_ratios: {bad} (transformers reads 0, 4 and 128 only)")
            if len(ratios) < n:
                raise ValueError(
                    f"config.json compress_ratios: {len(ratios)} entries for num_hidden_layers={n}"
                )
        # transformers' precedence: explicit layer_types, then compress_ratios, then its default schedule
        if d.get("layer_types") is not None:
            kwargs["layer_types"] = d["layer_types"]
        elif ratios is not None:
            kwargs["layer_types"] = [RATIO_TYPES[r] for r in ratios[:n]]
        if d.get("mtp_layer_types") is not None:
            kwargs["mtp_layer_types"] = d["mtp_layer_types"]
        elif ratios is not None:
            kwargs["mtp_layer_types"] = [RATIO_TYPES[r] for r in ratios[n:]]
        if d.get("mlp_layer_types") is not None:
            kwargs["mlp_layer_types"] = d["mlp_layer_types"]
        elif d.get("num_hash_layers") is not None:
            kwargs["mlp_layer_types"] = default_mlp_layer_types(n, d["num_hash_layers"])
        kwargs.update(_read_rope(d, get))
        for key, value in FIXED.items():
            if d.get(key, value) != value:
                raise ValueError(
                    f"config.json {key}={d[key]!r}: DeepSeek-V4 {_FIXED_WHY[key]} (must be {value!r})"
                )
        kwargs["extra"] = {k: v for k, v in d.items() if k not in CARRIES and k not in CONSTANT_KEYS}
        form = (
            "deepseek"
            if any(k in d for k in DEEPSEEK_KEYS) and not any(k in d for k in TRANSFORMERS_KEYS)
            else "transformers"
        )
        kwargs["hf_source"] = {"form": form, "keys": sorted(source), "config": source}
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json this came from, keys and values as they were, with the keys of changed fields
        rewritten (in that file's form; keys it lacked added); `extra` as it is now. `quantization_config` and
        `expert_dtype` (QUANTIZATION_KEYS) stay: an export of dequantized weights drops them, and sets
        `dtype`/`torch_dtype`. Made in code (no source): transformers' form, which DeepseekV4Config loads."""
        source = (self.hf_source or {}).get("config")
        if source is None:
            out = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **FIXED}
            out.update({key: self._hf_value(key) for key in self._form_keys("transformers")})
            out.update({k: v for k, v in self.extra.items() if k not in CARRIES and k not in CONSTANT_KEYS})
            return out
        base = V4Config.from_hf_dict(source)
        changed = {
            f.name
            for f in dataclasses.fields(self)
            if f.name not in ("extra", "hf_source") and getattr(self, f.name) != getattr(base, f.name)
        }
        form = self.hf_source["form"]
        written = self._form_keys(form)
        out = {k: copy.deepcopy(v) for k, v in source.items() if k in CARRIES or k in CONSTANT_KEYS}
        for key, fields in CARRIES.items():
            if fields & changed and (key in out or key in written):
                out[key] = self._hf_value(key)
        if form == "deepseek" and "mlp_layer_types" in written:
            out.pop("num_hash_layers", None)  # not a prefix of hash layers: the explicit list says it
        out.update({k: v for k, v in self.extra.items() if k not in CARRIES and k not in CONSTANT_KEYS})
        # the file's own key order, then what was added
        return {k: out[k] for k in [*(k for k in source if k in out), *(k for k in out if k not in source)]}

    def _form_keys(self, form: str) -> list[str]:
        """The keys a config of `form` states this config with."""
        keys = list(SIMPLE_FIELDS)
        mtp_default = self.mtp_layer_types == [SLIDING] * self.num_nextn_predict_layers
        if form == "transformers":
            keys += [
                "layer_types",
                "mlp_layer_types",
                "compress_rates",
                "partial_rotary_factor",
                "rope_parameters",
            ]
            return keys + ([] if mtp_default else ["mtp_layer_types"])
        keys += ["compress_ratios", "rope_scaling"]
        hash_prefix = self.mlp_layer_types == default_mlp_layer_types(
            self.num_hidden_layers, self._num_hash_layers
        )
        keys.append("num_hash_layers" if hash_prefix else "mlp_layer_types")
        if self.compress_rates != DEFAULT_COMPRESS_RATES:
            keys.append("compress_rates")
        return keys

    @property
    def _num_hash_layers(self) -> int:
        return next(
            (i for i, t in enumerate(self.mlp_layer_types) if t != "hash_moe"), len(self.mlp_layer_types)
        )

    def _hf_value(self, key: str) -> Any:
        """The value of config.json key `key` for this config."""
        if key in SIMPLE_FIELDS or key in (
            "layer_types",
            "mlp_layer_types",
            "mtp_layer_types",
            "compress_rates",
        ):
            return copy.deepcopy(getattr(self, key))
        if key == "compress_ratios":
            return [TYPE_RATIOS[t] for t in self.layer_types + self.mtp_layer_types]
        if key == "num_hash_layers":
            return self._num_hash_layers
        if key in ("compress_rate_csa", "compress_rate_hca"):
            return self.compress_rates[CSA if key.endswith("csa") else HCA]
        if key == "partial_rotary_factor":
            return self.qk_rope_head_dim / self.head_dim
        if key == "rope_scaling":  # DeepSeek's spelling, unless the source spelled rope_type
            if self.rope_scaling is None:
                return None
            old = ((self.hf_source or {}).get("config") or {}).get("rope_scaling")
            kind = (
                "rope_type" if isinstance(old, dict) and "rope_type" in old and "type" not in old else "type"
            )
            rest = {k: v for k, v in self.rope_scaling.items() if k != "rope_type"}
            return {kind: self.rope_scaling["rope_type"], **rest}
        if key == "rope_parameters":
            prf = self.qk_rope_head_dim / self.head_dim
            main = {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": prf}
            compress = {"rope_type": "default", **(self.rope_scaling or {})}
            compress.update(rope_theta=self.compress_rope_theta, partial_rotary_factor=prf)
            if compress["rope_type"] == "yarn":
                compress.setdefault("attention_factor", 1.0)
            return {"main": main, "compress": compress}
        raise KeyError(key)

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> V4Config:
        return config_from_folder(cls, path)


def tp_sizes(cfg: V4Config) -> dict[str, int]:
    """What tensor parallelism splits in V4: the query heads with their sinks, the output projection's groups
    (a rank keeps whole groups, i.e. the heads each group reads), the shared expert's hidden size."""
    return {
        "num_attention_heads": cfg.num_attention_heads,
        "o_groups": cfg.o_groups,
        "moe_intermediate_size": cfg.moe_intermediate_size,
    }


def _normalised_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """{"rope_type": "yarn", ...} from either spelling ("type" is DeepSeek's); None for no scaling."""
    if scaling is None:
        return None
    scaling = dict(scaling)
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"rope_scaling type {kind!r}: DeepSeek-V4's compressed layers use 'yarn' (or none)")
    if "factor" not in scaling:
        raise ValueError("rope_scaling: yarn needs 'factor'")
    return {"rope_type": kind, **scaling}


def _read_rope(d: dict[str, Any], get: Any) -> dict[str, Any]:
    """rope_theta, compress_rope_theta, rope_scaling and qk_rope_head_dim of a config.json, read as
    transformers reads them (a nested rope_parameters {"main", "compress"} wins); the other keys that state the
    same thing must agree with it."""
    head_dim = get("head_dim")
    rp = d.get("rope_parameters")
    out: dict[str, Any] = {"rope_theta": get("rope_theta"), "compress_rope_theta": get("compress_rope_theta")}
    factors: dict[str, float] = {}
    if isinstance(rp, dict) and isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, compress = rp["main"], rp["compress"]
        for key, sub, name in (("rope_theta", main, "main"), ("compress_rope_theta", compress, "compress")):
            if "rope_theta" in sub:
                if key in d and d[key] != sub["rope_theta"]:
                    raise ValueError(
                        f"config.json {key}={d[key]} contradicts rope_parameters.{name}.rope_theta={sub['rope_theta']}"
                    )
                out[key] = sub["rope_theta"]
            if sub.get("partial_rotary_factor") is not None:
                factors[f"rope_parameters.{name}.partial_rotary_factor"] = sub["partial_rotary_factor"]
        if main.get("rope_type", main.get("type", "default")) != "default":
            raise ValueError("config.json rope_parameters.main: DeepSeek-V4's sliding layers use plain rope")
        scaling = compress
    else:
        # a flat rope_parameters (or rope_scaling) is the compressed layers' YaRN; theta stays compress_rope_theta
        scaling = rp if isinstance(rp, dict) and rp else d.get("rope_scaling")
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
        if scaling.get("attention_factor") == 1.0 and scaling.get("rope_type", scaling.get("type")) == "yarn":
            del scaling["attention_factor"]  # transformers adds it: V4 has no YaRN mscale
    out["rope_scaling"] = _normalised_scaling(scaling)
    if d.get("partial_rotary_factor") is not None:
        factors["partial_rotary_factor"] = d["partial_rotary_factor"]
    dims = {int(head_dim * f) for f in factors.values()}
    if "qk_rope_head_dim" in d:
        dims.add(d["qk_rope_head_dim"])
    if len(dims) > 1:
        stated = ", ".join(f"{k}={v}" for k, v in factors.items())
        raise ValueError(
            f"config.json qk_rope_head_dim={d.get('qk_rope_head_dim')} contradicts {stated} (head_dim={head_dim})"
        )
    out["qk_rope_head_dim"] = dims.pop() if dims else int(head_dim * 64 / 512)
    return out
