"""Read a Hugging Face DeepSeek folder by dstrain key, whole or in slices, without loading the rest.

The folder is indexed up front (names and shapes only), so a wrong folder fails before any weight is read.
Then each rank asks for exactly what it holds: a tensor-parallel slice along one dimension, a range of experts,
or a flat range of elements (a ZeRO-3 partition); only those bytes are read from the files.
`bytes_read` counts what was actually read, which is how tests check that no rank read the whole model.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

from .config import ModelConfig
from .hf import _pickle_files, checkpoint_files, hf_to_dstrain
from .model import is_expert_bias

FP8_BLOCK = 128
_FP8 = getattr(torch, "float8_e4m3fn", None)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's published FP8 weights: one scale per 128x128 block."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return weight.float() * scale


class HFReader:
    """dstrain key -> the HF tensors holding it (several for fused experts), read lazily."""

    def __init__(self, path: str | os.PathLike, cfg: ModelConfig, allow_unsafe_pickle: bool = False) -> None:
        self.path, self.cfg = str(path), cfg
        self.bytes_read = 0
        self.total_bytes = 0
        self._handles: dict[str, Any] = {}
        self._pickled: dict[str, torch.Tensor] = {}
        self.files = checkpoint_files(self.path, allow_unsafe_pickle)
        if not self.files:  # pickle, allowed: memory-mapped, so still read on demand
            for name in _pickle_files(self.path):
                file = os.path.join(self.path, name)
                # weights_only still refuses arbitrary objects: the flag only admits the pickle container.
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                self._pickled.update(state)
                self.files.update(dict.fromkeys(state, file))
        # dstrain key -> {(expert, half): HF key}
        self.sources: dict[str, dict[tuple[int | None, int | None], str]] = {}
        self.shared: dict[str, str] = {}  # MTP copies of the embedding/head -> the dstrain key they copy
        self.unexpected: list[str] = []
        for hf_key in self.files:
            if hf_key.endswith(".weight_scale_inv"):
                continue
            try:
                tgt = hf_to_dstrain(hf_key, cfg)
            except KeyError:
                self.unexpected.append(hf_key)
                continue
            if tgt.shared:
                self.shared[hf_key] = tgt.key
            else:
                self.sources.setdefault(tgt.key, {})[(tgt.expert, tgt.half)] = hf_key
                self.total_bytes += self._nbytes(hf_key)  # the model's bytes: MTP's copies are not read

    # ------------------------------------------------------------------ index
    def check(self, keys: list[str]) -> list[str]:
        """Raise on a folder that does not fit the model `keys`; -> the keys it lacks that may start fresh
        (MTP modules, which transformers' save_pretrained drops, and the expert bias)."""
        p = self.path
        if self.unexpected:
            raise ValueError(
                f"{p}: {len(self.unexpected)} tensors the config does not describe, e.g. {self.unexpected[0]}"
            )
        partial = [k for k in keys if k in self.sources and len(self.sources[k]) < self._pieces(k)]
        if partial:
            raise ValueError(f"{p}: some experts of {partial[0]} are missing from the checkpoint")
        missing = [k for k in keys if k not in self.sources]
        other = [k for k in missing if not k.startswith("mtp.") and not is_expert_bias(k)]
        if other:
            raise ValueError(f"{p}: {len(other)} tensors missing from the checkpoint, e.g. {other[0]}")
        return missing

    def _pieces(self, key: str) -> int:
        if key.endswith("experts.gate_up_proj"):
            return 2 * self.cfg.n_routed_experts
        if key.endswith("experts.down_proj"):
            return self.cfg.n_routed_experts
        return 1

    def full_shape(self, key: str) -> tuple[int, ...]:
        parts = self.sources[key]
        if (None, None) in parts:
            return self._shape(parts[(None, None)])
        if key.endswith("gate_up_proj"):
            rows, cols = self._shape(parts[(0, 0)])
            return (self.cfg.n_routed_experts, 2 * rows, cols)
        return (self.cfg.n_routed_experts, *self._shape(parts[(0, None)]))

    # ------------------------------------------------------------------ reading
    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The dstrain tensor `key`, or its [start:stop) slice along `dim`, in the checkpoint's dtype (FP8 is
        dequantized to fp32)."""
        parts = self.sources[key]
        if (None, None) in parts:
            return self._read_one(parts[(None, None)], dim, start, stop)
        # fused experts: dim 0 picks experts, which are separate HF tensors
        n = self.cfg.n_routed_experts
        lo, hi = (start, n if stop is None else stop) if dim == 0 else (0, n)
        experts = []
        for e in range(lo, hi):
            if key.endswith("gate_up_proj"):
                experts.append(torch.cat([self._read_one(parts[(e, 0)]), self._read_one(parts[(e, 1)])]))
            else:
                experts.append(self._read_one(parts[(e, None)]))
        out = torch.stack(experts)
        if dim not in (None, 0):
            out = out.narrow(dim, start, (out.shape[dim] if stop is None else stop) - start).contiguous()
        return out

    def read_flat(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the flattened tensor (a ZeRO-3 partition), zero-padded past its end.
        Reads only the dim-0 rows (or experts) the range touches."""
        shape = self.full_shape(key)
        numel = math.prod(shape)
        row = numel // shape[0] if shape else 1
        end = min(stop, numel)
        if start >= end:
            return torch.zeros(stop - start, dtype=self._dtype(key))
        r0, r1 = start // row, -(-end // row)
        flat = self.read(key, 0, r0, r1).reshape(-1) if shape else self.read(key).reshape(-1)
        flat = flat[start - r0 * row : end - r0 * row]
        if end < stop:
            flat = torch.cat([flat, flat.new_zeros(stop - end)])
        return flat

    def read_shared_copies(self) -> dict[str, torch.Tensor]:
        """The MTP layers' own copies of the embedding and head, by HF key."""
        return {k: self._read_one(k) for k in self.shared}

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
        self._pickled.clear()

    def __enter__(self) -> HFReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ one HF tensor
    def _handle(self, hf_key: str) -> SafetensorsFile:
        file = self.files[hf_key]
        if file not in self._handles:
            self._handles[file] = SafetensorsFile(file)
        return self._handles[file]

    def _entry(self, hf_key: str) -> dict[str, Any]:
        handle = self._handle(hf_key)
        if hf_key not in handle.entries:
            raise ValueError(
                f"{self.path}: the index puts {hf_key} in {os.path.basename(handle.path)}, which lacks it"
            )
        return handle.entries[hf_key]

    def _shape(self, hf_key: str) -> tuple[int, ...]:
        if hf_key in self._pickled:
            return tuple(self._pickled[hf_key].shape)
        return tuple(self._entry(hf_key)["shape"])

    def _dtype(self, key: str) -> torch.dtype:
        hf_key = next(iter(self.sources[key].values()))
        return torch.float32 if hf_key + "_scale_inv" in self.files else self._raw_dtype(hf_key)

    def _nbytes(self, hf_key: str) -> int:
        return math.prod(self._shape(hf_key)) * self._raw_dtype(hf_key).itemsize

    def _read_one(
        self, hf_key: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        scale_key = hf_key + "_scale_inv"
        if scale_key in self.files:  # FP8 blocks: dequantize whole, then slice
            t = dequantize_fp8(self._raw(hf_key), self._raw(scale_key))
            if dim is not None:
                t = t.narrow(dim, start, (t.shape[dim] if stop is None else stop) - start).contiguous()
            return t
        if _FP8 is not None and self._raw_dtype(hf_key) == _FP8:
            raise ValueError(f"{self.path}: FP8 tensor {hf_key} has no weight_scale_inv")
        return self._raw(hf_key, dim, start, stop)

    def _raw_dtype(self, hf_key: str) -> torch.dtype:
        if hf_key in self._pickled:
            return self._pickled[hf_key].dtype
        name = self._entry(hf_key)["dtype"]
        if name not in _SAFE_DTYPES:
            raise ValueError(f"{self.path}: {hf_key} has dtype {name}, which dstrain does not read")
        return _SAFE_DTYPES[name]

    def _raw(
        self, hf_key: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        if hf_key in self._pickled:
            t = self._pickled[hf_key]
            t = (
                t if dim is None else t.narrow(dim, start, (t.shape[dim] if stop is None else stop) - start)
            ).clone()
        else:
            t = self._handle(hf_key).read(hf_key, self._raw_dtype(hf_key), dim, start, stop)
        self.bytes_read += t.numel() * t.element_size()
        return t


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


_SAFE_DTYPES: dict[str, torch.dtype] = {
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
    **({"F8_E4M3": _FP8} if _FP8 is not None else {}),
}
