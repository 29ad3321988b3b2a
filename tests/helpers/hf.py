"""Tiny random Hugging Face DeepSeek checkpoints written by transformers itself (parity tests), an
official-layout folder with MTP layers built from one, and a reader of any safetensors folder."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
)

from dstrain.model.hf.files import SAFE_INDEX

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}


def _v3_shape() -> dict:
    return dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        v_head_dim=12,
        qk_nope_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        max_position_embeddings=128,
        rope_parameters=dict(YARN),
    )


def v3_config(**overrides) -> DeepseekV3Config:
    return DeepseekV3Config(**{**_v3_shape(), **overrides})


def v2_config(**overrides) -> DeepseekV2Config:
    kw = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        v_head_dim=12,
        qk_nope_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        topk_method="group_limited_greedy",
        routed_scaling_factor=1.5,
        first_k_dense_replace=1,
        max_position_embeddings=128,
        rope_parameters=dict(YARN),
    )
    kw.update(overrides)
    return DeepseekV2Config(**kw)


# Sparse attention (DSA): 16 indexer heads, so that exact ties between index scores (where torch.topk's choice
# is arbitrary) do not occur; top-k 6 of up to 40 keys, so that sparsity is exercised.
DSA = dict(index_topk=6, index_n_heads=16, index_head_dim=16)


def v32_config(**overrides) -> DeepseekV32Config:
    kw = {**_v3_shape(), **DSA}
    kw.update(overrides)
    return DeepseekV32Config(**kw)


def glm_config(**overrides) -> GlmMoeDsaConfig:
    """GLM-5 with a shared-indexer layer: 4 layers, full, full, shared, full."""
    kw = {**_v3_shape(), **DSA}
    kw.update(num_hidden_layers=4, n_group=1, topk_group=1, rms_norm_eps=1e-5,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, index_topk_freq=2,
              index_skip_topk_offset=2)  # fmt: skip
    kw.update(overrides)
    return GlmMoeDsaConfig(**kw)


HF_CLASSES = {
    "deepseek_v3": DeepseekV3ForCausalLM,
    "deepseek_v2": DeepseekV2ForCausalLM,
    "deepseek_v32": DeepseekV32ForCausalLM,
    "glm_moe_dsa": GlmMoeDsaForCausalLM,
}


def make_hf_model(config, seed: int = 0, random_bias: bool = True):
    """A transformers DeepSeek model with every weight random (norms, their biases and the expert bias too)."""
    torch.manual_seed(seed)
    model = HF_CLASSES[config.model_type](config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.bias"):
                p.normal_(0, 0.1)
            elif name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "experts" in name or name.endswith("gate.weight"):
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias") and random_bias:
                b.copy_(0.3 * torch.randn_like(b))
    return model


def read_folder(path):
    """Every tensor of a safetensors folder, by key."""
    index = path / SAFE_INDEX
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    out = {}
    for name in files:
        with safe_open(path / name, "pt") as f:
            for k in f.keys():  # noqa: SIM118
                out[k] = f.get_tensor(k)
    return out


def official_folder(path, dtype=torch.bfloat16, shards=2, cfg=None):
    """An official-layout folder (DeepSeek-V3 unless `cfg`) with an MTP layer, written by transformers then
    extended the way the published checkpoints are: MTP layer = block (with its indexer under sparse
    attention) + enorm/hnorm/eh_proj/shared_head + copies of the embedding and head (none in GLM-5's). Weights
    in `dtype`, expert bias fp32, split over `shards` files."""
    cfg = cfg if cfg is not None else v3_config(num_mtp_layers=1)
    make_hf_model(cfg).save_pretrained(path)
    sd = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    n = cfg.num_hidden_layers
    g = torch.Generator().manual_seed(3)
    for k, t in list(sd.items()):
        if k.startswith(f"model.layers.{n - 1}."):
            sd[k.replace(f"layers.{n - 1}.", f"layers.{n}.")] = t + 0.01 * torch.randn(t.shape, generator=g)
    h = cfg.hidden_size
    sd[f"model.layers.{n}.enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    sd[f"model.layers.{n}.hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    sd[f"model.layers.{n}.eh_proj.weight"] = 0.05 * torch.randn(h, 2 * h, generator=g)
    sd[f"model.layers.{n}.shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    if cfg.model_type != "glm_moe_dsa":
        sd[f"model.layers.{n}.embed_tokens.weight"] = sd["model.embed_tokens.weight"]
        sd[f"model.layers.{n}.shared_head.head.weight"] = sd["lm_head.weight"]
    sd = {
        k: (v if k.endswith("e_score_correction_bias") else v.to(dtype)).contiguous() for k, v in sd.items()
    }
    keys = sorted(sd)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k].clone() for k in keys[i::shards]}
        save_file(part, path / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (path / SAFE_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    conf = json.loads((path / "config.json").read_text())
    conf["num_nextn_predict_layers"] = 1
    conf["dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(conf))
    return sd
