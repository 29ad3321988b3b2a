"""Build a model (meta device, then init), load it from / save it to a Hugging Face checkpoint folder."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from .config import ModelConfig
from .hf import DEFAULT_SHARD_BYTES, save_hf_tensors, to_hf, write_hf_config
from .init import FreshWeights, fill, held_device, init_weights, local_tensors, model_class
from .model import DeepSeekLM, is_expert_bias
from .presets import get_config
from .reader import HFReader, SafetensorsFile
from .v4_config import V4Config
from .v4_hf import keeps_fp32 as v4_keeps_fp32
from .v4_hf import open_v4, save_v4_folder, source_style, to_v4_hf, write_v4_config

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(_DTYPES)}")
    return _DTYPES[key]


def build_model(
    config: str | os.PathLike | ModelConfig | V4Config,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = torch.float32,
    seed: int | None = None,
    init: bool = True,
) -> nn.Module:
    """Construct on the meta device (no memory), materialise on `device`, then `init_weights` (seed None: one
    drawn from torch's global generator). A DeepSeekLM, or for a V4Config a DeepSeekV4LM."""
    cfg = get_config(config)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    if init:
        init_weights(model, seed)
    dtype = parse_dtype(dtype)
    if dtype is not None:
        model.to(dtype)
    return model


def _checkpoint_dtype(path: str) -> torch.dtype | None:
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    name = raw.get("dtype") or raw.get("torch_dtype")
    return _DTYPES.get(str(name).removeprefix("torch.")) if name else None


def materialize(module: nn.Module, device: str | torch.device, dtype: torch.dtype | None = None) -> None:
    """Give every meta parameter and buffer of `module` real (uninitialised) memory on `device`, keeping the
    Parameter's attributes (parallel layouts tag shards on them) and ties; `Module.to_empty` would drop both."""
    done: dict[int, torch.Tensor] = {}
    for prefix, m in module.named_modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in done:
                    want = dtype if dtype is not None and t.is_floating_point() else t.dtype
                    if want == dtype and stays_fp32(f"{prefix}.{name}" if prefix else name):
                        want = torch.float32
                    data = torch.empty(t.shape, dtype=want, device=device)
                    if isinstance(t, nn.Parameter):
                        new = nn.Parameter(data, requires_grad=t.requires_grad)
                        new.__dict__.update(t.__dict__)
                        done[id(t)] = new
                    else:
                        done[id(t)] = data
                table[name] = done[id(t)]


@torch.no_grad()
def fill_from_hf(model: DeepSeekLM, reader: HFReader, seed: int = 0) -> FreshWeights:
    """Copy each local tensor of `model` (not on meta: another pipeline stage's; a `tp_shard`/`ep_shard`
    slice reads only that slice) from the checkpoint. Missing MTP modules start fresh (with a warning), a
    missing expert bias at zero. -> the fresh values' source (its `bytes_drawn`: what started fresh)."""
    cfg = model.config
    missing = check_folder(reader, cfg)
    fresh = fill(model, FreshWeights(cfg, seed, held_device(model)), reader, missing)
    warn_fresh_mtp(reader.path, cfg, missing)
    return fresh


def check_folder(reader: HFReader, cfg: ModelConfig) -> list[str]:
    """Every tensor the model `cfg` describes is in the folder with its shape (from the files' headers, nothing
    read). -> the keys that may start fresh (MTP modules, the expert bias); anything else is a ValueError."""
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in local_tensors(model_class(cfg)(cfg))}
    missing = reader.check(list(shapes))
    for name, shape in shapes.items():
        if name not in missing and reader.full_shape(name) != shape:
            raise ValueError(
                f"{reader.path}: {name} has shape {reader.full_shape(name)}, the config implies {shape}"
            )
    return missing


def warn_fresh_mtp(path: str, cfg: ModelConfig, missing: list[str]) -> None:
    if any(k.startswith("mtp.") for k in missing):
        log.warning(
            "%s has no MTP weights (num_nextn_predict_layers=%d): MTP modules are initialised fresh",
            path,
            cfg.num_nextn_predict_layers,
        )


