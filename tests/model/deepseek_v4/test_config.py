"""DeepSeek-V4's config: both config.json forms read as transformers reads them and written back unchanged,
the layer schedules, the checks, and parameter counts equal to transformers' model and the published
figures."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from dstrain.model import ModelConfig, V4Config, flops_per_token, get_config, param_counts
from dstrain.model.deepseek_v4.config import CSA, HCA, SLIDING
from tests.helpers.v4 import V4_SHAPE

# deepseek-ai/DeepSeek-V4-Flash and -Pro config.json as published (DeepSeek's own form), from third-party
# transcriptions of the hub files: Pro verbatim from a dump of the file; Flash's keys and values as a reviewed
# copy of DeepSeek-V4-Flash-0731's file checks them, with the base model's compress_ratios (44 entries: 43
# main layers and the MTP layer).
_V4_COMMON = dict(
    architectures=["DeepseekV4ForCausalLM"], attention_bias=False, attention_dropout=0.0, bos_token_id=0,
    eos_token_id=1, hc_eps=1e-06, hc_mult=4, hc_sinkhorn_iters=20, head_dim=512, hidden_act="silu",
    index_head_dim=128, index_n_heads=64, initializer_range=0.02, max_position_embeddings=1048576,
    model_type="deepseek_v4", n_shared_experts=1, norm_topk_prob=True, num_experts_per_tok=6,
    num_hash_layers=3, num_key_value_heads=1, num_nextn_predict_layers=1, o_lora_rank=1024, qk_rope_head_dim=64,
    quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                         "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    rms_norm_eps=1e-06,
    rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                  "type": "yarn"},
    rope_theta=10000, scoring_func="sqrtsoftplus", sliding_window=128, swiglu_limit=10.0,
    tie_word_embeddings=False, topk_method="noaux_tc", torch_dtype="bfloat16", transformers_version="4.57.1",
    use_cache=True, vocab_size=129280, compress_rope_theta=160000,
)  # fmt: skip
FLASH = _V4_COMMON | dict(
    expert_dtype="fp4", hidden_size=4096, index_topk=512, moe_intermediate_size=2048, n_routed_experts=256,
    num_attention_heads=64, num_hidden_layers=43, o_groups=8, q_lora_rank=1024, routed_scaling_factor=1.5,
    compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0],
)  # fmt: skip
PRO = _V4_COMMON | dict(
    hidden_size=7168, index_topk=1024, moe_intermediate_size=3072, n_routed_experts=384,
    num_attention_heads=128, num_hidden_layers=61, o_groups=16, q_lora_rank=1536, routed_scaling_factor=2.5,
    compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0],
)  # fmt: skip
# DeepSeek-V4-Flash-0731: compress_ratios lists 3 entries past the main layers (its 3 DSpark stages) for 1 MTP
# layer, and DSpark keys dstrain does not interpret.
FLASH_0731 = FLASH | dict(
    compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0, 0, 0], dspark_block_size=5, dspark_noise_token_id=128799,
    dspark_target_layer_ids=[40, 41, 42], dspark_markov_rank=256,
)  # fmt: skip
YARN = {
    "rope_type": "yarn",
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 16,
    "original_max_position_embeddings": 65536,
}


def transformers_saved(tmp_path, **kw) -> dict:
    """config.json as transformers' save_pretrained writes it."""
    DeepseekV4Config(**kw).save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def transformers_count(cfg: V4Config) -> int:
    """Parameters of transformers' DeepseekV4ForCausalLM of `cfg` (built on the meta device: no memory)."""
    hf = DeepseekV4Config(**cfg.to_hf_dict())
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(hf)
    return sum(p.numel() for p in model.parameters())


