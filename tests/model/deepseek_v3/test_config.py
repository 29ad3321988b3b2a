"""config.json files as checkpoints ship them: missing fields take transformers' defaults exactly, other
model_types on a DeepSeek architecture (Kimi-K2, Moonlight) load and export under their own names, routing
fields are read and checked, the balance-loss weight in the file is what trains, the export keeps the file's
own rope fields, and the published parameter counts come out of the shapes."""

from __future__ import annotations

import pytest

from dstrain.model import ModelConfig
from dstrain.model.registry import param_counts

# The architecture fields of the published config.json files (moonshotai/Kimi-K2-Instruct,
# moonshotai/Moonlight-16B-A3B, deepseek-ai/DeepSeek-V3 / V2 / V2-Lite), as those files spell them.
KIMI_K2 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2", vocab_size=163840, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_nextn_predict_layers=0,
    num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1, n_routed_experts=384,
    routed_scaling_factor=2.827, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, topk_method="noaux_tc", n_group=1, topk_group=1, num_experts_per_tok=8,
    moe_layer_freq=1, first_k_dense_replace=1, norm_topk_prob=True, scoring_func="sigmoid",
    aux_loss_alpha=0.001, seq_aux=True, max_position_embeddings=131072, rope_theta=50000.0,
    rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096, "type": "yarn"},
    bos_token_id=163584, eos_token_id=163585,
)  # fmt: skip
# moonshotai/Kimi-K2.5: a multimodal config.json around a Kimi-K2 text model (model_type kimi_k2 in
# text_config; the architecture of K2 with 256K context: max_position_embeddings, YaRN factor 64, beta_fast 32,
# rms_norm_eps 1e-5), whose routed experts are INT4 (the text_config's quantization_config: compressed-tensors
# pack-quantized, symmetric groups of 32; attention, shared experts, the dense FFN and the head stay bf16);
# vision_config describes the MoonViT tower (27 blocks of 1152) and the projector, in Moonshot's own field
# names. As transformers 5.7 prints the hub file and vLLM's KimiK25Config reads it (which hoists
# text_config.quantization_config to the top); 1T total / 32B active per the model card.
KIMI_K25_QUANTIZATION = dict(
    config_groups={"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                   "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32,
                               "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                               "symmetric": True, "type": "int"}}},
    format="pack-quantized", kv_cache_scheme=None, quant_method="compressed-tensors",
    quantization_status="compressed",
    ignore=["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
)  # fmt: skip
KIMI_K25 = dict(
    architectures=["KimiK25ForConditionalGeneration"], model_type="kimi_k25", bos_token_id=163584,
    eos_token_id=163585, pad_token_id=163839, dtype="bfloat16", ignore_index=-100,
    media_placeholder_token_id=163605, tie_word_embeddings=False, use_unified_vision_chunk=True,
    video_placeholder="<|kimi_k25_video_placeholder|>",
    auto_map={"AutoConfig": "configuration_kimi_k25.KimiK25Config",
              "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
              "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
    text_config=KIMI_K2 | dict(
        max_position_embeddings=262144, rms_norm_eps=1e-5, pad_token_id=163839,
        rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096, "type": "yarn"},
        auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                  "AutoModel": "modeling_deepseek.DeepseekV3Model",
                  "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        quantization_config=KIMI_K25_QUANTIZATION,
    ),
    vision_config=dict(
        init_pos_emb_height=64, init_pos_emb_time=4, init_pos_emb_width=64, merge_kernel_size=[2, 2],
        merge_type="sd2_tpool", mm_hidden_size=1152, mm_projector_type="patchmerger", patch_size=14,
        pos_emb_type="divided_fixed", projector_hidden_act="gelu", projector_ln_eps=1e-05, text_hidden_size=7168,
        video_attn_type="spatial_temporal", vt_hidden_size=1152, vt_intermediate_size=4304,
        vt_num_attention_heads=16, vt_num_hidden_layers=27,
    ),
)  # fmt: skip
# deepseek-ai/DeepSeek-V3.2 (V3.2-Exp has the same architecture): DeepSeek's inference config
# (config_671B_v3.2.json) in Hugging Face names; GLM-5 (zai-org/GLM-5, all layers with their own indexer).
DEEPSEEK_V32 = dict(
    architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", vocab_size=129280, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, first_k_dense_replace=3,
    num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
    n_group=8, topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
    routed_scaling_factor=2.5, num_nextn_predict_layers=1, index_n_heads=64, index_head_dim=128, index_topk=2048,
    max_position_embeddings=163840, rope_theta=10000, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
)  # fmt: skip
GLM_5 = dict(
    architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144,
    intermediate_size=12288, moe_intermediate_size=2048, num_hidden_layers=78, first_k_dense_replace=3,
    num_attention_heads=64, num_key_value_heads=64, head_dim=64, q_lora_rank=2048, kv_lora_rank=512,
    qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, n_routed_experts=256, n_shared_experts=1,
    num_experts_per_tok=8, n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid",
    norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=1, index_n_heads=32,
    index_head_dim=128, index_topk=2048, indexer_rope_interleave=True, rope_interleave=True,
    rope_parameters={"rope_theta": 1000000, "rope_type": "default"}, max_position_embeddings=202752,
    rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=[154820, 154827, 154829], pad_token_id=154820,
)  # fmt: skip
MOONLIGHT = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=163840, hidden_size=2048,
    intermediate_size=11264, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
    n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=2.446, kv_lora_rank=512, q_lora_rank=None,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", n_group=1, topk_group=1,
    num_experts_per_tok=6, first_k_dense_replace=1, norm_topk_prob=True, scoring_func="sigmoid",
    rope_theta=50000.0, max_position_embeddings=8192, rms_norm_eps=1e-5, num_nextn_predict_layers=0,
)  # fmt: skip


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_missing_fields_take_transformers_defaults(family):
    """A config.json that leaves out the MoE fields gets what transformers' config class would run (it used
    to load silently as a dense model)."""
    from transformers import AutoConfig

    given = dict(model_type=family, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                 kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                 vocab_size=1000, num_experts_per_tok=2, n_group=1, topk_group=1)  # fmt: skip
    ours = ModelConfig.from_hf_dict(given)
    theirs = AutoConfig.for_model(**given)
    for name in ("n_routed_experts", "n_shared_experts", "moe_intermediate_size", "intermediate_size",
                 "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob", "rms_norm_eps",
                 "max_position_embeddings", "bos_token_id", "eos_token_id", "tie_word_embeddings"):  # fmt: skip
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.n_routed_experts == (256 if family == "deepseek_v3" else 64)


def test_kimi_k2_loads_as_its_architecture_and_exports_under_its_own_name():
    cfg = ModelConfig.from_hf_dict(KIMI_K2)
    assert (cfg.model_type, cfg.n_routed_experts, cfg.num_experts_per_tok) == ("deepseek_v3", 384, 8)
    assert cfg.rope_scaling == {
        "rope_type": "yarn", "beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
    }  # fmt: skip
    assert cfg.rope_theta == 50000.0 and cfg.aux_loss_alpha == 0.001  # the file's balance weight trains
    out = cfg.to_hf_dict()
    assert out["model_type"] == "kimi_k2" and out["architectures"] == ["DeepseekV3ForCausalLM"]
    # the file's own rope fields, spelled as it spelled them; no transformers-5-only form
    assert out["rope_scaling"] == KIMI_K2["rope_scaling"] and out["rope_theta"] == 50000.0
    assert "rope_parameters" not in out and out["aux_loss_alpha"] == 0.001 and out["seq_aux"] is True
    assert ModelConfig.from_hf_dict(out) == cfg


def test_the_trained_balance_weight_is_what_the_export_states():
    from dstrain.config.options import parse_options
    from dstrain.config.plan import model_config

    base = ModelConfig.from_hf_dict(MOONLIGHT | {"aux_loss_alpha": 0.003})
    assert model_config(parse_options([]), base).to_hf_dict()["aux_loss_alpha"] == 0.003
    flagged = model_config(parse_options(["--moe_aux_loss_alpha", "0.01"]), base)
    assert flagged.aux_loss_alpha == 0.01 and flagged.to_hf_dict()["aux_loss_alpha"] == 0.01


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["Qwen2MoeForCausalLM"]}, "architectures=['Qwen2MoeForCausalLM']: dstrain trains"),
        ({"model_type": "deepseek_v2"}, "model_type='deepseek_v2' contradicts architectures"),
        ({"model_type": "mixtral", "architectures": []}, "model_type='mixtral': dstrain loads"),
        (
            {"topk_method": "greedy"},
            "topk_method='greedy' scoring_func='sigmoid': the DeepseekV3 architecture",
        ),
        ({"scoring_func": "softmax"}, "scoring_func='softmax': the DeepseekV3 architecture routes"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ],
)
def test_contradictions_and_unimplemented_routing_name_the_field(change, message):
    with pytest.raises(ValueError, match=None) as err:
        ModelConfig.from_hf_dict(MOONLIGHT | change)
    assert message in str(err.value)


