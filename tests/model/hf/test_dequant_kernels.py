"""The stored base's dequantization kernels (dequant_kernels.py) under Triton's CPU interpreter, against the torch
path they replace (hf/quant.py's, then the cast to the layer's dtype): bit for bit (torch.equal) in fp32 and bf16,
for DeepSeek's FP8 blocks with V3's fp32 and V4's e8m0 scales, V4's packed FP4 and compressed-tensors' packed
1/2/4/8-bit integers (with and without zero points); shapes with cut-short edge blocks, tiles and groups, and a
leading expert dim; bf16's rounding ties. Then LoRA on a stored base with the kernels selected
(DSTRAIN_KERNEL_POLICY=cuda: stored.StoredWeight.dequantize_parts takes them) computes the dense base's bits, as the
torch path does (test_stored.py), for each stored form.
Triton's interpreter is chosen when Triton is imported (TRITON_INTERPRET=1), which the test session has done long
before: the kernels' tests run in one child pytest of this file with the variable set
(`test_the_kernels_in_triton_s_interpreter`), and are skipped in the parent (as test_dsa_kernels.py's)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

import dstrain.model.common.kernels as kernels  # noqa: E402
from dstrain.model.hf import quant  # noqa: E402
from tests.helpers.tiny import ROOT  # noqa: E402

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
LEAD = pytest.mark.parametrize("lead", [(), (3,)], ids=["matrix", "experts"])


@pytest.mark.skipif(INTERPRETER, reason="this is the interpreter's process")
def test_the_kernels_in_triton_s_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed, 1 skipped" in run.stdout, run.stdout[-2000:]  # skipped there: this test


@pytest.fixture
def dk(monkeypatch):
    """dequant_kernels, the CUDA branch of every kernel choice taken (the kernels run by the interpreter)."""
    if not INTERPRETER:
        pytest.skip("runs in test_the_kernels_in_triton_s_interpreter's child process")
    monkeypatch.setattr(kernels, "KERNEL_POLICY", "cuda")
    from dstrain.model.hf import dequant_kernels

    return dequant_kernels


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bytes(shape: tuple[int, ...], g: torch.Generator, lo: int = 0, hi: int = 256) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int32).to(torch.uint8)


def _e4m3(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Every e4m3 code but NaN's (0x7F, 0xFF): both signs, zeros and subnormals among them."""
    b = _bytes(shape, g)
    return b.masked_fill((b & 0x7F) == 0x7F, 0x7E).view(torch.float8_e4m3fn)


