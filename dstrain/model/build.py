"""Build a model (meta device, then its weights from a source), load it from / save it to a Hugging Face
checkpoint folder, in the format of its family."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from .hf import DEFAULT_SHARD_BYTES, save_hf_tensors
from .registry import family_of, get_config, on_meta
from .sources import Weights, fill, init_weights

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(_DTYPES)}")
    return _DTYPES[key]


def build_model(
    config: object,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = torch.float32,
    seed: int | None = None,
    init: bool = True,
) -> nn.Module:
    """Construct on the meta device (no memory), materialise on `device`, then `init_weights` (seed None: one
    drawn from torch's global generator). `config`: a preset name, a folder or a config (its family's model)."""
    cfg = get_config(config)
    model = on_meta(cfg)
    # on meta already, to_empty would only cost torch's meta functions (0.3 s at a run's plan)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
    model.tie_weights()
    if init:
        init_weights(model, seed)
    dtype = parse_dtype(dtype)
    if dtype is not None:
        cast(model, dtype)
    return model


def cast(model: nn.Module, dtype: torch.dtype) -> None:
    """`model.to(dtype)` for floating parameters and buffers, except those the model's family keeps in fp32
    (DeepSeek-V4's mHC weights, sinks and position biases, every expert bias), which stay fp32."""
    keeps_fp32 = family_of(model.config).keeps_fp32
    for prefix, m in model.named_modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is None or not t.is_floating_point():
                    continue
                want = torch.float32 if keeps_fp32(f"{prefix}.{name}" if prefix else name) else dtype
                if isinstance(t, nn.Parameter):
                    t.data = t.data.to(want)  # the same Parameter: ties and attributes stay
                else:
                    table[name] = t.to(want)


def trainable_counts(cfg: Any, lora: Any, dsa_stage: str | None) -> tuple[int, int, tuple[str, ...]]:
    """(elements that train, all elements, the LoRA-adapted module names) of a fine-tune with the LoRA options
    `lora` (lora_r, lora_alpha, targets, train_router, train_mtp) and the resolved sparse-attention stage,
    marked on a meta-device copy by the functions a run's build calls (apply_lora, set_trainable). ValueError
    for targets that match nothing."""
    model, names = finetune_on_meta(cfg, lora, dsa_stage)
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad), total, tuple(names)


def finetune_on_meta(cfg: Any, lora: Any, dsa_stage: str | None) -> tuple[nn.Module, list[str]]:
    """The model on meta with the LoRA options applied (`trainable_counts`) -> (model, adapted module names)."""
    from .common.lora import apply_lora, set_trainable

    model = build_model(cfg, device="meta")
    names = apply_lora(model, lora.lora_r, lora.lora_alpha, lora.targets) if lora.lora_r > 0 else []
    stage = dsa_stage if cfg.sparse_attention else None
    set_trainable(model, bool(lora.train_router), bool(lora.train_mtp), stage)
    return model, names


def _checkpoint_dtype(path: str) -> torch.dtype | None:
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    name = raw.get("dtype") or raw.get("torch_dtype")
    return _DTYPES.get(str(name).removeprefix("torch.")) if name else None


def materialize(module: nn.Module, device: str | torch.device, dtype: torch.dtype | None = None) -> None:
    """Give every meta parameter and buffer of `module` real (uninitialised) memory on `device`, keeping the
    Parameter's attributes (parallel layouts tag shards on them) and ties; `Module.to_empty` would drop both.
    `dtype`: floating tensors' (those the model's family keeps in fp32 stay fp32)."""
    keeps_fp32 = family_of(module.config).keeps_fp32 if dtype is not None else None
    done: dict[int, torch.Tensor] = {}
    for prefix, m in module.named_modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in done:
                    want = dtype if dtype is not None and t.is_floating_point() else t.dtype
                    if want == dtype and keeps_fp32(f"{prefix}.{name}" if prefix else name):
                        want = torch.float32
                    data = torch.empty(t.shape, dtype=want, device=device)
                    if isinstance(t, nn.Parameter):
                        new = nn.Parameter(data, requires_grad=t.requires_grad)
                        new.__dict__.update(t.__dict__)
                        done[id(t)] = new
                    else:
                        done[id(t)] = data
                table[name] = done[id(t)]


def from_pretrained(
    path: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    allow_unsafe_pickle: bool = False,
    config: object | None = None,
    seed: int = 0,
) -> nn.Module:
    """Load a Hugging Face folder of any family (config.json + safetensors, single or sharded; DeepSeek-V4 in
    DeepSeek's or transformers' key names; FP8/FP4/INT4 dequantized) tensor by tensor.

    dtype None keeps the checkpoint's dtype (config `dtype`/`torch_dtype`); the expert bias stays fp32.
    MTP layers missing from the folder (transformers' save_pretrained drops them) are initialised fresh.
    """
    path = str(path)
    cfg = config or get_config(path)
    dtype = parse_dtype(dtype) or _checkpoint_dtype(path) or torch.float32
    model = on_meta(cfg)
    materialize(model, device, dtype)
    with Weights(cfg, seed, device, folder=path, allow_unsafe_pickle=allow_unsafe_pickle) as weights:
        fill(model, weights)
        weights.check_shared_copies(model)
    return model


def hf_tensors(
    items: Iterable[tuple[str, torch.Tensor]], cfg: object, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """dstrain (key, tensor) pairs -> the checkpoint folder's (key, tensor) pairs, in the format of the config's
    family, floating tensors in `dtype` (those the family keeps in fp32 stay fp32)."""
    return family_of(cfg).to_hf(items, cfg, dtype)


def write_config(
    cfg: object, path: str | os.PathLike, dtype: torch.dtype, generation: dict | None = None
) -> None:
    """config.json (weights declared `dtype`, dequantized) and generation_config.json, in the family's form."""
    family_of(cfg).write_config(cfg, path, dtype, generation)


def save_pretrained(
    model: nn.Module,
    path: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    source: str | os.PathLike | None = None,
) -> None:
    """Write config.json, generation_config.json and safetensors (sharded with an index past max_shard_bytes)
    in the format of the model's family, as the folder it came from names its tensors. The text model of a
    multimodal checkpoint (Kimi-K2.5) is written inside it: its other tensors copied byte for byte from `source`
    (by default the folder the model was loaded from), its config.json around the text model's."""
    dtype = parse_dtype(dtype)
    cfg = model.config
    family = family_of(cfg)
    with family.copied_tensors(cfg, source or (cfg.hf_source or {}).get("folder")) as copied:
        save_hf_tensors(family.to_hf(model.state_dict().items(), cfg, dtype), path, max_shard_bytes, copied)
    family.write_config(cfg, path, dtype or model.embed_tokens.weight.dtype)