def assert_same_as_transformers(cfg: V4Config, hf: DeepseekV4Config) -> None:
    assert hf.layer_types == cfg.layer_types and hf.mlp_layer_types == cfg.mlp_layer_types
    assert hf.compress_rates == cfg.compress_rates and hf.qk_rope_head_dim == cfg.qk_rope_head_dim
    main, compress = hf.rope_parameters["main"], hf.rope_parameters["compress"]
    assert main["rope_theta"] == cfg.rope_theta and compress["rope_theta"] == cfg.compress_rope_theta
    yarn = {k: v for k, v in compress.items() if k not in ("rope_theta", "partial_rotary_factor", "type")}
    if cfg.rope_scaling is None:
        assert yarn == {"rope_type": "default"}
    else:
        assert yarn == {**cfg.rope_scaling, "attention_factor": 1.0}
    for name in ("vocab_size", "hidden_size", "head_dim", "q_lora_rank", "n_routed_experts", "hc_mult",
                 "sliding_window", "o_groups", "o_lora_rank", "index_topk", "num_nextn_predict_layers",
                 "routed_scaling_factor", "swiglu_limit", "max_position_embeddings"):  # fmt: skip
        assert getattr(hf, name) == getattr(cfg, name), name


# ---------------------------------------------------------------------------------------------- reading


def test_the_published_layer_schedules():
    flash, pro = V4Config.from_hf_dict(FLASH), V4Config.from_hf_dict(PRO)
    counts = {
        name: [c.layer_types.count(t) for t in (SLIDING, CSA, HCA)] for name, c in (("f", flash), ("p", pro))
    }
    assert counts == {"f": [2, 21, 20], "p": [0, 30, 31]}
    for cfg in (flash, pro):
        n = cfg.num_hidden_layers
        assert [i for i in range(n) if cfg.is_hash_layer(i)] == [0, 1, 2]
        assert cfg.mtp_layer_types == [SLIDING] and cfg.attention_type(n) == SLIDING
        assert cfg.compress_rate(n) == 0 and not cfg.is_hash_layer(n)
        assert cfg.rope_scaling == YARN and (cfg.rope_theta, cfg.compress_rope_theta) == (10000, 160000)
        with pytest.raises(IndexError):
            cfg.attention_type(n + 1)
    assert [flash.compress_rate(i) for i in range(4)] == [0, 0, 4, 128]
    assert [pro.compress_rate(i) for i in range(4)] == [128, 128, 4, 128]
    assert flash.attention_type(2) == CSA and pro.attention_type(0) == HCA
    # the presets are the published files (their quantisation and bookkeeping keys aside)
    assert get_config("deepseek-v4-flash") == flash.replace(extra={})
    assert get_config("deepseek-v4-pro") == pro.replace(extra={})
    assert sorted(flash.extra) == [
        "attention_bias", "attention_dropout", "expert_dtype", "norm_topk_prob", "quantization_config",
        "topk_method", "torch_dtype", "transformers_version", "use_cache",
    ]  # fmt: skip


@pytest.mark.parametrize("d", [FLASH, PRO, FLASH_0731], ids=["flash", "pro", "flash-0731"])
def test_deepseek_form_reads_as_transformers_reads_it(d):
    cfg = V4Config.from_hf_dict(d)
    assert cfg.hf_source["form"] == "deepseek"
    assert_same_as_transformers(cfg, DeepseekV4Config(**d))
    assert cfg.mtp_layer_types == [SLIDING] * (len(d["compress_ratios"]) - d["num_hidden_layers"])


@pytest.mark.parametrize("n", [1, 2, 5, 43])
def test_derived_layer_types_are_transformers(n):
    """A config.json with neither layer_types nor compress_ratios (nor the hash-layer count): transformers'
    defaults (HCA, HCA, HCA, CSA, HCA, ...; three hash layers), and no YaRN."""
    d = {"model_type": "deepseek_v4", "num_hidden_layers": n}
    cfg, hf = V4Config.from_hf_dict(d), DeepseekV4Config(**d)
    assert cfg.layer_types == hf.layer_types and cfg.mlp_layer_types == hf.mlp_layer_types
    assert_same_as_transformers(cfg, hf)
    assert cfg.hf_source["form"] == "transformers" and cfg.to_hf_dict() == d


