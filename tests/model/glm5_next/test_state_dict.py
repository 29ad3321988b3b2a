"""GLM-5.3-Flash folders and config.json: the round trip of a transformers-written multimodal folder (bit for
bit, same keys, the vision tower copied), dstrain -> HF keys -> dstrain bit for bit (MTP included), the key
table both ways, config.json's forms (nested, flat, the derived schedules) and validation, parameter counts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dstrain.model import build_model, from_pretrained, get_config, param_counts, save_pretrained
from dstrain.model.glm5_next import FAMILY
from dstrain.model.glm5_next.config import DSA, KDA, Glm5NextConfig
from dstrain.model.glm5_next.state_dict import dstrain_to_hf, hf_to_dstrain
from tests.helpers.hf import read_folder


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for k, t in a.items():
        assert t.dtype == b[k].dtype and t.shape == b[k].shape and torch.equal(t, b[k]), k


def test_transformers_folder_round_trips_bit_for_bit(glm_folder, tmp_path) -> None:  # noqa: ANN001
    """Loaded in its own dtype and saved, the folder's tensors come back identical under the same names, the
    vision tower (never loaded) copied from the source folder; config.json with the same keys and values."""
    model = from_pretrained(glm_folder, dtype=None)
    save_pretrained(model, tmp_path / "out")
    source = read_folder(glm_folder)
    assert any(k.startswith("model.visual.") for k in source)
    _same_tensors(source, read_folder(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads(
        (glm_folder / "config.json").read_text()
    )


def test_export_round_trip_with_mtp_is_bit_exact(tmp_path) -> None:  # noqa: ANN001
    """A fresh tiny model (MTP layer included) exported in bf16 as a flat folder and read back: every tensor is
    the model's rounded to bf16, the `keeps_fp32` ones (expert bias, KDA's decay and convolutions, mHC biases
    and scales) exactly the model's fp32 values; exported again, the folder is identical."""
    cfg = get_config("tiny-glm5-next").replace(vocab_size=96)
    model = build_model(cfg, seed=4)
    save_pretrained(model, tmp_path / "a", dtype=torch.bfloat16)
    first = read_folder(tmp_path / "a")
    at = "model.language_model.layers."  # transformers' layout
    assert f"{at}4.eh_proj.weight" in first and f"{at}1.hc_attn_fn" in first
    assert first[f"{at}0.self_attn.A_log"].dtype == torch.float32
    back = from_pretrained(tmp_path / "a", dtype=None)
    want, got = model.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    for k, t in want.items():
        expected = t if FAMILY.keeps_fp32(k) else t.to(torch.bfloat16)
        assert got[k].dtype == expected.dtype and torch.equal(got[k], expected), k
    save_pretrained(back, tmp_path / "b")
    _same_tensors(first, read_folder(tmp_path / "b"))


def test_key_table_both_ways() -> None:
    """Every dstrain tensor of the tiny preset maps to folder keys that map back to it (experts: one key per
    expert and projection)."""
    cfg = get_config("tiny-glm5-next")
    model = build_model(cfg.replace(vocab_size=96), seed=0)
    for key in model.state_dict():
        names = dstrain_to_hf(key, cfg)
        assert names, key
        for name in names:
            assert hf_to_dstrain(name, cfg).key == key, (key, name)
    at = "model.language_model.layers."
    assert hf_to_dstrain(f"{at}4.shared_head.head.weight", cfg).shared  # MTP's copy of the head: not read
    with pytest.raises(KeyError):
        hf_to_dstrain(f"{at}9.mlp.gate.weight", cfg)
    with pytest.raises(KeyError):
        hf_to_dstrain(f"{at}0.mlp.experts.0.up_proj.weight", cfg)  # a dense layer


def test_flat_text_only_folder_round_trips(glm_folder, tmp_path) -> None:  # noqa: ANN001
    """A flat text-only folder (config.json's text fields at the top, the text model under `model.`, no vision
    tower) loads as the same model and is written back as it came."""
    src = tmp_path / "flat"
    src.mkdir()
    tensors = {k.replace("model.language_model.", "model."): v for k, v in read_folder(glm_folder).items()
               if not k.startswith("model.visual.")}  # fmt: skip
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    nested = json.loads((glm_folder / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**nested["text_config"], "model_type": "glm5_next"}))
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(0))
    flat = from_pretrained(src, dtype=None)
    with torch.no_grad():
        assert torch.equal(flat(ids).logits, from_pretrained(glm_folder, dtype=None)(ids).logits)
    save_pretrained(flat, tmp_path / "out")
    _same_tensors(tensors, read_folder(tmp_path / "out"))


