"""The configuration of the DeepSeek-V3 family (DeepSeek-V2, V3, V3.2, GLM-5, Kimi-K2): one dataclass with Hugging
Face field names, and config.json I/O in each variant's form."""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from ..common.config import DEEPSEEK_V3_VOCAB, TRAINING_FIELDS, config_from_folder

ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


@dataclass(frozen=True)
class Variant:
    """What differs between the variants of the family (config.json model types), as data: the code is shared."""

    architecture: str
    hf_config: str
    """transformers' config class: the defaults of fields a config.json leaves out."""
    routing: str
    """'v3': sigmoid scores, expert bias, groups by top-2 sum (noaux_tc); 'v2': softmax, greedy or groups."""
    sparse_attention: bool = False
    """DeepSeek Sparse Attention: a lightning indexer selects each query's keys (V3.2, GLM-5)."""
    indexer_rope_interleave: bool = False
    """The indexer's rotary pairs are adjacent dims (GLM-5) rather than the two halves (V3.2)."""
    mtp_key: str = "num_mtp_layers"
    """The config.json key of the MTP depth written beside `num_nextn_predict_layers` (None: that one only)."""
    mtp_head_copies: bool = True
    """The checkpoint's MTP layers carry copies of the embedding and the head (DeepSeek's do, GLM-5's not)."""
    finetune_dsa_stage: str = "frozen"
    """--dsa_stage auto's stage for a full fine-tune of a checkpoint: DeepSeek-V3.2's report (section 2.2) has
    post-training "employ sparse attention in the same way as the sparse continued pre-training stage"
    (indexer trained by the KL): 'sparse'; GLM-5's report states only its RL's rule, indexer frozen."""


VARIANTS = {
    "deepseek_v3": Variant("DeepseekV3ForCausalLM", "DeepseekV3Config", "v3"),
    "deepseek_v2": Variant("DeepseekV2ForCausalLM", "DeepseekV2Config", "v2"),
    "deepseek_v32": Variant(
        "DeepseekV32ForCausalLM",
        "DeepseekV32Config",
        "v3",
        sparse_attention=True,
        mtp_key="",
        finetune_dsa_stage="sparse",
    ),
    "glm_moe_dsa": Variant(
        "GlmMoeDsaForCausalLM",
        "GlmMoeDsaConfig",
        "v3",
        sparse_attention=True,
        indexer_rope_interleave=True,
        mtp_key="",
        mtp_head_copies=False,
    ),
}
ARCHITECTURES = {v.architecture: name for name, v in VARIANTS.items()}
INDEXER_TYPES = ("full", "shared")


@dataclass(frozen=True)
class Wrapper:
    """A multimodal checkpoint whose text model dstrain trains: where the text model's config and tensors sit.
    Its other tensors (vision tower, projector) are not the model's: an export copies them unchanged."""

    text_config: str
    """The config.json key of the text model's config."""
    prefix: str
    """What the text model's tensor names start with."""


# By the outer config.json's model_type.
WRAPPERS = {
    # moonshotai/Kimi-K2.5: a MoonViT vision tower and projector beside a Kimi-K2 text model
    "kimi_k25": Wrapper("text_config", "language_model."),
}


def _variant(d: dict[str, Any]) -> str:
    """The variant (VARIANTS) from model_type and architectures; another model_type with a DeepSeek
    architecture (kimi_k2, ...) is that architecture; contradictions are errors naming the field."""
    model_type, archs = d.get("model_type"), d.get("architectures") or []
    if model_type == "deepseek_v4" or "DeepseekV4ForCausalLM" in archs:
        raise ValueError(
            "config.json model_type='deepseek_v4' is read by V4Config (dstrain.model.deepseek_v4), not ModelConfig"
        )
    if not isinstance(archs, list) or len(archs) > 1 or any(a not in ARCHITECTURES for a in archs):
        raise ValueError(f"config.json architectures={archs!r}: dstrain trains {' or '.join(ARCHITECTURES)}")
    by_arch = ARCHITECTURES[archs[0]] if archs else None
    if model_type in ARCHITECTURES.values():
        if by_arch not in (None, model_type):
            raise ValueError(f"config.json model_type={model_type!r} contradicts architectures={archs!r}")
        return model_type
    if by_arch is None:
        raise ValueError(f"config.json model_type={model_type!r}: dstrain loads {', '.join(VARIANTS)}")
    return by_arch