def test_missing_fields_take_transformers_defaults():
    cfg, hf = V4Config.from_hf_dict({"model_type": "deepseek_v4"}), DeepseekV4Config()
    for name in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "head_dim", "q_lora_rank", "qk_rope_head_dim", "n_routed_experts", "num_experts_per_tok",
                 "routed_scaling_factor", "rope_theta", "compress_rope_theta", "hc_mult", "hc_sinkhorn_iters",
                 "hc_eps", "swiglu_limit", "sliding_window", "o_groups", "o_lora_rank", "index_n_heads",
                 "index_head_dim", "index_topk", "num_nextn_predict_layers", "rms_norm_eps", "initializer_range",
                 "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
                 "tie_word_embeddings", "layer_types", "mlp_layer_types", "compress_rates"):  # fmt: skip
        assert getattr(cfg, name) == getattr(hf, name), name
    assert cfg.aux_loss_alpha == V4Config.aux_loss_alpha  # not a transformers field: dstrain's default


def test_a_deepseek_v4_folder_gives_a_v4config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRO))
    cfg = get_config(tmp_path)
    assert isinstance(cfg, V4Config) and cfg.hf_source["folder"] == str(tmp_path)
    assert get_config(cfg) is cfg
    with pytest.raises(ValueError, match="deepseek_v4' is read by V4Config"):
        ModelConfig.from_hf_dict(PRO)
    with pytest.raises(ValueError, match="deepseek_v4' is read by V4Config"):
        ModelConfig.from_folder(tmp_path)


# ---------------------------------------------------------------------------------------------- writing


def test_transformers_saved_config_round_trips(tmp_path):
    d = transformers_saved(tmp_path, **V4_SHAPE)
    cfg = V4Config.from_folder(tmp_path)
    assert cfg.hf_source["form"] == "transformers"
    assert cfg.compress_rates == {CSA: 4, HCA: 8} and cfg.mlp_layer_types == ["hash_moe", "moe", "moe"]
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                                "beta_fast": 32, "beta_slow": 1}  # fmt: skip
    assert json.dumps(cfg.to_hf_dict()) == json.dumps(d)  # keys, values, their types and order
    assert_same_as_transformers(cfg, DeepseekV4Config(**d))
    # to_dict's form (no transformers_version): the same
    plain = DeepseekV4Config(**V4_SHAPE).to_dict()
    assert V4Config.from_hf_dict(plain).to_hf_dict() == plain


@pytest.mark.parametrize(
    "d",
    [FLASH, PRO, FLASH_0731, {"model_type": "deepseek_v4", **V4_SHAPE}],
    ids=["flash", "pro", "flash-0731", "mixed-forms"],
)
def test_official_config_round_trips(d):
    """Written back exactly as published: quantization_config and expert_dtype included (an export of
    dequantized weights drops those, and states its dtype/torch_dtype, where the weights are written). Keys of
    both forms in one file (the test helpers' transformers kwargs) come back as they were too."""
    out = V4Config.from_hf_dict(d).to_hf_dict()
    assert json.dumps(out) == json.dumps(d)


# The keys of the fields the next test changes, in either form.
REWRITTEN = (
    "hc_mult",
    "qk_rope_head_dim",
    "rope_theta",
    "layer_types",
    "mlp_layer_types",
    "num_hash_layers",
    "compress_ratios",
    "num_nextn_predict_layers",
    "rope_parameters",
    "partial_rotary_factor",
)


@pytest.mark.parametrize("d", [FLASH, "transformers"], ids=["deepseek", "transformers"])
def test_changes_rewrite_their_own_keys_in_the_files_form(d, tmp_path):
    d = transformers_saved(tmp_path, **V4_SHAPE) if d == "transformers" else d
    cfg = V4Config.from_hf_dict(d)
    n = cfg.num_hidden_layers
    changed = cfg.replace(
        hc_mult=2,
        qk_rope_head_dim=cfg.qk_rope_head_dim // 2,
        rope_theta=5000.0,
        layer_types=[SLIDING] * n,
        mlp_layer_types=["moe"] + ["hash_moe"] * (n - 1),
        num_nextn_predict_layers=2,
        aux_loss_alpha=1e-3,
    )
    out = changed.to_hf_dict()
    again = V4Config.from_hf_dict(out)
    assert again == changed
    assert_same_as_transformers(again, DeepseekV4Config(**out))
    if "compress_ratios" in d:  # DeepSeek's keys: the MTP layers' entries follow the main layers'
        assert out["compress_ratios"] == [0] * (n + 2) and "layer_types" not in out
        # hash layers that are not the first k: only an explicit list says it
        assert "num_hash_layers" not in out and out["mlp_layer_types"] == changed.mlp_layer_types
        assert out["rope_scaling"] == d["rope_scaling"] and "rope_parameters" not in out
    else:
        assert out["rope_parameters"]["main"]["rope_theta"] == 5000.0
        assert out["partial_rotary_factor"] == changed.qk_rope_head_dim / changed.head_dim
    untouched = set(d) - set(REWRITTEN)
    assert {k: out[k] for k in untouched} == {k: d[k] for k in untouched}


