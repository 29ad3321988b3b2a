"""Safetensors folders as Hugging Face writes them: one file or shards with an index, read by byte ranges (a
slice reads only its bytes), written in shards of at most a size; tensors copied byte for byte."""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 1024**3


def checkpoint_files(path: str | os.PathLike, allow_unsafe_pickle: bool = False) -> dict[str, str]:
    """HF key -> safetensors file holding it; {} for a pickle-only folder when `allow_unsafe_pickle`."""
    path = str(path)
    index = os.path.join(path, SAFE_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, SAFE_WEIGHTS)
    if os.path.isfile(single):
        with safe_open(single, "pt") as f:
            return {k: single for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    bins = pickle_files(path)
    if bins and not allow_unsafe_pickle:
        raise ValueError(
            f"{path} holds only pickle weights ({bins[0]}): dstrain loads safetensors; convert them (in Python, "
            "from_pretrained(..., allow_unsafe_pickle=True) reads them if you trust the files)"
        )
    if bins:
        return {}
    raise ValueError(f"{path}: no {SAFE_WEIGHTS} or {SAFE_INDEX}")


def folder_identity(path: str | os.PathLike) -> dict[str, Any]:
    """What tells a weights folder from another without reading its tensors: each safetensors file's size, and
    a SHA-256 over the index and every file's header (names, dtypes, shapes, offsets)."""
    digest = hashlib.sha256()
    index = os.path.join(path, SAFE_INDEX)
    if os.path.isfile(index):
        with open(index, "rb") as f:
            digest.update(f.read())
    sizes = {}
    for file in sorted(set(checkpoint_files(path).values())):
        sizes[os.path.basename(file)] = os.path.getsize(file)
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            digest.update(f.read(n))
    return {"sizes": sizes, "sha256": digest.hexdigest()}


def pickle_files(path: str) -> list[str]:
    """The folder's pickle weight files (`*.bin`)."""
    return sorted(n for n in os.listdir(path) if n.endswith(".bin"))


def save_hf_tensors(
    tensors: Iterator[tuple[str, torch.Tensor]],
    path: str | os.PathLike,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    copied: Sequence[tuple[str, SafetensorsFile]] = (),
) -> list[str]:
    """Write (key, tensor) pairs as safetensors shards; an index is written when there is more than one.
    `copied`: (key, the file it is in) of tensors copied byte for byte (a multimodal checkpoint's vision
    tower: not the model's, never read as tensors), in shards of their own after the model's."""
    path = str(path)
    os.makedirs(path, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    tmp_names: list[str] = []
    weight_map: dict[str, int] = {}
    total = 0

    def flush() -> None:
        name = f"_shard{len(tmp_names)}.tmp"
        save_file(shards[-1], os.path.join(path, name), metadata={"format": "pt"})
        tmp_names.append(name)
        shards[-1] = {}

    for key, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        # contiguous clone: views of fused tensors must not share storage in the file
        shards[-1][key] = t.detach().to("cpu").contiguous().clone()
        weight_map[key] = len(tmp_names)
        size += nbytes
        total += nbytes
    if shards[-1] or not tmp_names:
        flush()
    for group in _by_size(copied, max_shard_bytes):  # copied tensors: shards of their own
        name = f"_shard{len(tmp_names)}.tmp"
        total += write_raw(os.path.join(path, name), group)
        weight_map.update(dict.fromkeys((k for k, _ in group), len(tmp_names)))
        tmp_names.append(name)
    n = len(tmp_names)
    if n == 1:
        names = [SAFE_WEIGHTS]
    else:
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for tmp, name in zip(tmp_names, names, strict=True):
        os.replace(os.path.join(path, tmp), os.path.join(path, name))
    if n > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {k: names[i] for k, i in sorted(weight_map.items())},
        }
        with open(os.path.join(path, SAFE_INDEX), "w") as f:
            json.dump(index, f, indent=2)
    return names


def _by_size(
    copied: Sequence[tuple[str, SafetensorsFile]], max_bytes: int
) -> Iterator[list[tuple[str, SafetensorsFile]]]:
    """`copied` in consecutive groups of at most `max_bytes` (a larger tensor alone)."""
    group: list[tuple[str, SafetensorsFile]] = []
    size = 0
    for key, src in copied:
        if group and size + src.nbytes(key) > max_bytes:
            yield group
            group, size = [], 0
        group.append((key, src))
        size += src.nbytes(key)
    if group:
        yield group


class SafetensorsFile:
    """Reads exactly the bytes of a tensor or slice into fresh memory with pread. (safetensors' own reader
    memory-maps the file, and every page a read touches then counts as this process's memory until the map
    closes: loading would look, and under pressure be, a copy of the folder larger.)"""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        n = int.from_bytes(os.pread(self.fd, 8, 0), "little")
        self.entries: dict[str, Any] = json.loads(os.pread(self.fd, n, 8))
        self.entries.pop("__metadata__", None)
        self.base = 8 + n

    def read(
        self, key: str, dtype: torch.dtype, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        entry = self.entries[key]
        shape = list(entry["shape"])
        offset = self.base + entry["data_offsets"][0]
        if not shape:
            return self._bytes(offset, dtype.itemsize).view(dtype).reshape(())
        if dim is None:
            dim, start, stop = 0, 0, shape[0]
        stop = shape[dim] if stop is None else stop
        outer = math.prod(shape[:dim])
        inner = math.prod(shape[dim + 1 :]) * dtype.itemsize
        chunk, stride = (stop - start) * inner, shape[dim] * inner
        if outer == 1 or chunk == stride:  # one contiguous range
            out = self._bytes(offset + start * inner, outer * chunk)
        else:  # a column block of every row: one read per row
            out = torch.empty(outer * chunk, dtype=torch.uint8)
            for i in range(outer):
                self._read_into(out[i * chunk : (i + 1) * chunk], offset + i * stride + start * inner)
        shape[dim] = stop - start
        return out.view(dtype).reshape(shape)

    def nbytes(self, key: str) -> int:
        start, end = self.entries[key]["data_offsets"]
        return end - start

    def copy_to(self, key: str, out: BinaryIO, chunk: int = 64 * 1024**2) -> None:
        """Write tensor `key`'s bytes as the file holds them."""
        offset = self.base + self.entries[key]["data_offsets"][0]
        left = self.nbytes(key)
        while left:
            data = os.pread(self.fd, min(chunk, left), offset)
            if not data:
                raise ValueError(f"{self.path}: truncated safetensors file (tensor data past its end)")
            out.write(data)
            offset, left = offset + len(data), left - len(data)

    def _bytes(self, offset: int, size: int) -> torch.Tensor:
        out = torch.empty(size, dtype=torch.uint8)
        self._read_into(out, offset)
        return out

    def _read_into(self, out: torch.Tensor, offset: int) -> None:
        view = memoryview(out.numpy()).cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise ValueError(f"{self.path}: truncated safetensors file (tensor data past its end)")
            done += got

    def close(self) -> None:
        os.close(self.fd)


def write_raw(path: str, tensors: Sequence[tuple[str, SafetensorsFile]]) -> int:
    """A safetensors file of tensors copied byte for byte from the files holding them: the same dtype (as the
    header names it, whether torch has it or not), shape and bytes. -> bytes of tensor data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    end = 0
    for key, src in tensors:
        entry = src.entries[key]
        header[key] = {
            "dtype": entry["dtype"],
            "shape": entry["shape"],
            "data_offsets": [end, end + src.nbytes(key)],
        }
        end += src.nbytes(key)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for key, src in tensors:
            src.copy_to(key, f)
    return end


FP8 = getattr(torch, "float8_e4m3fn", None)
E8M0 = getattr(torch, "float8_e8m0fnu", None)
SAFE_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    **({"F8_E4M3": FP8} if FP8 is not None else {}),
    **({"F8_E8M0": E8M0} if E8M0 is not None else {}),
}


def write_config_files(
    path: str | os.PathLike,
    config: dict[str, Any],
    dtype: torch.dtype,
    generation: dict | None,
    tokens: Any,
    dropped: Sequence[str] = ("quantization_config",),
) -> None:
    """config.json (`config`, a family's dict in its source form, declaring the weights `dtype` under the name
    or names the source used (transformers 5's `dtype`, older `torch_dtype`) and without the `dropped` keys: the
    weights are written dequantized) and generation_config.json (`generation`, else the special token ids
    `tokens` (a config) sets)."""
    config = {k: v for k, v in config.items() if k not in dropped}
    for name in [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]:
        config[name] = str(dtype).removeprefix("torch.")
    if generation is None:
        ids = ("bos_token_id", "eos_token_id", "pad_token_id")
        generation = {k: getattr(tokens, k) for k in ids if getattr(tokens, k, None) is not None}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)
