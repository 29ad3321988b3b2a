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


def quantize_folder_fp8(path) -> dict[str, int]:  # noqa: ANN001 - a pathlib.Path
    """Rewrite the safetensors folder `path` with every projection in V3's FP8 form (one file), the config's
    quantization_config as V3's. -> the stored bytes (codes + scales) of each quantized HF weight."""
    dense = {}
    for f in sorted(path.glob("*.safetensors")):
        dense.update(load_file(f))
        f.unlink()
    (path / SAFE_INDEX).unlink(missing_ok=True)
    files, stored = {}, {}
    for k, t in dense.items():
        if FP8_LINEAR.search(k):
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
