"""Hugging Face weight format: key table round trip, official-layout folder round trip, loading rules."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM

from dstrain.model import from_pretrained, get_config, save_pretrained
from dstrain.model.deepseek_v3.state_dict import from_hf, to_hf
from dstrain.model.hf.files import SAFE_INDEX
from tests.helpers.hf import make_hf_model, official_folder, read_folder, v3_config


def test_key_table_round_trip(tmp_path):
    sd = official_folder(tmp_path)
    cfg = get_config(tmp_path)
    back = dict(to_hf(from_hf(sd, cfg).items(), cfg))
    assert back.keys() == sd.keys()
    for k in sd:
        assert back[k].dtype == sd[k].dtype and torch.equal(back[k], sd[k]), k


def test_official_folder_round_trip_is_bit_identical(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    sd = official_folder(src)
    model = from_pretrained(src)  # keeps the checkpoint dtype (bf16), bias fp32
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(r.e_score_correction_bias.dtype == torch.float32 for r in model.routers())
    save_pretrained(model, dst, max_shard_bytes=64 * 1024)
    assert (dst / SAFE_INDEX).exists()
    written = read_folder(dst)
    assert written.keys() == sd.keys()
    for k in sd:
        assert written[k].dtype == sd[k].dtype and torch.equal(written[k], sd[k]), k


def test_transformers_loads_what_we_save(tmp_path):
    hf = make_hf_model(v3_config())
    hf.save_pretrained(tmp_path / "a")
    ours = from_pretrained(tmp_path / "a")
    save_pretrained(ours, tmp_path / "b")
    back = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "b").eval()
    ids = torch.randint(0, 320, (2, 20))
    with torch.no_grad():
        assert (back(input_ids=ids, use_cache=False).logits - ours.eval()(ids).logits).abs().max() <= 1e-5


def test_missing_mtp_initialises_fresh_with_warning(tmp_path, caplog):
    make_hf_model(v3_config()).save_pretrained(tmp_path)  # transformers drops MTP layers
    with caplog.at_level(logging.WARNING):
        model = from_pretrained(tmp_path)
    assert any("no MTP weights" in r.message for r in caplog.records)
    assert len(model.mtp) == 1
    assert model.mtp[0].eh_proj.weight.std() > 0  # initialised, not left empty
    assert torch.equal(model.mtp[0].enorm.weight, torch.ones_like(model.mtp[0].enorm.weight))


def test_refuses_pickle_without_flag(tmp_path):
    make_hf_model(v3_config()).save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle"):
        from_pretrained(tmp_path)
    assert from_pretrained(tmp_path, allow_unsafe_pickle=True) is not None


def test_missing_tensor_and_wrong_shape_are_errors(tmp_path):
    make_hf_model(v3_config()).save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd.pop("model.layers.1.mlp.experts.5.up_proj.weight")
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="experts"):
        from_pretrained(tmp_path)
    sd.pop("model.norm.weight")
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing"):
        from_pretrained(tmp_path)


def test_fp8_block_weights_are_dequantized(tmp_path):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    make_hf_model(v3_config()).save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    key = "model.layers.0.mlp.gate_proj.weight"  # (96, 64): two row blocks of 128 would be one; use scale grid 1x1
    w = sd[key]
    q = (w * 100).to(torch.float8_e4m3fn)
    sd[key] = q
    sd[key + "_scale_inv"] = torch.full((1, 1), 0.01)
    save_file(sd, tmp_path / "model.safetensors")
    model = from_pretrained(tmp_path, dtype=torch.float32)
    assert torch.equal(model.layers[0].mlp.gate_proj.weight, q.float() * 0.01)


def test_expert_bias_stays_fp32_under_bf16_cast():
    from dstrain.model import build_model

    model = build_model("tiny", dtype=torch.bfloat16)
    for r in model.routers():
        assert r.e_score_correction_bias.dtype == torch.float32
    r = model.routers()[0]
    r.e_score_correction_bias.fill_(1e-4 + 1e-7)
    model.half()
    assert r.e_score_correction_bias.dtype == torch.float32 and r.e_score_correction_bias[
        0
    ].item() == pytest.approx(1e-4 + 1e-7, rel=1e-6)


@pytest.mark.parametrize("preset", ["tiny", "small", "deepseek-v2-lite", "deepseek-v2", "deepseek-v3"])
def test_config_json_round_trip(preset):
    """config.json written by dstrain reads back to the same architecture (checkpoints rely on it)."""
    import dataclasses

    from dstrain.model import ModelConfig
    from dstrain.model.common.config import TRAINING_FIELDS

    cfg = get_config(preset)
    back = ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict())))
    for f in dataclasses.fields(cfg):
        if f.name not in ("extra", "hf_source", *TRAINING_FIELDS[1:]):
            assert getattr(back, f.name) == getattr(cfg, f.name), f.name
