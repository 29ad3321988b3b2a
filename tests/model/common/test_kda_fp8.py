"""FP8 folders of the KDA hybrids (GLM-5.3-Flash ships FP8; Kimi Linear's projections quantized the same way):
every projection in DeepSeek-V3's FP8 form (e4m3, fp32 128 x 128 block scales) loads as its dequantized values.
(LoRA on GLM-5.3-Flash's FP8 base kept stored: tests/model/common/test_stored.py.)"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from dstrain.model import from_pretrained
from dstrain.model.hf import SAFE_INDEX
from dstrain.model.hf.quant import dequantize_fp8
from dstrain.model.hf.quantize import quantize_fp8
from tests.helpers.quantized import KDA_HYBRID_FP8, quantize_folder_fp8


def _dequantized(path) -> int:  # noqa: ANN001
    """The folder's projections replaced by their FP8 values (quantized, dequantized) in their own dtype."""
    dense = {}
    for f in sorted(path.glob("*.safetensors")):
        dense.update(load_file(f))
        f.unlink()
    (path / SAFE_INDEX).unlink(missing_ok=True)
    n = 0
    for k, t in dense.items():
        if KDA_HYBRID_FP8.search(k) and t.dim() == 2:
            dense[k] = dequantize_fp8(*quantize_fp8(t.float(), torch.float32)).to(t.dtype)
            n += 1
    save_file(dense, path / "model.safetensors", metadata={"format": "pt"})
    return n


@pytest.mark.parametrize("family", ["kimi_linear", "glm5_next"])
def test_fp8_folder_loads_as_its_dequantized_values(family, tmp_path):
    if family == "kimi_linear":
        from tests.model.kimi_linear.conftest import kimi_model as hf_model
    else:
        from tests.model.glm5_next.conftest import glm_model as hf_model
    model = hf_model()
    fp8, dense = tmp_path / "fp8", tmp_path / "dense"
    model.save_pretrained(fp8)
    model.save_pretrained(dense)
    assert len(quantize_folder_fp8(fp8, KDA_HYBRID_FP8)) == _dequantized(dense) > 8
    a, b = from_pretrained(fp8, dtype=torch.float32), from_pretrained(dense, dtype=torch.float32)
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), k
