"""A quantized folder's weights as training holds them: the frozen base in its stored form (common/stored.py,
`--base_precision stored`) and the quantizers of QAT (common/qat.py, `--qat`), built from a folder's reader
(hf/): where the checkpoint format meets the shared layers, above both."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .common.kernels import triton_kernels
from .common.layers import Experts
from .common.qat import Quantizer
from .common.stored import Source, StoredExperts, StoredWeight, stored_weights
from .hf.quant import QUANTIZED
from .hf.quantize import round_trip

# The forms hf/dequant_kernels.py dequantizes in one pass (every one of QUANTIZED's)
KERNEL_FORMS = frozenset({"weight_scale_inv", "scale", "weight_packed"})


def dequantizer(form: str) -> Callable[..., torch.Tensor]:
    """(parts, dtype, (rows, cols)) -> the dense weight in `dtype` of a stored weight of `form`: where Triton's
    kernels run (kernels.triton_kernels: a GPU, or the interpreter under the CUDA policy) in one pass, else
    quant.py's torch path (fp32 temporaries, then `dtype`): the same bits."""
    record = QUANTIZED[form]

    def run(parts: dict[str, torch.Tensor], dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        args = [parts[p] for p in (*record.parts, *record.optional) if p in parts]
        if form in KERNEL_FORMS and triton_kernels(args[0].device, dtype):
            from .hf.dequant_kernels import dequantize

            return dequantize(form, args, dtype, shape)
        return record.dequantize(*args).to(dtype)

    return run


def _stored(
    reader: Any, key: str, shape: tuple[int, ...], source: Source, half: int | None = None
) -> StoredWeight:
    """A StoredWeight of `key` on meta: the parts' dtypes and shapes from the files' headers, nothing read."""
    form = reader.stored_form(key)
    layout = reader.stored_layout(key, half)
    parts = {p: torch.empty(s, dtype=dt, device="meta") for p, (dt, s) in layout.items()}
    return StoredWeight(form, dequantizer(form), parts, shape, source)


def store_base(model: nn.Module, reader: Any) -> int:
    """On a model on meta, after the fine-tune options froze what does not train: every frozen weight the
    folder stores quantized becomes its stored form (StoredWeight in a Linear's `weight`; StoredExperts in place
    of the routed experts' fused parameters); what trains stays a parameter, dequantized as it is read.
    -> how many tensors were stored."""
    count = 0
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Linear):
            key = f"{name}.weight"
            if (
                not reader.stored_form(key)
                or not isinstance(m.weight, nn.Parameter)
                or m.weight.requires_grad
            ):
                continue
            shape = tuple(getattr(m.weight, "ds_shape", None) or m.weight.shape)
            del m.weight
            m.weight = _stored(reader, key, shape, Source(key))
            count += 1
        elif isinstance(m, Experts) and not isinstance(m.gate_up_proj, StoredExperts):
            key, down = f"{name}.gate_up_proj", f"{name}.down_proj"
            if not reader.stored_form(key) or m.gate_up_proj.requires_grad or m.down_proj.requires_grad:
                continue
            e, two_i, d = getattr(m.gate_up_proj, "ds_shape", None) or m.gate_up_proj.shape
            gate, up = (_stored(reader, key, (e, two_i // 2, d), Source(key, h, (0, e)), h) for h in (0, 1))
            shape = tuple(getattr(m.down_proj, "ds_shape", None) or m.down_proj.shape)
            stack = StoredExperts(gate, up, _stored(reader, down, shape, Source(down, None, (0, e))))
            del m.gate_up_proj, m.down_proj
            m.gate_up_proj, m.down_proj = stack, None
            count += 3
    return count


@torch.no_grad()
def fill_stored(model: nn.Module, reader: Any) -> None:
    """Every stored weight this rank holds (not on meta) read from the folder as the files hold it."""
    for _, w in stored_weights(model):
        if not w.is_meta:
            src = w.source
            w.load(reader.read_stored(src.key, src.half, *(src.experts or ())))


def quantizer_for(reader: Any, key: str, half: int | None = None) -> Quantizer:
    """The QAT quantizer of dstrain weight `key` (of fused experts: one `half`, all experts stacked): the
    folder's scales, read; its codes' dtype and width, from the headers."""
    form = reader.stored_form(key)
    layout = reader.stored_layout(key, half)  # dtypes and shapes: the scales alone are read
    if form == "weight_packed":
        if "weight_zero_point" in layout:
            raise ValueError(
                f"{key}: QAT of asymmetric packed integers (a zero point) is not built; --qat off"
            )
        parts = reader.read_stored(key, half, only=("weight_scale", "weight_shape"))
        words, cols = layout["weight_packed"][1][-1], int(parts["weight_shape"].reshape(-1, 2)[0, 1])
        scale = parts["weight_scale"]
        return Quantizer(round_trip(form, scale.dtype, bits=32 * words // cols), scale)
    marker = "weight_scale_inv" if form == "weight_scale_inv" else "scale"
    keep = reader.read_stored(key, half, only=(marker,))[marker]
    return Quantizer(round_trip(form, keep.dtype, fp4=layout["weight"][0] == torch.int8), keep)


def apply_qat(model: nn.Module, reader: Any) -> int:
    """Give every Linear and routed experts that trains (its weights, or LoRA adapters on them) and whose weight
    the folder stores quantized its quantizer(s) (`qat`, read in their forward); a frozen weight is exported as
    loaded, so it computes as it is. -> how many weights will train fake-quantized."""

    def trains(m: nn.Module) -> bool:
        return any(p.requires_grad for p in m.parameters(recurse=False))

    count = 0
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and trains(m) and reader.stored_form(f"{name}.weight"):
            m.qat = quantizer_for(reader, f"{name}.weight")
            count += 1
        elif isinstance(m, Experts) and trains(m) and reader.stored_form(f"{name}.gate_up_proj"):
            key = f"{name}.gate_up_proj"
            m.qat = nn.ModuleDict(
                {"gate": quantizer_for(reader, key, 0), "up": quantizer_for(reader, key, 1),
                 "down": quantizer_for(reader, f"{name}.down_proj")}
            )  # fmt: skip
            count += 3
    return count
