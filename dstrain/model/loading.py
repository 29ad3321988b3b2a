"""Build a model (meta device, then init), load it from / save it to a Hugging Face checkpoint folder."""

from __future__ import annotations

import json
import logging
import os

import torch

from .config import ModelConfig, get_config
from .hf import DEFAULT_SHARD_BYTES, hf_to_dstrain, iter_checkpoint, save_hf_tensors, to_hf
from .model import DeepSeekLM

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FP8_BLOCK = 128


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(_DTYPES)}")
    return _DTYPES[key]


def build_model(
    config: str | os.PathLike | ModelConfig,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = torch.float32,
    seed: int | None = None,
    init: bool = True,
) -> DeepSeekLM:
    """Construct on the meta device (no memory), materialise on `device`, then `init_weights()`."""
    cfg = get_config(config)
    with torch.device("meta"):
        model = DeepSeekLM(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    if init:
        gen = None
        if seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed)
        model.init_weights(gen)
    dtype = parse_dtype(dtype)
    if dtype is not None:
        model.to(dtype)
    return model


def _checkpoint_dtype(path: str) -> torch.dtype | None:
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    name = raw.get("dtype") or raw.get("torch_dtype")
    return _DTYPES.get(str(name).removeprefix("torch.")) if name else None


def _dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's published FP8 weights: one scale per 128x128 block."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return weight.float() * scale


def from_pretrained(
    path: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    allow_unsafe_pickle: bool = False,
    config: ModelConfig | None = None,
) -> DeepSeekLM:
    """Load an HF DeepSeek-V3/V2 folder (config.json + safetensors, single or sharded) tensor by tensor.

    dtype None keeps the checkpoint's dtype (config `dtype`/`torch_dtype`); the expert bias stays fp32.
    MTP layers missing from the folder (transformers' save_pretrained drops them) are initialised fresh.
    """
    path = str(path)
    cfg = config or ModelConfig.from_folder(path)
    dtype = parse_dtype(dtype) or _checkpoint_dtype(path) or torch.float32
    model = build_model(cfg, device=device, dtype=dtype, init=False)
    state = model.state_dict(keep_vars=True)
    filled: dict[str, set] = {k: set() for k in state}
    pending_fp8: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    shared_copies: dict[str, torch.Tensor] = {}

    def place(hf_key: str, t: torch.Tensor) -> None:
        try:
            tgt = hf_to_dstrain(hf_key, cfg)
        except KeyError:
            unexpected.append(hf_key)
            return
        if tgt.shared:
            shared_copies[hf_key] = t
            return
        param = state[tgt.key]
        dest = param.data
        if tgt.expert is not None:
            dest = dest[tgt.expert]
            if tgt.half is not None:
                i = cfg.moe_intermediate_size
                dest = dest[tgt.half * i : (tgt.half + 1) * i]
        if dest.shape != t.shape:
            raise ValueError(
                f"{path}: {hf_key} has shape {tuple(t.shape)}, the config implies {tuple(dest.shape)}"
            )
        dest.copy_(t)
        filled[tgt.key].add((tgt.expert, tgt.half))

    with torch.no_grad():
        for hf_key, t in iter_checkpoint(path, allow_unsafe_pickle):
            if hf_key.endswith(".weight_scale_inv"):
                base = hf_key.removesuffix("_scale_inv")
                if base in pending_fp8:
                    place(base, _dequantize_fp8(pending_fp8.pop(base), t))
                else:
                    scales[base] = t
            elif t.dtype == getattr(torch, "float8_e4m3fn", None):
                if hf_key in scales:
                    place(hf_key, _dequantize_fp8(t, scales.pop(hf_key)))
                else:
                    pending_fp8[hf_key] = t
            else:
                place(hf_key, t)
    if pending_fp8:
        raise ValueError(f"{path}: FP8 tensor {next(iter(pending_fp8))} has no weight_scale_inv")
    if unexpected:
        raise ValueError(
            f"{path}: {len(unexpected)} tensors the config does not describe, e.g. {unexpected[0]}"
        )
    _check_shared_copies(shared_copies, state, cfg)
    if cfg.tie_word_embeddings:
        filled["lm_head.weight"] = filled["embed_tokens.weight"]
    partial = [k for k, got in filled.items() if got and len(got) < _pieces(k, cfg)]
    if partial:
        raise ValueError(f"{path}: some experts of {partial[0]} are missing from the checkpoint")
    missing = [k for k, got in filled.items() if not got]
    missing_mtp = [k for k in missing if k.startswith("mtp.")]
    other = [k for k in missing if not k.startswith("mtp.") and not k.endswith("e_score_correction_bias")]
    if other:
        raise ValueError(f"{path}: {len(other)} tensors missing from the checkpoint, e.g. {other[0]}")
    with torch.no_grad():
        for key in missing:
            if key.endswith("e_score_correction_bias"):
                state[key].data.zero_()
    if missing_mtp:
        log.warning(
            "%s has no MTP weights (num_nextn_predict_layers=%d): MTP modules are initialised fresh",
            path,
            cfg.num_nextn_predict_layers,
        )
        model.init_weights(modules=list(model.mtp))
    return model


def _pieces(key: str, cfg: ModelConfig) -> int:
    """How many HF tensors fill one dstrain tensor."""
    if key.endswith("experts.gate_up_proj"):
        return 2 * cfg.n_routed_experts
    if key.endswith("experts.down_proj"):
        return cfg.n_routed_experts
    return 1


def _check_shared_copies(
    copies: dict[str, torch.Tensor], state: dict[str, torch.Tensor], cfg: ModelConfig
) -> None:
    for hf_key, t in copies.items():
        tgt = hf_to_dstrain(hf_key, cfg)
        if not torch.equal(t.to(state[tgt.key].dtype), state[tgt.key].data):
            log.warning(
                "%s differs from %s; dstrain ties MTP embedding/head to the main ones", hf_key, tgt.key
            )


def save_pretrained(
    model: DeepSeekLM,
    path: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """Write config.json, generation_config.json and safetensors (sharded with an index past max_shard_bytes)
    in the official DeepSeek layout. The expert bias is always written in fp32."""
    path = str(path)
    cfg = model.config
    dtype = parse_dtype(dtype)
    state = model.state_dict()

    def tensors():
        for key, t in to_hf(state, cfg):
            if dtype is not None and t.is_floating_point() and not key.endswith("e_score_correction_bias"):
                t = t.to(dtype)
            yield key, t

    save_hf_tensors(tensors(), path, max_shard_bytes)
    out_dtype = dtype or model.embed_tokens.weight.dtype
    hf_cfg = cfg.to_hf_dict()
    hf_cfg.pop("quantization_config", None)  # weights are written dequantized
    hf_cfg["dtype"] = str(out_dtype).removeprefix("torch.")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2, sort_keys=True)
    gen = {
        k: getattr(cfg, k)
        for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        if getattr(cfg, k) is not None
    }
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