def _unwrap(d: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(the outer config without its text model's, the text model's config) of a multimodal config.json
    (WRAPPERS); (None, d) for a text model's own."""
    model_type = d.get("model_type")
    wrapper = WRAPPERS.get(model_type)
    if wrapper is None:
        if "text_config" in d or "vision_config" in d:
            raise ValueError(
                f"config.json model_type={model_type!r} is multimodal: dstrain trains the text model of "
                f"{', '.join(WRAPPERS)} checkpoints"
            )
        return None, d
    text = d.pop(wrapper.text_config, None)
    if not isinstance(text, dict):
        raise ValueError(f"config.json model_type={model_type!r}: no {wrapper.text_config} (its text model)")
    return d, text


def _hf_defaults(variant: str) -> dict[str, Any]:
    """The defaults transformers' config class of `variant` gives a field that config.json leaves out."""
    import inspect

    import transformers

    cls = getattr(transformers, VARIANTS[variant].hf_config)
    params = inspect.signature(cls.__init__).parameters.values()
    # PretrainedConfig's own fields (id2label, return_dict, ...) describe no architecture: not written back
    base = set(inspect.signature(transformers.PretrainedConfig.__init__).parameters)
    skip = {"self", "kwargs", "rope_parameters", "architectures", *base}
    return {
        p.name: p.default for p in params if p.name not in skip and p.default is not inspect.Parameter.empty
    }


@dataclass
class ModelConfig:
    """Architecture of a DeepSeek-V2/V3 model. Field names follow Hugging Face `config.json`."""

    model_type: str = "deepseek_v3"
    """`deepseek_v3` (sigmoid routing with expert bias, MTP), `deepseek_v2` (softmax routing), `deepseek_v32` or
    `glm_moe_dsa` (V3 with DeepSeek Sparse Attention)."""
    vocab_size: int = DEEPSEEK_V3_VOCAB
    """Rows of the embedding and of the output head."""
    hidden_size: int = 64
    """Width of the residual stream."""
    intermediate_size: int = 128
    """Hidden width of the dense SwiGLU FFN used in the first `first_k_dense_replace` layers."""
    moe_intermediate_size: int = 32
    """Hidden width of one routed (and one shared) expert."""
    num_hidden_layers: int = 2
    """Transformer blocks of the main model (MTP blocks come on top)."""
    num_attention_heads: int = 4
    """Attention heads of MLA."""
    q_lora_rank: int | None = 32
    """Rank of the query compression; None projects queries directly (V2-Lite)."""
    kv_lora_rank: int = 32
    """Rank of the joint key/value compression (the cached latent)."""
    qk_nope_head_dim: int = 16
    """Per-head query/key dimension without rotary embedding."""
    qk_rope_head_dim: int = 8
    """Per-head query dimension with rotary embedding; the rotary key is one head shared by all heads."""
    v_head_dim: int = 16
    """Per-head value dimension."""
    n_routed_experts: int | None = 8
    """Fine-grained routed experts per MoE layer; None or 0 makes every layer dense."""
    n_shared_experts: int = 1
    """Shared experts per MoE layer (one SwiGLU of width n_shared_experts * moe_intermediate_size)."""
    num_experts_per_tok: int = 2
    """Routed experts each token is sent to (top-k)."""
    n_group: int = 1
    """Expert groups for group-limited routing (1 = no grouping)."""
    topk_group: int = 1
    """Groups a token may route into."""
    topk_method: str = "noaux_tc"
    """`noaux_tc` (V3: sigmoid, bias for selection, groups by top-2 sum), `greedy` or
    `group_limited_greedy` (V2: softmax, groups by max)."""
    scoring_func: str = "sigmoid"
    """`sigmoid` (V3) or `softmax` (V2)."""
    norm_topk_prob: bool = True
    """Renormalise the selected experts' weights to sum to 1 (before `routed_scaling_factor`)."""
    routed_scaling_factor: float = 2.5
    """Multiplier on the routed experts' output weights."""
    first_k_dense_replace: int = 1
    """The first k layers use the dense FFN instead of MoE."""
    hidden_act: str = "silu"
    """Activation of the SwiGLU FFNs (only silu is supported)."""
    max_position_embeddings: int = 4096
    """Longest sequence the rotary embedding is configured for."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """Rotary base."""
    rope_scaling: dict[str, Any] | None = None
    """None, or YaRN parameters as in HF configs: {"rope_type": "yarn", "factor", "original_max_position_embeddings",
    "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}."""
    rope_interleave: bool = True
    """Rotary pairs are adjacent dims (DeepSeek's published weights) rather than the two halves."""
    attention_bias: bool = False
    """Bias on q_a/kv_a/o projections."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with the output head."""
    num_nextn_predict_layers: int = 1
    """Multi-token-prediction depth D (0 = no MTP)."""
    initializer_range: float = 0.02
    """Std of the normal init of linear and embedding weights."""
    bos_token_id: int | None = 0
    """Beginning-of-sequence token id (written to config.json)."""
    eos_token_id: int | None = 1
    """End-of-sequence token id (written to config.json)."""
    pad_token_id: int | None = None
    """Padding token id (written to config.json)."""
    index_topk: int | None = None
    """DeepSeek Sparse Attention: the keys each query attends to, chosen by its layer's lightning indexer
    (2048 in V3.2 and GLM-5); None: dense MLA (V2, V3)."""
    index_n_heads: int = 64
    """Heads of the lightning indexer."""
    index_head_dim: int = 128
    """Dimension of an indexer head (its first qk_rope_head_dim dims are rotary)."""
    indexer_types: list[str] | None = None
    """Per main layer: "full" (its own indexer) or "shared" (no indexer: the previous full layer's selection,
    GLM-5's cross-layer sharing); None: every layer full. MTP blocks are full."""
    indexer_rope_interleave: bool = False
    """Rotary pairs of the indexer are adjacent dims (GLM-5) rather than the two halves (DeepSeek-V3.2)."""
    aux_loss_alpha: float = 1e-4
    """α of the sequence-wise balance loss (DeepSeek-V3 eq. 17); 0 disables it. Training only."""
    bias_update_speed: float = 1e-3
    """γ of aux-loss-free balancing: bias += γ·sign(mean_load − load) after each step; 0 disables. Training only."""
    mtp_loss_weight: float = 0.3
    """λ: weight of the mean MTP loss over depths. Training only."""
    extra: dict[str, Any] = field(default_factory=dict)
    """HF config.json keys dstrain does not interpret, written back unchanged on save."""
    hf_source: dict[str, Any] | None = field(default=None, compare=False)
    """The forms of the config.json this came from ({"model_type", "rope": its rope fields, "keys"; "outer":
    a multimodal checkpoint's config around the text model (WRAPPERS); "folder": where it was read}), written
    back by to_hf_dict so every reader of the original reads the export; None: transformers 5's forms."""

    def __post_init__(self) -> None:
        if self.model_type not in VARIANTS:
            raise ValueError(
                f"model_type={self.model_type!r}: expected one of {', '.join(VARIANTS)} (deepseek_v4: V4Config)"
            )
        self._check_sparse_attention()
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "v_head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank={self.q_lora_rank} must be positive or null")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r}: only 'silu' is supported")
        if self.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ValueError(
                f"topk_method={self.topk_method!r}: expected noaux_tc, greedy or group_limited_greedy"
            )
        if self.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(f"scoring_func={self.scoring_func!r}: expected 'sigmoid' or 'softmax'")
        if self.is_moe:
            e = self.n_routed_experts
            if not 0 < self.num_experts_per_tok <= e:
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..n_routed_experts={e}"
                )
            if self.n_group < 1 or e % self.n_group:
                raise ValueError(f"n_routed_experts={e} must be divisible by n_group={self.n_group}")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group={self.topk_group} must be in 1..n_group={self.n_group}")
            per_group = e // self.n_group
            if self.topk_method == "noaux_tc" and self.n_group > 1 and per_group < 2:
                raise ValueError(
                    f"noaux_tc group scores sum the top 2 experts: n_routed_experts/n_group={per_group} < 2"
                )
            if self.num_experts_per_tok > self.topk_group * per_group:
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts in topk_group={self.topk_group} groups"
                )
            if self.topk_method == "noaux_tc" and self.scoring_func != "sigmoid":
                raise ValueError("topk_method='noaux_tc' requires scoring_func='sigmoid'")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(
                f"first_k_dense_replace={self.first_k_dense_replace} must be in 0..num_hidden_layers"
            )
        if self.num_nextn_predict_layers < 0:
            raise ValueError(f"num_nextn_predict_layers={self.num_nextn_predict_layers} must be >= 0")
        for name in TRAINING_FIELDS:
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("yarn", "default", None):
                raise ValueError(f"rope_scaling type {kind!r}: only 'yarn' is supported")
            if kind == "yarn" and "factor" not in self.rope_scaling:
                raise ValueError("rope_scaling: yarn needs 'factor'")

    def _check_sparse_attention(self) -> None:
        variant = VARIANTS[self.model_type]
        if not variant.sparse_attention:
            if self.index_topk is not None:
                raise ValueError(
                    f"index_topk: {self.model_type} has no sparse attention (deepseek_v32, glm_moe_dsa)"
                )
            return
        if self.index_topk is None or self.index_topk < 1:
            raise ValueError(f"{self.model_type}: index_topk={self.index_topk} must be a positive integer")
        if self.q_lora_rank is None:
            raise ValueError(
                f"{self.model_type}: the indexer reads the compressed query: q_lora_rank is required"
            )
        if self.index_n_heads < 1 or not self.qk_rope_head_dim <= self.index_head_dim:
            raise ValueError(
                f"index_n_heads={self.index_n_heads} index_head_dim={self.index_head_dim}: need >= 1 heads of at "
                f"least qk_rope_head_dim={self.qk_rope_head_dim} dims"
            )
        types = self.indexer_types
        if types is not None:
            if len(types) != self.num_hidden_layers or set(types) - set(INDEXER_TYPES):
                raise ValueError(
                    f"indexer_types: one of {INDEXER_TYPES} per main layer ({self.num_hidden_layers}), got {types!r}"
                )
            if types[0] != "full":
                raise ValueError(
                    "indexer_types[0]: the first layer must be 'full' (a shared layer reuses an earlier one)"
                )

    @property
    def variant(self) -> Variant:
        return VARIANTS[self.model_type]

    @property
    def wrapper(self) -> Wrapper | None:
        """The multimodal checkpoint this is the text model of (its vision tower stays in the source folder)."""
        outer = (self.hf_source or {}).get("outer")
        return WRAPPERS[outer["model_type"]] if outer else None

    @property
    def hf_prefix(self) -> str:
        """What the model's tensor names start with in its checkpoint folder ("" unless wrapped)."""
        return self.wrapper.prefix if self.wrapper else ""

    @property
    def sparse_attention(self) -> bool:
        """DeepSeek Sparse Attention (a lightning indexer per full layer)."""
        return self.index_topk is not None

    @property
    def finetune_dsa_stage(self) -> str:
        """--dsa_stage auto's stage for a full fine-tune of a checkpoint of this variant (Variant's)."""
        return self.variant.finetune_dsa_stage

    def has_indexer(self, layer_idx: int) -> bool:
        """Layer `layer_idx` (MTP blocks: >= num_hidden_layers) runs its own lightning indexer."""
        if not self.sparse_attention:
            return False
        types = self.indexer_types
        return types is None or layer_idx >= self.num_hidden_layers or types[layer_idx] == "full"

    def indexer_source(self, layer_idx: int) -> int:
        """The layer whose selection layer `layer_idx` attends with: itself, or for a shared layer the
        previous full one."""
        while not self.has_indexer(layer_idx):
            layer_idx -= 1
        return layer_idx

    @property
    def is_moe(self) -> bool:
        return bool(self.n_routed_experts)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def uses_expert_bias(self) -> bool:
        """V3 routing carries `e_score_correction_bias` (aux-loss-free balancing); V2 routing has none."""
        return self.is_moe and self.topk_method == "noaux_tc"

    def is_moe_layer(self, layer_idx: int) -> bool:
        """MTP blocks (layer_idx >= num_hidden_layers) follow the same rule: they are MoE in DeepSeek-V3."""
        return self.is_moe and layer_idx >= self.first_k_dense_replace

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------- HF config.json
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """A checkpoint's config.json as it ships: fields it leaves out take the defaults of transformers'
        DeepseekV3Config / DeepseekV2Config (what transformers would run), routing fields are read and
        checked, and the forms to write back (model_type, rope fields) are remembered. A multimodal
        checkpoint's (WRAPPERS) is its text model's, the config around it remembered."""
        outer, d = _unwrap(copy.deepcopy(d))
        try:
            variant = _variant(d)
        except ValueError as exc:
            if outer is None:
                raise
            raise ValueError(f"{outer['model_type']} text model: {exc}") from None
        source = {
            "model_type": d.get("model_type"),
            "rope": {k: d[k] for k in ROPE_KEYS if k in d},
            "keys": sorted(d),
            **({"outer": outer} if outer is not None else {}),
        }
        d["model_type"] = variant
        for key, value in _hf_defaults(variant).items():
            d.setdefault(key, value)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "hf_source", *TRAINING_FIELDS[1:]}
        kwargs: dict[str, Any] = {}
        # transformers 5 writes `rope_parameters` (theta inside); older/official configs write rope_theta + rope_scaling.
        rope = d.pop("rope_parameters", None) or d.pop("rope_scaling", None) or {}
        rope = dict(rope)
        theta = rope.pop("rope_theta", None) or d.pop("rope_theta", None) or 10000.0
        kind = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
        kwargs["rope_theta"] = float(theta)
        kwargs["rope_scaling"] = {"rope_type": kind, **rope} if kind != "default" else None
        d.pop("rope_theta", None)
        d.pop("rope_scaling", None)
        scoring = d.pop("scoring_func", None)
        if VARIANTS[variant].routing == "v2":
            if scoring not in (None, "softmax"):
                raise ValueError(f"config.json scoring_func={scoring!r}: deepseek_v2 routes with softmax")
            kwargs["num_nextn_predict_layers"] = 0
            kwargs["rope_interleave"] = True  # V2 applies rotary to adjacent pairs (complex multiply)
            kwargs["scoring_func"] = "softmax"
            kwargs["norm_topk_prob"] = bool(d.pop("norm_topk_prob"))
            kwargs["n_group"] = d.pop("n_group") or 1
            kwargs["topk_group"] = d.pop("topk_group") or 1
            kwargs["n_shared_experts"] = d.pop("n_shared_experts") or 0
            if d.get("n_routed_experts") and d.get("num_experts_per_tok") is None:
                raise ValueError(
                    "config.json: num_experts_per_tok is missing (transformers has no default for it)"
                )
        else:
            method = d.pop("topk_method", None)
            # DeepseekV3 (transformers, vLLM, SGLang) runs noaux_tc with sigmoid scores whatever else is written
            if method not in (None, "noaux_tc") or scoring not in (None, "sigmoid"):
                raise ValueError(
                    f"config.json topk_method={method!r} scoring_func={scoring!r}: the DeepseekV3 architecture "
                    "routes with noaux_tc and sigmoid scores"
                )
            kwargs["topk_method"], kwargs["scoring_func"] = "noaux_tc", "sigmoid"
            mtp = d.pop("num_nextn_predict_layers", None)
            mtp_hf = d.pop("num_mtp_layers", None)  # transformers' attribute name for the same thing
            kwargs["num_nextn_predict_layers"] = int(mtp if mtp is not None else (mtp_hf or 0))
        if VARIANTS[variant].sparse_attention:
            kwargs.update(_sparse_attention_fields(d, variant))
        else:
            for key in ("index_topk", "index_n_heads", "index_head_dim", "indexer_types"):
                d.pop(key, None)
        if d.get("moe_layer_freq", 1) != 1:
            raise ValueError(
                f"config.json moe_layer_freq={d['moe_layer_freq']}: only 1 (every layer past the dense ones) is supported"
            )
        extra: dict[str, Any] = {}
        for key, value in d.items():
            if key in names and key not in kwargs:
                kwargs[key] = value
            elif key not in kwargs and key != "architectures":
                extra[key] = value
        # An explicit null (or 0) describes a dense model.
        if not kwargs.get("n_routed_experts"):
            kwargs["n_routed_experts"] = None
        for key in (
            "num_experts_per_tok",
            "n_group",
            "topk_group",
            "first_k_dense_replace",
            "n_shared_experts",
        ):
            if kwargs.get(key) is None:
                kwargs.pop(key, None)
        if isinstance(kwargs.get("eos_token_id"), list):
            extra["eos_token_id"] = kwargs.pop("eos_token_id")
        kwargs["extra"] = extra
        kwargs["hf_source"] = source
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that transformers' config class of the variant loads, in the source checkpoint's own
        forms: its model_type (e.g. kimi_k2) and rope fields (rope_theta + rope_scaling for readers older than
        transformers 5, else rope_parameters); aux_loss_alpha is what trained."""
        variant = self.variant
        d: dict[str, Any] = {"architectures": [variant.architecture]}
        skip = {"extra", "hf_source", "rope_theta", "rope_scaling", *TRAINING_FIELDS[1:]}
        if not variant.sparse_attention:
            skip |= {
                "index_topk",
                "index_n_heads",
                "index_head_dim",
                "indexer_types",
                "indexer_rope_interleave",
            }
        else:
            # Only what the source had: transformers hard-codes these per variant and ignores the keys.
            had = set(self.hf_source.get("keys", ())) if self.hf_source else set()
            if "rope_interleave" not in had:
                skip.add("rope_interleave")
            if (
                "indexer_rope_interleave" not in had
                and self.indexer_rope_interleave == variant.indexer_rope_interleave
            ):
                skip.add("indexer_rope_interleave")
            if self.indexer_types is None:
                skip.add("indexer_types")
        for f in dataclasses.fields(self):
            if f.name not in skip:
                d[f.name] = getattr(self, f.name)
        source = self.hf_source or {}
        d["model_type"] = source.get("model_type") or self.model_type
        if "rope_scaling" in source.get("rope", {}) or (
            source.get("rope") and "rope_parameters" not in source["rope"]
        ):
            d["rope_theta"] = self.rope_theta
            scaling = dict(self.rope_scaling) if self.rope_scaling else None
            old = source["rope"].get("rope_scaling")
            if scaling and isinstance(old, dict) and "type" in old and "rope_type" not in old:
                scaling["type"] = scaling.pop("rope_type")  # the official DeepSeek spelling
            d["rope_scaling"] = scaling
        else:
            rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
            if self.rope_scaling:
                rope.update(self.rope_scaling)
            d["rope_parameters"] = rope
        # MLA has no key/value heads of its own; the source's value (often its own default) is kept
        d["num_key_value_heads"] = self.extra.get("num_key_value_heads", self.num_attention_heads)
        if variant.routing == "v2":
            for key in ("num_nextn_predict_layers", "rope_interleave", "scoring_func"):
                d.pop(key)
        else:
            if "topk_method" not in (self.hf_source or {}).get("keys", ()):
                d.pop("topk_method")
            if variant.mtp_key:
                d[variant.mtp_key] = self.num_nextn_predict_layers
        d.update({k: v for k, v in self.extra.items() if k not in d})
        if self.wrapper:  # a multimodal checkpoint's text model: inside its outer config, as it came
            return {**copy.deepcopy(source["outer"]), self.wrapper.text_config: d}
        return d

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> ModelConfig:
        return config_from_folder(cls, path)


def _sparse_attention_fields(d: dict[str, Any], variant: str) -> dict[str, Any]:
    """The indexer's fields of a deepseek_v32 / glm_moe_dsa config.json (taken out of `d`): GLM-5's layer
    pattern derived as transformers derives it when the file gives none (index_topk_pattern "FSS..", or every
    index_topk_freq-th layer from index_skip_topk_offset: those keys stay in the file as they were)."""
    out = {
        "index_topk": int(d.pop("index_topk")),
        "index_n_heads": int(d.pop("index_n_heads")),
        "index_head_dim": int(d.pop("index_head_dim")),
        "indexer_rope_interleave": bool(
            d.pop("indexer_rope_interleave", VARIANTS[variant].indexer_rope_interleave)
        ),
        "rope_interleave": bool(d.pop("rope_interleave", True)),
    }
    types = d.pop("indexer_types", None)
    if types is None and variant == "glm_moe_dsa":
        pattern = d.get("index_topk_pattern")
        n = int(d["num_hidden_layers"])
        if pattern is not None:
            types = (
                [{"F": "full", "S": "shared"}[c] for c in pattern]
                if isinstance(pattern, str)
                else list(pattern)
            )
        else:
            freq, offset = max(int(d.get("index_topk_freq", 1)), 1), int(d.get("index_skip_topk_offset", 2))
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
        if all(t == "full" for t in types):
            types = None
    out["indexer_types"] = list(types) if types is not None else None
    return out