def from_pretrained(
    path: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    allow_unsafe_pickle: bool = False,
    config: ModelConfig | V4Config | None = None,
    seed: int = 0,
) -> nn.Module:
    """Load an HF DeepSeek-V2/V3/V3.2/V4 folder (config.json + safetensors, single or sharded; V4 in DeepSeek's
    or transformers' key names, FP8/FP4 dequantized) tensor by tensor.

    dtype None keeps the checkpoint's dtype (config `dtype`/`torch_dtype`); the expert bias stays fp32.
    MTP layers missing from the folder (transformers' save_pretrained drops them) are initialised fresh.
    """
    path = str(path)
    cfg = config or get_config(path)
    dtype = parse_dtype(dtype) or _checkpoint_dtype(path) or torch.float32
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    materialize(model, device, dtype)
    with open_folder(path, cfg, allow_unsafe_pickle) as reader:
        fill_from_hf(model, reader, seed)
        _check_shared_copies(reader, model)
    return model


def open_folder(path: str, cfg: ModelConfig | V4Config, allow_unsafe_pickle: bool = False) -> HFReader:
    """The reader of a checkpoint folder of the model `cfg` describes."""
    if isinstance(cfg, V4Config):
        return open_v4(path, cfg)
    return HFReader(path, cfg, allow_unsafe_pickle)


def hf_tensors(
    items: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig | V4Config, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """dstrain (key, tensor) pairs -> the checkpoint folder's (key, tensor) pairs, in the family's format
    (DeepSeek-V4: the key style of the folder it came from), floating tensors in `dtype` (the expert bias and
    V4's fp32 tensors stay fp32)."""
    if isinstance(cfg, V4Config):
        return to_v4_hf(items, cfg, source_style(cfg), dtype)
    return to_hf(items, cfg, dtype)


def write_config(
    cfg: ModelConfig | V4Config, path: str | os.PathLike, dtype: torch.dtype, generation: dict | None = None
) -> None:
    """config.json (weights declared `dtype`, dequantized) and generation_config.json, in the family's form."""
    if isinstance(cfg, V4Config):
        write_v4_config(cfg, path, dtype, generation)
    else:
        write_hf_config(cfg, path, dtype, generation)


def stays_fp32(key: str) -> bool:
    """A tensor kept (and saved) in fp32 whatever the weights' dtype: the expert bias, and DeepSeek-V4's
    fp32 tensors (mHC weights, sinks, compressor position biases; no V2/V3 name is one of them)."""
    return is_expert_bias(key) or v4_keeps_fp32(key)


def _check_shared_copies(reader: HFReader, model: DeepSeekLM) -> None:
    state = model.state_dict()
    for hf_key, t in reader.read_shared_copies().items():
        key = reader.shared[hf_key]
        if not torch.equal(t.to(state[key].dtype), state[key]):
            log.warning("%s differs from %s; dstrain ties MTP embedding/head to the main ones", hf_key, key)


@contextlib.contextmanager
def tensors_beside(
    cfg: ModelConfig, source: str | os.PathLike | None
) -> Iterator[list[tuple[str, SafetensorsFile]]]:
    """The tensors of a multimodal checkpoint that are not its text model's (vision tower, projector), each
    with the file of `source`, the folder the text model came from, that holds it: for `save_hf_tensors` to
    copy byte for byte. [] for a text model's own checkpoint."""
    if cfg.wrapper is None:
        yield []
        return
    if not source or not os.path.isdir(source):
        kind = cfg.hf_source["outer"]["model_type"]
        raise ValueError(
            f"a {kind} folder's vision tower and projector are copied from the folder its text model came "
            f"from, and {source!r} is not one"
        )
    with HFReader(source, cfg) as reader:
        yield reader.others_in_files()


def save_pretrained(
    model: DeepSeekLM,
    path: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    source: str | os.PathLike | None = None,
) -> None:
    """Write config.json, generation_config.json and safetensors (sharded with an index past max_shard_bytes)
    in the official DeepSeek layout. The expert bias is always written in fp32. The text model of a multimodal
    checkpoint (Kimi-K2.5) is written inside it: its other tensors copied byte for byte from `source` (by
    default the folder the model was loaded from), its config.json around the text model's."""
    dtype = parse_dtype(dtype)
    cfg = model.config
    if isinstance(cfg, V4Config):  # in the key names and config.json form of the folder it came from
        save_v4_folder(model.state_dict().items(), cfg, path, dtype=dtype, max_shard_bytes=max_shard_bytes)
        return
    with tensors_beside(cfg, source or (cfg.hf_source or {}).get("folder")) as copied:
        save_hf_tensors(to_hf(model.state_dict().items(), cfg, dtype), path, max_shard_bytes, copied)
    write_hf_config(cfg, path, dtype or model.embed_tokens.weight.dtype)