def test_transformers_reads_a_made_in_code_export(tmp_path) -> None:  # noqa: ANN001
    """A preset's export (flat config.json, transformers' key layout) loads in transformers' model as the same
    text model (its vision tower, which the folder lacks, given a tiny config and left fresh)."""
    from transformers import Glm5NextForConditionalGeneration

    from .conftest import VISION

    model = build_model(
        get_config("tiny-glm5-next").replace(vocab_size=96, num_nextn_predict_layers=0), seed=2
    )
    save_pretrained(model, tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**conf, "vision_config": VISION}))
    ref, info = Glm5NextForConditionalGeneration.from_pretrained(
        tmp_path, experts_implementation="eager", output_loading_info=True
    )
    assert not info["unexpected_keys"] and all(".visual." in k for k in info["missing_keys"])
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = ref.eval()(ids).logits, model.eval()(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_config_forms(glm_folder) -> None:  # noqa: ANN001
    """The nested form (transformers'), the flat one with `linear_attn_config` and `index_topk_pattern`,
    transformers' derived schedules, and what is refused."""
    nested = json.loads((glm_folder / "config.json").read_text())
    cfg = Glm5NextConfig.from_hf_dict(nested)
    assert cfg.layer_types == [KDA, DSA, DSA, KDA] and cfg.indexer_types[2] == "shared"
    assert cfg.indexer_source(2) == 1 and cfg.num_nextn_predict_layers == 0 and cfg.hidden_size == 48
    flat = {k: v for k, v in nested["text_config"].items() if k not in ("indexer_types", "linear_num_heads")}
    flat.update(model_type="glm5_next", index_topk_pattern="FFSF", num_nextn_predict_layers=1,
                linear_attn_config={"num_heads": 4, "gate_lower_bound": None})  # fmt: skip
    cfg = Glm5NextConfig.from_hf_dict(flat)
    assert cfg.indexer_types == ["full", "full", "shared", "full"] and cfg.linear_num_heads == 4
    assert cfg.linear_lower_bound == -5.0  # transformers: a safe gate without a bound takes -5
    assert cfg.to_hf_dict() == flat
    changed = cfg.replace(linear_num_heads=2).to_hf_dict()
    assert changed["linear_attn_config"]["num_heads"] == 2
    published = Glm5NextConfig.from_hf_dict({"model_type": "glm5_next", "index_topk_freq": 2})
    assert published.layer_types[:4] == [KDA, KDA, KDA, DSA] and published.mlp_layer_types[:4] == [
        "dense"
    ] * 3 + ["sparse"]
    assert published.indexer_types[:7] == ["full", "full", "shared", "full", "shared", "full", "shared"]
    for bad in ({"qk_rope_head_dim": 64}, {"index_topk": 10}, {"index_kpool_always_select_tail": False},
                {"num_key_value_heads": 2}, {"layer_types": [DSA] * 3}):  # fmt: skip
        with pytest.raises(ValueError):
            Glm5NextConfig.from_hf_dict({**flat, **bad})
    with pytest.raises(ValueError, match="first DSA layer"):
        Glm5NextConfig.from_hf_dict({**flat, "index_topk_pattern": "FSSF"})


def test_param_counts(glm_folder) -> None:  # noqa: ANN001
    """The tiny folder's count is transformers' text model's parameter for parameter; the published shape is
    GLM-5.3-Flash's 321B total, ~18B active (within 2%)."""
    from transformers import Glm5NextForConditionalGeneration

    ref = Glm5NextForConditionalGeneration.from_pretrained(glm_folder)
    text = sum(p.numel() for n, p in ref.named_parameters() if ".visual." not in n)
    counts = param_counts(str(glm_folder), include_mtp=False)
    assert counts["total"] == text
    published = param_counts("glm-5.3-flash")
    assert abs(published["total"] / 321e9 - 1) < 0.02 and abs(published["active"] / 18e9 - 1) < 0.02
