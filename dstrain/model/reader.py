"""Read a Hugging Face DeepSeek folder by dstrain key, whole or in slices, without loading the rest.

The folder is indexed up front (names and shapes only), so a wrong folder fails before any weight is read.
Then each rank asks for exactly what it holds: a tensor-parallel slice along one dimension, a range of experts,
or a flat range of elements (a ZeRO-3 partition); only those bytes are read from the files.
`bytes_read` counts what was actually read, which is how tests check that no rank read the whole model.
Quantized weights (DeepSeek's FP8 blocks and FP4 experts, compressed-tensors' packed integers: QUANTIZED) are
dequantized to fp32 as they are read; a multimodal checkpoint's tensors outside its text model are indexed,
never read.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any, BinaryIO, NamedTuple

import torch

from .config import ModelConfig
from .hf import Target, _pickle_files, checkpoint_files, hf_to_dstrain
from .model import is_expert_bias

FP8_BLOCK = 128
FP4_BLOCK = 32
_FP8 = getattr(torch, "float8_e4m3fn", None)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
# e2m1 by its 4 bits: the sign is the high bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """DeepSeek's published FP8 weights: one scale per 128x128 block (V3: fp32 `weight_scale_inv`, V4: e8m0
    `scale`, a power of two), the last blocks of a shape not a multiple of 128 cut short."""
    rows, cols = weight.shape
    grid = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"FP8 weight {rows}x{cols} needs a {grid[0]}x{grid[1]} scale grid, not {tuple(scale_inv.shape)}"
        )
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return weight.float() * scale


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's published routed experts: two e2m1 values per int8 byte (the low nibble the even column),
    one e8m0 scale per 32 input columns. -> the fp32 weight, twice as wide as `packed` (exact: a small float
    times a power of two)."""
    octets = packed.contiguous().view(torch.uint8)
    codes = torch.stack([octets & 15, octets >> 4], -1).reshape(packed.shape[0], -1)
    rows, cols = codes.shape
    if tuple(scale.shape) != (rows, -(-cols // FP4_BLOCK)):
        raise ValueError(
            f"FP4 weight {rows}x{cols} needs {rows}x{-(-cols // FP4_BLOCK)} scales, not {tuple(scale.shape)}"
        )
    values = torch.tensor(FP4_VALUES)[codes.long()]
    return values * scale.float().repeat_interleave(FP4_BLOCK, 1)[:, :cols]


def dequantize_scaled(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's `X.weight` + `X.scale`: FP8 blocks or packed FP4, told apart by the weight's dtype."""
    if weight.dtype == torch.int8:
        return dequantize_fp4(weight, scale)
    if weight.dtype != _FP8:
        raise ValueError(
            f"a weight with a scale is FP8 (float8_e4m3fn) or packed FP4 (int8), not {weight.dtype}"
        )
    return dequantize_fp8(weight, scale)


def dequantize_packed(
    packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, zero_point: torch.Tensor | None = None
) -> torch.Tensor:
    """compressed-tensors' "pack-quantized" weights (Kimi-K2.5's INT4 routed experts): integers of `bits` bits
    packed densely along the input dim into int32 words, low bits first, stored offset by 2**(bits-1); one
    scale per group of input columns (a channel: one group); an asymmetric zero point packed the same way
    along the output dim. -> the exact fp32 weight of `shape`."""
    rows, cols = (int(n) for n in shape)
    words = packed.shape[-1]
    bits = 32 * words // cols
    if bits not in (1, 2, 4, 8) or -(-cols * bits // 32) != words:
        raise ValueError(f"{words} int32 words per row of {cols} integers: dstrain reads 1, 2, 4 or 8 bits")
    group = -(-cols // scale.shape[-1])

    def per_column(t: torch.Tensor) -> torch.Tensor:
        return t.float().repeat_interleave(group, 1)[:, :cols]

    q = _unpack(packed, bits, cols)
    if zero_point is not None:
        q = q - per_column(_unpack(zero_point.t(), bits, rows).t())
    return q * per_column(scale)


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The first `n` integers of each row of int32 words (a word's low bits first: its bytes in order on a
    little-endian host), as fp32 without the storage offset."""
    octets = packed.contiguous().view(torch.uint8)
    q = (octets.unsqueeze(-1) >> torch.arange(0, 8, bits, dtype=torch.uint8)) & (2**bits - 1)
    return q.reshape(packed.shape[0], -1)[:, :n].float() - 2 ** (bits - 1)


class Form(NamedTuple):
    """How a file holds a weight `X.weight` quantized."""

    parts: tuple[str, ...]
    """Its tensors, by the suffix replacing `weight` ("weight": X.weight itself), in `dequantize`'s order."""
    dequantize: Callable[..., torch.Tensor]
    """The dense fp32 weight of the parts."""
    optional: tuple[str, ...] = ()
    """Parts it may have besides (passed after the others)."""


# Quantized weights by the tensor that marks the form: the file holds it beside X.weight or instead of it.
QUANTIZED: dict[str, Form] = {
    # DeepSeek-V3's FP8: X.weight in float8_e4m3fn, one inverse scale per 128x128 block
    "weight_scale_inv": Form(("weight", "weight_scale_inv"), dequantize_fp8),
    # DeepSeek-V4's FP8 (128x128 blocks) and FP4 (routed experts, 1x32 blocks): X.weight beside an e8m0 X.scale
    "scale": Form(("weight", "scale"), dequantize_scaled),
    # compressed-tensors' pack-quantized integers, in place of X.weight
    "weight_packed": Form(
        ("weight_packed", "weight_scale", "weight_shape"), dequantize_packed, ("weight_zero_point",)
    ),
}


def form_of(parts: Iterable[str]) -> Form | None:
    """The form (QUANTIZED) of a weight stored as these parts; None: one dstrain does not read (an unknown
    part, e.g. compressed-tensors' activation-ordered `weight_g_idx`, or a missing one)."""
    parts = set(parts)
    for marker, form in QUANTIZED.items():
        need = set(form.parts) - {"weight"}
        if marker in parts and need <= parts <= need | set(form.optional):
            return form
    return None


def packed_bits(cfg: ModelConfig) -> int:
    """The width of compressed-tensors' packed integers, from the quantization_config (the text model's, or
    that of the multimodal checkpoint around it): what a packed weight's shape is, from the file headers."""
    outer = (cfg.hf_source or {}).get("outer") or {}
    quant = cfg.extra.get("quantization_config") or outer.get("quantization_config") or {}
    bits = {g["weights"]["num_bits"] for g in quant.get("config_groups", {}).values() if g.get("weights")}
    if len(bits) != 1:
        found = ", ".join(map(str, sorted(bits))) or "none"
        raise ValueError(
            f"packed weights need one num_bits in config.json's quantization_config, found {found}"
        )
    return int(bits.pop())


def flat_range(
    read: Callable[..., torch.Tensor],
    shape: Sequence[int],
    start: int,
    stop: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Elements [start, stop) of a flattened tensor of `shape`, zero-padded past its end, from
    `read(dim, start, stop)` of only the dim-0 rows the range touches (`read()`: a 0-d tensor whole)."""
    numel = math.prod(shape)
    row = numel // shape[0] if shape else 1
    end = min(stop, numel)
    if start >= end:
        return torch.zeros(stop - start, dtype=dtype, device=device)
    r0, r1 = start // row, -(-end // row)
    flat = read(0, r0, r1).reshape(-1) if shape else read().reshape(-1)
    flat = flat[start - r0 * row : end - r0 * row]
    if end < stop:
        flat = torch.cat([flat, flat.new_zeros(stop - end)])
    return flat


class HFReader:
    """dstrain key -> the HF tensors holding it (several for fused experts), read lazily."""

    def __init__(
        self,
        path: str | os.PathLike,
        cfg: ModelConfig,
        allow_unsafe_pickle: bool = False,
        key_map: Callable[[str], Target] | None = None,
    ) -> None:
        """`key_map`: HF key -> where it lives in dstrain (KeyError: not the model's); by default
        `hf.hf_to_dstrain` of `cfg` (DeepSeek-V2/V3 names), DeepSeek-V4's from v4_hf."""
        self.path, self.cfg = str(path), cfg
        key_map = key_map or partial(hf_to_dstrain, cfg=cfg)
        prefix = getattr(cfg, "hf_prefix", "")  # a V4Config has no multimodal wrapper
        self.bytes_read = 0
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
        self.quantized: dict[str, dict[str, str]] = {}  # X.weight -> {part: HF key} of its quantized form
        # a multimodal checkpoint's tensors outside its text model (vision tower, projector): not read
        self.others: list[str] = []
        for hf_key in self.files:
            if not hf_key.startswith(prefix):
                self.others.append(hf_key)
                continue
            base, _, leaf = hf_key.rpartition(".")
            # a part of X.weight's quantized form (V4's `X.scale` only beside an X.weight: DeepSeek's mHC
            # scalars are `hc_attn_scale`, but a bare `.scale` is no quantization scale)
            if leaf.startswith("weight_") or (leaf == "scale" and f"{base}.weight" in self.files):
                self.quantized.setdefault(f"{base}.weight", {})[leaf] = hf_key
                if leaf not in QUANTIZED or "weight" in QUANTIZED[leaf].parts:
                    continue
                hf_key = f"{base}.weight"  # the form replaces X.weight: it stands for it
            try:
                tgt = key_map(hf_key)
            except KeyError:
                self.unexpected.append(hf_key)
                continue
            if tgt.shared:
                self.shared[hf_key] = tgt.key
            else:
                self.sources.setdefault(tgt.key, {})[(tgt.expert, tgt.half)] = hf_key
        # the model's bytes: MTP's copies are not read
        self.total_bytes = sum(self._nbytes(k) for parts in self.sources.values() for k in parts.values())

    # ------------------------------------------------------------------ index
    def check(self, keys: list[str]) -> list[str]:
        """Raise on a folder that does not fit the model `keys`; -> the keys it lacks that may start fresh
        (MTP modules, which transformers' save_pretrained drops, and the expert bias)."""
        p = self.path
        if self.unexpected:
            raise ValueError(
                f"{p}: {len(self.unexpected)} tensors the config does not describe, e.g. {self.unexpected[0]}"
            )
        for hf_key in self.quantized:  # each in a form dstrain reads
            self._form(hf_key)
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
        """The dstrain tensor `key`, or its [start:stop) slice along `dim`, in the checkpoint's dtype (quantized
        weights, QUANTIZED, dequantized to fp32)."""
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
        return flat_range(partial(self.read, key), self.full_shape(key), start, stop, self._dtype(key))

    def others_in_files(self) -> list[tuple[str, SafetensorsFile]]:
        """The tensors outside the model (`others`), each with the file holding it: for copying as they are."""
        return [(k, self._handle(k)) for k in self.others]

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
        packed = self.quantized.get(hf_key, {}).get("weight_packed")
        if packed is not None:  # from the headers: the words holding each row's integers
            rows, words = self._stored_shape(packed)
            try:
                return (rows, words * 32 // packed_bits(self.cfg))
            except ValueError as exc:
                raise ValueError(f"{self.path}: {exc}") from None
        shape = self._stored_shape(hf_key)
        if "scale" in self.quantized.get(hf_key, {}) and self._raw_dtype(hf_key) == torch.int8:
            return (shape[0], 2 * shape[1])  # packed FP4: two values per byte
        return shape

    def _stored_shape(self, hf_key: str) -> tuple[int, ...]:
        if hf_key in self._pickled:
            return tuple(self._pickled[hf_key].shape)
        return tuple(self._entry(hf_key)["shape"])

    def _dtype(self, key: str) -> torch.dtype:
        hf_key = next(iter(self.sources[key].values()))
        return torch.float32 if hf_key in self.quantized else self._raw_dtype(hf_key)

    def _nbytes(self, hf_key: str) -> int:
        """Bytes of the tensors holding HF weight `hf_key` (its quantized form's parts too)."""
        keys = [*([hf_key] if hf_key in self.files else []), *self.quantized.get(hf_key, {}).values()]
        return sum(math.prod(self._stored_shape(k)) * self._raw_dtype(k).itemsize for k in keys)

    def _read_one(
        self, hf_key: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        parts = self.quantized.get(hf_key)
        if parts is None:
            if _FP8 is not None and self._raw_dtype(hf_key) == _FP8:
                raise ValueError(f"{self.path}: FP8 tensor {hf_key} has no weight_scale_inv or scale")
            return self._raw(hf_key, dim, start, stop)
        form = self._form(hf_key)
        keys = {**parts, "weight": hf_key}
        t = form.dequantize(*(self._raw(keys[p]) for p in (*form.parts, *form.optional) if p in keys))
        if tuple(t.shape) != self._shape(hf_key):
            raise ValueError(
                f"{self.path}: {hf_key} dequantizes to {tuple(t.shape)}, not {self._shape(hf_key)}"
            )
        if dim is not None:  # dequantized whole, then sliced
            t = t.narrow(dim, start, (t.shape[dim] if stop is None else stop) - start).contiguous()
        return t

    def _form(self, hf_key: str) -> Form:
        form = form_of(self.quantized[hf_key])
        if form is None:
            parts = ", ".join(sorted(self.quantized[hf_key]))
            raise ValueError(
                f"{self.path}: {hf_key} is stored as {parts}, a quantized form dstrain does not read"
            )
        return form

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
    **({"F8_E8M0": _E8M0} if _E8M0 is not None else {}),
}