@pytest.mark.parametrize("preset", ["tiny-v4", "deepseek-v4-flash", "deepseek-v4-pro"])
def test_a_config_made_in_code_writes_transformers_form(preset):
    cfg = get_config(preset)
    d = cfg.to_hf_dict()
    assert {"layer_types", "mlp_layer_types", "compress_rates", "rope_parameters"} <= set(d)
    assert "compress_ratios" not in d and "rope_scaling" not in d
    assert_same_as_transformers(cfg, DeepseekV4Config(**d))
    assert V4Config.from_hf_dict(d) == cfg


def test_tiny_preset_has_every_kind_of_layer():
    cfg = get_config("tiny-v4")
    n = cfg.num_hidden_layers
    assert set(cfg.layer_types) == {SLIDING, CSA, HCA} and cfg.is_hash_layer(0)
    assert any(not cfg.is_hash_layer(i) for i in range(n)) and cfg.num_nextn_predict_layers == 1
    assert cfg.hc_mult > 1 and cfg.rope_scaling is not None
    # rows of 64 tokens: CSA keeps fewer than its entries; HCA has entries; the window is shorter
    assert cfg.index_topk < 64 // cfg.compress_rates[CSA] and 64 // cfg.compress_rates[HCA] >= 2
    assert cfg.sliding_window < 64


# ---------------------------------------------------------------------------------------------- checks


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer_types": [SLIDING]}, "layer_types: one of"),
        ({"layer_types": [SLIDING, "full_attention", HCA]}, "layer_types: one of"),
        ({"mlp_layer_types": ["moe", "moe"]}, "mlp_layer_types: one of"),
        ({"mtp_layer_types": ["dense"]}, "mtp_layer_types"),
        ({"head_dim": 31}, "head_dim=31"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim=7"),
        ({"qk_rope_head_dim": 32}, "qk_rope_head_dim=32 must be below head_dim=32"),
        ({"o_groups": 3}, "o_groups=3 must divide num_attention_heads=4"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok=0"),
        ({"hc_mult": 0}, "hc_mult=0"),
        ({"hc_sinkhorn_iters": 0}, "hc_sinkhorn_iters=0"),
        ({"compress_rates": {CSA: 4, HCA: 0}}, "compress_rates="),
        ({"compress_rates": {CSA: 4}}, "compress_rates="),
        ({"index_topk": 0}, "index_topk=0"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling type 'linear'"),
        ({"extra": {"scoring_func": "sigmoid"}}, "extra['scoring_func']"),
    ],
)
def test_invalid_configs_name_the_field(change, message):
    with pytest.raises(ValueError) as err:
        V4Config(**change)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid': DeepSeek-V4"),
        ({"num_key_value_heads": 8}, "num_key_value_heads=8"),
        ({"n_shared_experts": 2}, "n_shared_experts=2"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"compress_ratios": [0, 16] + [4, 128] * 20 + [4, 0]}, "compress_ratios: [16]"),
        ({"compress_ratios": [0, 4]}, "compress_ratios: 2 entries for num_hidden_layers=43"),
        ({"model_type": "deepseek_v3"}, "model_type='deepseek_v3': V4Config reads deepseek_v4"),
        ({"architectures": ["DeepseekV3ForCausalLM"]}, "architectures=['DeepseekV3ForCausalLM']"),
        ({"partial_rotary_factor": 0.25}, "qk_rope_head_dim=64 contradicts partial_rotary_factor=0.25"),
    ],
)
def test_config_json_that_v4_cannot_run_is_refused(change, message):
    with pytest.raises(ValueError) as err:
        V4Config.from_hf_dict(FLASH | change)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_contradicting_rope_keys_are_refused(tmp_path):
    d = transformers_saved(tmp_path, **V4_SHAPE)
    with pytest.raises(ValueError, match="rope_theta=1.0 contradicts rope_parameters.main.rope_theta"):
        V4Config.from_hf_dict(d | {"rope_theta": 1.0})