def test_v2_scoring_must_be_softmax():
    from dstrain.model import get_config

    d = get_config("deepseek-v2-lite").to_hf_dict() | {"scoring_func": "sigmoid"}
    with pytest.raises(ValueError, match="deepseek_v2 routes with softmax"):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize(
    ("config", "total", "active", "embedding_counted"),
    [
        ("deepseek-v3", 671e9, 37e9, False),  # V3 report: 671B total (MTP apart), 37B activated
        ("deepseek-v2", 236e9, 21e9, False),
        ("deepseek-v2-lite", 15.7e9, 2.4e9, False),
        (MOONLIGHT, 16e9, 3e9, True),  # "16B total, 3B activated": Moonshot counts the embedding
        (KIMI_K2, 1.04e12, 32e9, False),  # "1.04T total, 32B activated"
        (KIMI_K25, 1.04e12, 32e9, False),  # its text model: K2's (the 0.4B vision tower is not trained)
        (DEEPSEEK_V32, 671e9, 37e9, False),  # V3.2 = V3 + the indexers (0.85B)
        (GLM_5, 744e9, 40e9, False),  # GLM-5 README: "744B parameters (40B active)"
    ],
)
def test_parameter_counts_match_the_published_figures(config, total, active, embedding_counted):
    """Totals without MTP (V3's hub checkpoint adds its ~14B MTP module: 685B); active parameters per token
    count the head but not the embedding lookup, unless the publisher counted it."""
    cfg = ModelConfig.from_hf_dict(config) if isinstance(config, dict) else config
    counts = param_counts(cfg, include_mtp=False)
    got = counts["active"] + (counts["embedding"] if embedding_counted else 0)
    assert counts["total"] == pytest.approx(total, rel=0.02), counts
    assert got == pytest.approx(active, rel=0.04), counts
