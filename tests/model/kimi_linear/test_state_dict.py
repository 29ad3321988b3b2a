"""Kimi Linear folders and config.json: the round trip of a transformers-written folder and of Moonshot's layout
(bit for bit, same keys), transformers reading what dstrain writes, config.json in its published form, the
config's validation, and the parameter counts (transformers' own count; the published 48B-A3B shapes)."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import KimiLinearConfig as HFKimiLinearConfig
from transformers import KimiLinearForCausalLM

from dstrain.model import build_model, from_pretrained, get_config, param_counts, save_pretrained
from dstrain.model.kimi_linear.config import KimiLinearConfig
from dstrain.model.kimi_linear.presets import KIMI_LINEAR_48B
from tests.helpers.hf import read_folder


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for k, t in a.items():
        assert t.dtype == b[k].dtype and t.shape == b[k].shape and torch.equal(t, b[k]), k


def test_transformers_folder_round_trips_bit_for_bit(kimi_folder, tmp_path) -> None:  # noqa: ANN001
    """Loaded in its own dtype and saved, the folder's tensors come back identical under the same names (dense
    MLPs under block_sparse_moe., as transformers writes them), and config.json with the same keys."""
    model = from_pretrained(kimi_folder, dtype=None)
    save_pretrained(model, tmp_path / "out")
    _same_tensors(read_folder(kimi_folder), read_folder(tmp_path / "out"))
    source = json.loads((kimi_folder / "config.json").read_text())
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written == source


def test_moonshot_layout_round_trips_in_bf16(kimi_folder, tmp_path) -> None:  # noqa: ANN001
    """Moonshot's published layout (the dense layer's MLP under mlp., bf16 weights; the expert bias and KDA's
    A_log and dt_bias fp32, as dstrain holds them, and as GLM-5.3-Flash's published files hold them) loads and
    is written back as it came; transformers reads it as the same model. (A folder holding A_log or dt_bias in
    bf16 comes back with them in fp32, the same values.)"""
    src = tmp_path / "moonshot"
    src.mkdir()
    tensors = load_file(kimi_folder / "model.safetensors")
    tensors = {
        k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): (
            v if k.endswith(("e_score_correction_bias", "A_log", "dt_bias")) else v.to(torch.bfloat16)
        )
        for k, v in tensors.items()
    }
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((kimi_folder / "config.json").read_text())
    conf["dtype"] = "bfloat16"
    (src / "config.json").write_text(json.dumps(conf))
    model = from_pretrained(src, dtype=None)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    save_pretrained(model, tmp_path / "out")
    _same_tensors(read_folder(src), read_folder(tmp_path / "out"))
    ref = KimiLinearForCausalLM.from_pretrained(src, dtype=torch.float32)
    assert torch.equal(
        ref.model.layers[0].mlp.gate_proj.weight, tensors["model.layers.0.mlp.gate_proj.weight"].float()
    )


def test_transformers_reads_a_fresh_preset_model(tmp_path) -> None:
    """A model made from the tiny preset (a config made in code: the published config.json form) is written
    so that transformers builds the same model: the same logits."""
    cfg = get_config("tiny-kimi-linear").replace(vocab_size=256)
    model = build_model(cfg, seed=3).eval()
    save_pretrained(model, tmp_path / "out")
    ref = KimiLinearForCausalLM.from_pretrained(tmp_path / "out", experts_implementation="eager").eval()
    assert ref.config.layer_types == cfg.layer_types and ref.config.mlp_layer_types == cfg.mlp_layer_types
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids, use_cache=False).logits
        got = model(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_published_config_reads_as_transformers_reads_it() -> None:
    """Moonshot's config.json: the 1-indexed layer lists, `num_experts` and the other attribute-map names,
    `first_k_dense_replace`; read as transformers' KimiLinearConfig reads it, and written back unchanged."""
    cfg = KimiLinearConfig.from_hf_dict(copy.deepcopy(KIMI_LINEAR_48B))
    ref = HFKimiLinearConfig(
        **{k: v for k, v in copy.deepcopy(KIMI_LINEAR_48B).items() if k != "rope_scaling"}
    )
    assert cfg.layer_types == ref.layer_types and cfg.mlp_layer_types == ref.mlp_layer_types
    for name in ("num_local_experts", "num_experts_per_tok", "n_shared_experts", "n_group", "norm_topk_prob",
                 "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "max_position_embeddings"):  # fmt: skip
        assert getattr(cfg, name) == getattr(ref, name), name
    assert cfg.to_hf_dict() == KIMI_LINEAR_48B
    changed = cfg.replace(
        num_hidden_layers=4, layer_types=cfg.layer_types[:4], mlp_layer_types=cfg.mlp_layer_types[:4]
    )
    d = changed.to_hf_dict()
    lists = d["linear_attn_config"]
    assert lists["full_attn_layers"] == [4] and lists["kda_layers"] == [1, 2, 3]
    assert KimiLinearConfig.from_hf_dict(d) == changed


@pytest.mark.parametrize(
    "change, message",
    [
        ({"mla_use_nope": False}, "mla_use_nope"),
        ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
        ({"num_nextn_predict_layers": 1}, "MTP"),
        ({"num_key_value_heads": 1}, "num_key_value_heads"),
        (
            {"linear_attn_config": {**KIMI_LINEAR_48B["linear_attn_config"], "gate_lower_bound": -5.0}},
            "gate_lower_bound",
        ),
        (
            {"linear_attn_config": {**KIMI_LINEAR_48B["linear_attn_config"], "kda_layers": [1, 2]}},
            "neither list",
        ),
        ({"num_experts_per_token": 300}, "num_experts_per_tok"),
    ],
)
def test_config_mistakes_are_one_line_errors(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KimiLinearConfig.from_hf_dict({**copy.deepcopy(KIMI_LINEAR_48B), **change})


def test_parameter_counts_are_transformers(kimi_folder) -> None:  # noqa: ANN001
    """The count from the shapes is the number of parameters transformers' model holds (the expert bias, a
    buffer, is no parameter)."""
    ref = KimiLinearForCausalLM.from_pretrained(kimi_folder)
    assert param_counts(str(kimi_folder))["total"] == sum(p.numel() for p in ref.parameters())


def test_published_sizes() -> None:
    """Kimi-Linear-48B-A3B from its config.json: 49.12B parameters stored (its "48B": 48.75B without the
    embedding, 1.6% off), 3.11B active per token (the head counted, the embedding not, as DeepSeek's 37B is;
    its "3B" is that figure rounded down, 3.6% off)."""
    counts = param_counts("kimi-linear-48b-a3b")
    assert round(counts["total"] / 1e9, 2) == 49.12
    assert abs((counts["total"] - counts["embedding"]) / 48e9 - 1) < 0.02
    assert round(counts["active"] / 1e9, 2) == 3.11


def test_a_folder_of_another_model_is_refused(kimi_folder, tmp_path) -> None:  # noqa: ANN001
    shutil.copytree(kimi_folder, tmp_path / "f")
    tensors = load_file(tmp_path / "f" / "model.safetensors")
    tensors["model.layers.4.self_attn.q_proj.weight"] = torch.zeros(1)  # a fifth layer
    save_file(tensors, tmp_path / "f" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not describe"):
        from_pretrained(tmp_path / "f")