# ---------------------------------------------------------------------------------------------- counts


@pytest.mark.parametrize("config", ["tiny-v4", FLASH, PRO], ids=["tiny-v4", "flash", "pro"])
def test_parameter_counts_are_transformers_models(config):
    """Every parameter of transformers' DeepseekV4ForCausalLM (sinks, compressors, indexers, mHC, the HC
    head, norms); transformers builds no MTP layer."""
    cfg = get_config(config) if isinstance(config, str) else V4Config.from_hf_dict(config)
    assert param_counts(cfg, include_mtp=False)["total"] == transformers_count(cfg)


def test_parameter_counts_match_the_published_figures():
    """Totals without MTP (as published); active per token counts the head, not the embedding lookup (the
    convention of the V3 figures). Flash's active count is 13.27B, +2.08% from the published "13B": a
    rounding (without the head it would be 12.74B, -2.0%, and Pro's -2.2%; no convention puts both within
    2%), so it is asserted exactly."""
    flash = param_counts(V4Config.from_hf_dict(FLASH), include_mtp=False)
    pro = param_counts(V4Config.from_hf_dict(PRO), include_mtp=False)
    assert flash["total"] == pytest.approx(284e9, rel=0.02) and flash["total"] == 284_332_230_231
    assert pro["total"] == pytest.approx(1.6e12, rel=0.02) and pro["total"] == 1_572_997_179_491
    assert flash["active"] == 13_270_091_351 and flash["active"] == pytest.approx(13e9, rel=0.021)
    assert pro["active"] == pytest.approx(49e9, rel=0.02) and pro["active"] == 48_852_379_747
    assert (flash["embedding"], pro["embedding"]) == (129280 * 4096, 129280 * 7168)
    # the MTP layer (sliding attention, MoE, e_proj/h_proj, three norms, its HC head): 6.61B and 25.84B
    assert param_counts(V4Config.from_hf_dict(FLASH))["total"] - flash["total"] == 6_610_048_635
    assert param_counts(V4Config.from_hf_dict(PRO))["total"] - pro["total"] == 25_840_145_595
    assert param_counts("deepseek-v4-flash") == param_counts(V4Config.from_hf_dict(FLASH))


@pytest.mark.parametrize("seq_len", [64, 1000])
@pytest.mark.parametrize("sparse", [True, False])
def test_flops_count_each_querys_keys(seq_len, sparse):
    """6 x active parameters plus, per layer, 6 x 2 head_dim x heads for every key a query sees (its window,
    the compressed entries visible to it: all in HCA, the indexer's top-k in CSA unless the dense stage), and
    each CSA indexer's scores over every visible entry: counted here query by query."""
    cfg = get_config("tiny-v4")
    keys = index = 0.0
    for layer in range(cfg.num_hidden_layers):
        rate = cfg.compress_rate(layer)
        for t in range(seq_len):
            entries = (t + 1) / rate if rate else 0.0
            if cfg.attention_type(layer) == "compressed_sparse_attention":
                index += 6 * entries * cfg.index_n_heads * (cfg.index_head_dim + 1)
                entries = min(entries, cfg.index_topk) if sparse else entries
            keys += min(t + 1, cfg.sliding_window) + entries
    attn = 6 * keys * cfg.num_attention_heads * 2 * cfg.head_dim
    want = 6 * param_counts(cfg, include_mtp=False)["active"] + (attn + index) / seq_len
    assert flops_per_token(cfg, seq_len, sparse=sparse) == pytest.approx(want, rel=1e-9)
