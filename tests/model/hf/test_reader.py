"""HFReader: every slice a parallel layout asks for equals the same slice of the fully loaded tensor, read
without touching the rest; and the meta-device build -> materialize -> fill path equals `from_pretrained`."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from dstrain.model import from_pretrained, get_config
from dstrain.model.build import materialize
from dstrain.model.deepseek_v3.model import DeepSeekLM
from dstrain.model.hf.files import SAFE_INDEX
from dstrain.model.sources import Weights, fill, local_tensors, open_folder
from tests.helpers.hf import official_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("official") / "v3"
    official_folder(path, dtype=torch.float32, shards=3)
    return path


@pytest.fixture(scope="module")
def full(folder):
    return from_pretrained(folder).state_dict()


def test_slices_and_flat_ranges_equal_the_full_tensor(folder, full):
    with open_folder(folder, get_config(folder)) as reader:
        for key in reader.sources:
            want = full[key]
            assert reader.full_shape(key) == tuple(want.shape), key
            for dim in range(want.ndim):
                n = want.shape[dim]
                for start, stop in ((0, n // 2), (n // 2, n), (1, max(2, n - 1))):
                    got = reader.read(key, dim, start, stop)
                    assert torch.equal(got, want.narrow(dim, start, stop - start)), (key, dim, start)
            flat, numel = want.reshape(-1), want.numel()
            part = math.ceil(numel / 3)
            for r in range(3):  # ZeRO-3 partitions of 3 ranks, the last zero-padded
                got = reader.read_flat(key, r * part, (r + 1) * part)
                tail = flat[r * part : (r + 1) * part]
                assert got.numel() == part and torch.equal(got[: tail.numel()], tail), key
                assert not got[tail.numel() :].any()


def test_reads_only_the_bytes_asked_for(folder):
    with open_folder(folder, get_config(folder)) as reader:
        key = "layers.1.mlp.experts.gate_up_proj"
        e, rows, cols = reader.full_shape(key)
        reader.read(key, 0, 0, 2)  # two experts of the fused tensor
        assert reader.bytes_read == 2 * rows * cols * 4
        before = reader.bytes_read
        reader.read("embed_tokens.weight", 1, 0, 8)  # eight columns
        assert reader.bytes_read - before == reader.full_shape("embed_tokens.weight")[0] * 8 * 4
        assert reader.bytes_read < reader.total_bytes


def test_meta_build_then_fill_equals_from_pretrained(folder, full):
    cfg = get_config(folder)
    with torch.device("meta"):
        model = DeepSeekLM(cfg)
    materialize(model, "cpu")
    assert not any(t.is_meta for _, t in local_tensors(model))
    with Weights(cfg, 0, folder=folder) as weights:
        fill(model, weights)
    assert (
        weights.stats["bytes_drawn"] == 0 and weights.stats["bytes_read"] == weights.stats["checkpoint_bytes"]
    )
    got = model.state_dict()
    assert got.keys() == full.keys() and all(torch.equal(got[k], full[k]) for k in full)
    assert all(r.e_score_correction_bias.dtype == torch.float32 for r in model.routers())


def test_materialize_keeps_parameter_attributes_and_ties():
    lin = torch.nn.Linear(4, 4, device="meta")
    lin.weight.tp_shard = (0, 1, 2)
    outer = torch.nn.ModuleList([lin, torch.nn.Linear(4, 4, device="meta")])
    outer[1].weight = lin.weight
    materialize(outer, "cpu")
    assert not lin.weight.is_meta and lin.weight.tp_shard == (0, 1, 2)
    assert outer[1].weight is lin.weight


def test_fp8_slices_dequantize_blockwise(tmp_path, folder):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    import shutil

    shutil.copytree(folder, tmp_path / "fp8")
    files = sorted((tmp_path / "fp8").glob("*.safetensors"))
    key = "model.layers.0.mlp.gate_proj.weight"
    for f in files:
        sd = load_file(f)
        if key in sd:
            q = (sd[key] * 100).to(torch.float8_e4m3fn)
            sd[key], sd[key + "_scale_inv"] = q, torch.full((1, 1), 0.01)
            save_file(sd, f, metadata={"format": "pt"})
            index = tmp_path / "fp8" / SAFE_INDEX
            meta = json.loads(index.read_text())
            meta["weight_map"][key + "_scale_inv"] = f.name
            index.write_text(json.dumps(meta))
    with open_folder(tmp_path / "fp8", get_config(folder)) as reader:
        want = q.float() * 0.01
        assert torch.equal(reader.read("layers.0.mlp.gate_proj.weight", 0, 3, 9), want[3:9])
