"""Quantized Hugging Face folders written by the tests, as the releases store them: DeepSeek-V3-style FP8 (e4m3
codes, one fp32 `weight_scale_inv` per 128 x 128 block) on every projection, the rest as saved."""

from __future__ import annotations

import json
import re

import torch
from safetensors.torch import load_file, save_file

from dstrain.model.hf import SAFE_INDEX
from dstrain.model.hf.quantize import quantize_fp8

FP8_LINEAR = re.compile(
    r"(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)|eh_proj"
    r"|mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj)\.weight$"
)
V3_FP8 = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


# The KDA hybrids' projections (Kimi Linear, GLM-5.3-Flash): KDA's q/k/v/o, beta and gate projections, MLA's, the
# MLPs' and experts' (short convolutions, norms, A_log, dt_bias, routers, mHC and indexers stay as they are)
KDA_HYBRID_FP8 = re.compile(
    r"(self_attn\.(q_proj|k_proj|v_proj|o_proj|b_proj|[fg]_[ab]_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa"
    r"|kv_b_proj)|(mlp|block_sparse_moe)\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj)\.weight$"
)


def quantize_folder_fp8(path, pattern: re.Pattern = FP8_LINEAR) -> dict[str, int]:  # noqa: ANN001
    """Rewrite the safetensors folder `path` (a pathlib.Path) with every projection (`pattern`) in V3's FP8 form
    (one file), the config's quantization_config as V3's. -> the stored bytes (codes + scales) of each quantized
    HF weight."""
    dense = {}
    for f in sorted(path.glob("*.safetensors")):
        dense.update(load_file(f))
        f.unlink()
    (path / SAFE_INDEX).unlink(missing_ok=True)
    files, stored = {}, {}
    for k, t in dense.items():
        if pattern.search(k) and t.dim() == 2:
            files[k], files[k + "_scale_inv"] = quantize_fp8(t.float(), torch.float32)
            stored[k] = files[k].numel() + 4 * files[k + "_scale_inv"].numel()
        else:
            files[k] = t
    save_file(files, path / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**conf, "quantization_config": V3_FP8}, indent=2))
    return stored


def tp_fp8_config(**kw):  # noqa: ANN201 - a dstrain ModelConfig
    """The tiny test model with the projections tensor parallelism splits 512 and 256 wide: on 2 ranks each keeps
    whole 128-row (or column) blocks of their FP8 scales."""
    from tests.helpers.tiny import tiny_config

    return tiny_config(
        hidden_size=64, num_attention_heads=8, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
        q_lora_rank=32, kv_lora_rank=32, intermediate_size=256, moe_intermediate_size=128, n_shared_experts=2, **kw,
    )  # fmt: skip


def fp8_folder(path, cfg=None, seed: int = 11) -> dict[str, int]:  # noqa: ANN001
    """A DeepSeek-V3-style FP8 folder of dstrain's model `cfg` (default `tp_fp8_config()`) with random weights
    (norms and the expert bias too), bf16 where not quantized. -> `quantize_folder_fp8`'s stored bytes."""
    from dstrain.model import build_model, save_pretrained

    model = build_model(cfg or tp_fp8_config(), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    save_pretrained(model, path, dtype="bfloat16")
    return quantize_folder_fp8(path)


# DeepSeek-V4's published form, in DeepSeek's names: FP8 (e8m0 scales, 128x128) on the attention's and the
# shared experts' projections (the MTP's e/h projections too), FP4 (1x32, e8m0) routed experts
V4_FP8 = re.compile(
    r"(^|\.)(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|shared_experts\.w[123]|e_proj|h_proj)\.weight$"
)
V4_FP4 = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
V4_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128]}  # fmt: skip
# Kimi-K2.5's: compressed-tensors INT4, symmetric groups of 32 columns, bf16 scales, on the routed experts
EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
INT4 = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": {
    "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
    "format": "pack-quantized", "quant_method": "compressed-tensors", "quantization_status": "compressed"}  # fmt: skip


def _random_model(cfg, path, seed: int) -> None:  # noqa: ANN001
    from dstrain.model import build_model, save_pretrained

    model = build_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    save_pretrained(model, path, dtype="bfloat16")


def _rewrite(path, quantize, config: dict) -> dict[str, int]:  # noqa: ANN001
    """The folder's tensors through `quantize(key, tensor)` -> {key: tensor} (or None: kept), one file."""
    dense = {}
    for f in sorted(path.glob("*.safetensors")):
        dense.update(load_file(f))
        f.unlink()
    (path / SAFE_INDEX).unlink(missing_ok=True)
    files, stored = {}, {}
    for k, t in dense.items():
        parts = quantize(k, t)
        files.update(parts or {k: t})
        if parts:
            stored[k] = sum(p.numel() * p.element_size() for p in parts.values())
    save_file(files, path / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**conf, **config}, indent=2))
    return stored


def v4_folder(path, seed: int = 11) -> dict[str, int]:  # noqa: ANN001
    """The tiny DeepSeek-V4 (tests/helpers/tiny.py) with random weights, in DeepSeek's names and published form
    (FP8 e8m0 projections, FP4 routed experts). -> the stored bytes of each quantized weight."""
    from dstrain.model.hf.quantize import E8M0, quantize_fp4
    from tests.helpers.tiny import tiny_v4_config

    _random_model(tiny_v4_config(), path, seed)

    def quantize(k: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if V4_FP8.search(k):
            q, s = quantize_fp8(t.float(), E8M0)
        elif V4_FP4.search(k):
            q, s = quantize_fp4(t.float())
        else:
            return None
        return {k: q, k.removesuffix("weight") + "scale": s}

    return _rewrite(path, quantize, {"quantization_config": V4_QUANT, "expert_dtype": "fp4"})


def int4_folder(path, seed: int = 11) -> dict[str, int]:  # noqa: ANN001
    """The tiny test model (DeepSeek-V3's architecture) with random weights, its routed experts INT4 as Kimi-K2.5
    ships them (compressed-tensors pack-quantized, groups of 32 columns, bf16 scales). -> stored bytes."""
    from dstrain.model.hf.quantize import quantize_packed
    from tests.helpers.tiny import tiny_config

    _random_model(tiny_config(hidden_size=64, moe_intermediate_size=32), path, seed)

    def quantize(k: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if not EXPERT.search(k):
            return None
        packed, scale = quantize_packed(t.float(), 4, t.shape[1] // 32, torch.bfloat16)
        base = k.removesuffix("weight")
        return {f"{base}weight_packed": packed, f"{base}weight_scale": scale,
                f"{base}weight_shape": torch.tensor(t.shape, dtype=torch.int32)}  # fmt: skip

    return _rewrite(path, quantize, {"quantization_config": INT4})


def glm5n_fp8_folder(path) -> dict[str, int]:  # noqa: ANN001
    """transformers' tiny GLM-5.3-Flash (tests/model/glm5_next/conftest.py: with its vision tower) with every
    projection in the FP8 form its release ships. -> stored bytes."""
    from tests.model.glm5_next.conftest import glm_model

    glm_model().save_pretrained(path)
    return quantize_folder_fp8(path, KDA_HYBRID_FP8)