def _e8m0(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Powers of two 2^-27 .. 2^12 (V4's scales are small: amax / 448 or / 6, rounded up)."""
    return _bytes(shape, g, 100, 140).view(torch.float8_e8m0fnu)


@DTYPES
@LEAD
@pytest.mark.parametrize("scales", ["fp32", "e8m0"])
def test_fp8_blocks_equal_the_torch_path(dk, lead, scales, dtype):
    """200 x 300: the last block row 72 rows, the last block column 44 columns."""
    g = _gen(len(lead))
    w = _e4m3((*lead, 200, 300), g)
    s = torch.rand((*lead, 2, 3), generator=g) * 0.01 if scales == "fp32" else _e8m0((*lead, 2, 3), g)
    form = "weight_scale_inv" if scales == "fp32" else "scale"  # V4's `scale` beside an e4m3 weight: FP8
    got = dk.dequantize(form, [w, s], dtype, (200, 300))
    assert got.dtype == dtype and torch.equal(got, quant.dequantize_fp8(w, s).to(dtype))


def test_bf16_rounds_to_nearest_even_as_torch_does(dk):
    """Products halfway between two bf16 values (scale 1 + 2^-8 and 1 + 3 * 2^-8 times 1 and -1), one above and
    the largest values of e4m3 times 2^100 (near bf16's largest): torch's rounding, not the interpreter's own
    cast (which truncates)."""
    codes = torch.tensor([1.0, -1.0, 448.0, -448.0, 0.5, 0.001953125]).to(torch.float8_e4m3fn)
    w = codes[torch.arange(129) % 6, None].expand(129, 257).contiguous()  # row 0's codes 1
    s = torch.tensor([[1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20], [2.0**100, 2.0**-100, 1.0]])
    got = dk.dequantize_fp8(w, s, torch.bfloat16)
    want = quant.dequantize_fp8(w, s).to(torch.bfloat16)
    assert torch.equal(got, want)
    assert got[0, 0] == 1.0 and got[0, 128] == 1 + 2**-6 and got[0, 256] == 1 + 2**-7  # ties even, one above


@DTYPES
@LEAD
def test_fp4_equals_the_torch_path(dk, lead, dtype):
    """40 x 200: row tiles of 32 and 8, column tiles of 128 and 72, a last scale group of 8 columns."""
    g = _gen(7 + len(lead))
    packed = _bytes((*lead, 40, 100), g).view(torch.int8)  # every byte: both nibbles' 16 codes
    s = _e8m0((*lead, 40, 7), g)
    got = dk.dequantize("scale", [packed, s], dtype, (40, 200))  # V4's `scale` beside an int8 weight: FP4
    assert got.dtype == dtype and torch.equal(got, quant.dequantize_fp4(packed, s).to(dtype))


PACKED = [  # (bits, columns, groups, zero point, scale dtype)
    (4, 200, 7, False, torch.bfloat16),  # K2.5's INT4 with a cut-short last word and group (32 columns each)
    (4, 96, 3, True, torch.float32),
    (8, 75, 1, False, torch.float32),  # per channel
    (2, 48, 3, True, torch.bfloat16),
    (1, 40, 2, True, torch.float32),
]


@DTYPES
@pytest.mark.parametrize("bits, cols, groups, zero, scale_dtype", PACKED)
def test_packed_integers_equal_the_torch_path(dk, bits, cols, groups, zero, scale_dtype, dtype):
    """Random int32 words (the last word's padding too, which neither path reads), zero points packed down the
    rows (a cut-short last word of 37 rows' too), 37 rows: tiles of 32 and 5; two experts."""
    g = _gen(bits + cols)
    lead, rows = (2,), 37
    words = -(-cols * bits // 32)
    packed = _bytes((*lead, rows, 4 * words), g).view(torch.int32)
    scale = (torch.rand((*lead, rows, groups), generator=g) * 0.1).to(scale_dtype)
    zp = _bytes((*lead, -(-rows * bits // 32), 4 * groups), g).view(torch.int32) if zero else None
    shape = torch.tensor([rows, cols], dtype=torch.int32).expand(*lead, 2)
    parts = [packed, scale, shape] + ([zp] if zero else [])
    got = dk.dequantize("weight_packed", parts, dtype, (rows, cols))
    assert got.dtype == dtype and torch.equal(got, quant.dequantize_packed(*parts).to(dtype))


def test_the_torch_path_s_errors(dk):
    w = torch.zeros(200, 300, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="needs a 2x3 scale grid"):
        dk.dequantize_fp8(w, torch.ones(2, 2), torch.float32)
    with pytest.raises(ValueError, match="needs 4x1 scales"):
        dk.dequantize_fp4(torch.zeros(4, 16, dtype=torch.int8), torch.ones(4, 2), torch.float32)
    with pytest.raises(ValueError, match="dstrain reads 1, 2, 4 or 8 bits"):
        packed = torch.zeros(4, 3, dtype=torch.int32)
        dk.dequantize_packed(packed, torch.ones(4, 1), (4, 32), None, torch.float32)


# V3's FP8 projections and K2.5's packed experts (V4's FP4 experts take the packed-integer branch's route; its
# kernel is checked above, and its tiny folder costs 3-4 s of the interpreter's run to write)
@pytest.mark.parametrize("name", ["fp8_v3", "int4_k25"])
def test_lora_on_the_stored_base_with_the_kernels_computes_the_dense_base_s_bits(
    dk, monkeypatch, tmp_path, name
):
    """test_stored.py's check with the kernels selected (fp32; bf16's rounding is the kernels' tests'): the stored
    base's layers dequantized by the kernels (each form's counted: projections and experts, forward and
    backward), the dense base's by the torch path at load; the same loss and gradients, bit for bit. V3's FP8 on
    the tiny model (16-64-row projections: every block cut short)."""
    from dstrain.model.common.stored import stored_weights
    from tests.helpers.quantized import fp8_folder
    from tests.helpers.tiny import tiny_config
    from tests.model.common.test_stored import FORMS, _models, _step

    write, targets = FORMS[name]
    if name == "fp8_v3":
        write = lambda p: fp8_folder(p, tiny_config()) and p  # noqa: E731
    dense, stored = _models(write(tmp_path / "src"), targets, torch.float32)
    calls: dict[str, int] = {}
    real = dk.dequantize
    monkeypatch.setattr(dk, "dequantize", lambda f, *a: calls.update({f: calls.get(f, 0) + 1}) or real(f, *a))
    ids = torch.randint(0, dense.config.vocab_size, (2, 24), generator=_gen(0))
    loss_d, grads_d = _step(dense, ids)
    loss_s, grads_s = _step(stored, ids)
    assert set(calls) == {w.form for _, w in stored_weights(stored)}, calls
    assert torch.equal(loss_d, loss_s), (loss_d, loss_s)
    assert grads_d.keys() == grads_s.keys() and any("lora_" in k for k in grads_s)
    for k, g in grads_d.items():
        assert torch.equal(g, grads_s[k]), k
