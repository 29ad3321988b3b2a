"""The Hugging Face checkpoint format, below the model families: safetensors folders (files.py), quantized
weights (quant.py) and the reader by dstrain key (reader.py), told what keys mean by a family's `KeyTable`
(keys.py)."""

from .files import (
    DEFAULT_SHARD_BYTES,
    SAFE_INDEX,
    SAFE_WEIGHTS,
    SafetensorsFile,
    checkpoint_files,
    folder_identity,
    save_hf_tensors,
    write_config_files,
)
from .keys import KeyTable, Target, split_experts
from .reader import HFReader, flat_range

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "SAFE_INDEX",
    "SAFE_WEIGHTS",
    "HFReader",
    "KeyTable",
    "SafetensorsFile",
    "Target",
    "checkpoint_files",
    "flat_range",
    "folder_identity",
    "save_hf_tensors",
    "split_experts",
    "write_config_files",
]
