"""DeepSeek-V4 checkpoint folders in both key styles (transformers' save_pretrained, DeepSeek's published names),
their round trips, and the published FP8/FP4 weights, against transformers as the oracle."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from dstrain.model.deepseek_v4.config import V4Config
from dstrain.model.deepseek_v4.state_dict import key_style, read_v4_folder, save_v4_folder, v4_to_dstrain
from dstrain.model.hf.quant import dequantize_fp4, dequantize_fp8
from tests.helpers.v4 import randomize_v4, tiny_v4

# The tiny model of tests/helpers/v4.py in DeepSeek's config.json form (the HCA rate 128: compress_ratios only
# names 0, 4 and 128); entry 3 of compress_ratios is the MTP layer's (sliding).
DS_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 64,
    "hidden_size": 32,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "q_lora_rank": 12,
    "qk_rope_head_dim": 8,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "o_groups": 2,
    "o_lora_rank": 8,
    "index_n_heads": 8,
    "index_head_dim": 8,
    "index_topk": 3,
    "sliding_window": 6,
    "compress_ratios": [0, 4, 128, 0],
    "compress_rope_theta": 160000.0,
    "num_hash_layers": 1,
    "hc_mult": 2,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
QUANT_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}
# DeepSeek's published dtypes: fp32 mHC, sinks, compressor position biases, router bias; int64 hash table.
_DS_FP32 = re.compile(r"hc_|attn_sink|\.ape$|gate\.bias$")
# Published FP8 (128x128 e8m0 blocks) and FP4 (routed experts, 1x32) weights, by DeepSeek name.
_DS_FP8 = re.compile(r"(^|\.)(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|shared_experts\.w[123])\.weight$")
_DS_FP8_MTP = re.compile(r"^mtp\.\d+\.(e_proj|h_proj)\.weight$")
_DS_FP4 = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
_FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# An MTP module's own tensors: dstrain name -> DeepSeek's (after `mtp.K.`).
MTP_OWN = {
    "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "norm.weight": "norm.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}


def _memory_names(model: DeepseekV4ForCausalLM) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v for k, v in model.state_dict().items()}


def _files(folder) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _assert_same_files(a, b) -> None:
    """The same tensor names, dtypes, shapes and bytes."""
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    for k, t in fa.items():
        u = fb[k]
        assert (t.dtype, t.shape) == (u.dtype, u.shape), k
        assert torch.equal(t.reshape(-1).view(torch.uint8), u.reshape(-1).view(torch.uint8)), k


def _ds_name(saved: str) -> str:
    """transformers' save_pretrained name -> DeepSeek's (research note 5.2 step 3)."""
    k = saved.removeprefix("model.")
    k = {"embed_tokens.weight": "embed.weight"}.get(k, k)
    return k.replace("hc_head.hc_", "hc_head_").replace(".attn.norm.", ".attn.kv_norm.")


def _ds_dtype(key: str, t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        return t
    return t.float() if _DS_FP32.search(key) else t.to(torch.bfloat16)


def _ds_model(seed: int = 0) -> DeepseekV4ForCausalLM:
    torch.manual_seed(seed)
    return randomize_v4(DeepseekV4ForCausalLM(DeepseekV4Config(**DS_CONFIG)), seed).eval()


def _ds_folder(path, model: DeepseekV4ForCausalLM) -> dict[str, torch.Tensor]:
    """A DeepSeek-style folder of `model` (transformers' saved keys renamed, DeepSeek's dtypes) with an MTP
    module: its block's attention, norms and mHC copied from layer 0 (sliding), its MoE from layer 2
    (a biased router), its own tensors drawn. -> the tensors written, by DeepSeek name."""
    model.save_pretrained(path / "saved")
    saved = load_file(path / "saved" / "model.safetensors")
    ds = {_ds_name(k): _ds_dtype(_ds_name(k), t) for k, t in saved.items()}
    for k in list(ds):
        if k.startswith("layers.0.") and ".ffn." not in k or k.startswith("layers.2.ffn."):
            ds["mtp.0." + k.split(".", 2)[2]] = ds[k].clone()
    g = torch.Generator().manual_seed(7)
    d, hc = DS_CONFIG["hidden_size"], DS_CONFIG["hc_mult"]
    own = {
        "e_proj.weight": (d, d),
        "h_proj.weight": (d, d),
        "enorm.weight": (d,),
        "hnorm.weight": (d,),
        "norm.weight": (d,),
        "hc_head_fn": (hc, hc * d),
        "hc_head_base": (hc,),
        "hc_head_scale": (1,),
    }
    for name, shape in own.items():
        ds[f"mtp.0.{name}"] = _ds_dtype(name, torch.randn(shape, generator=g) * 0.2)
    path.mkdir(exist_ok=True)
    save_file(ds, path / "model.safetensors", metadata={"format": "pt"})
    with open(path / "config.json", "w") as f:
        json.dump(DS_CONFIG, f, indent=2)
    return ds


def _expected_ds_state(model: DeepseekV4ForCausalLM) -> dict[str, torch.Tensor]:
    """What a DeepSeek-style folder of `model` (`_ds_folder`) reads as, built from the model's own names."""
    # DeepSeek's fp32 set, by in-memory name
    fp32 = re.compile(r"_hc\.|hc_head\.|sinks$|position_bias$|e_score_correction_bias$")
    main = {
        k: t if not t.is_floating_point() else t.float() if fp32.search(k) else t.to(torch.bfloat16)
        for k, t in _memory_names(model).items()
    }
    mtp = {
        "mtp.0.block." + k.split(".", 2)[2]: t
        for k, t in main.items()
        if k.startswith("layers.0.") and ".mlp." not in k or k.startswith("layers.2.mlp.")
    }
    return {**main, **mtp}


def _logits(model: DeepseekV4ForCausalLM) -> torch.Tensor:
    ids = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def _load_hf(path) -> DeepseekV4ForCausalLM:
    model, info = DeepseekV4ForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"]), info
    return model.eval()


# --------------------------------------------------------------------------- both styles
def test_transformers_folder_reads_and_writes_back(tmp_path):
    """save_pretrained's hybrid names read as the in-memory names; written back in that style they are the
    same files, and transformers loads them to the same logits."""
    model = tiny_v4()
    model.save_pretrained(tmp_path / "src")
    cfg = V4Config.from_folder(tmp_path / "src")
    state = read_v4_folder(tmp_path / "src", cfg)
    want = _memory_names(model)
    assert sorted(state) == sorted(want)
    for k, t in want.items():
        assert torch.equal(state[k], t), k
    assert cfg.hf_source["key_style"] == "transformers"

    save_v4_folder(state.items(), cfg, tmp_path / "out")
    _assert_same_files(tmp_path / "src", tmp_path / "out")
    with open(tmp_path / "src" / "config.json") as a, open(tmp_path / "out" / "config.json") as b:
        assert json.load(a) == json.load(b)
    back = _load_hf(tmp_path / "out")
    assert torch.equal(_logits(back), _logits(model))


def test_deepseek_folder_reads_round_trips_and_loads_in_transformers(tmp_path):
    """DeepSeek's names and dtypes, MTP included: read as the in-memory names; written back bit-identical
    (sharded too) with the same config.json; transformers maps the same folder to the same main tensors."""
    model = _ds_model()
    src = tmp_path / "src"
    ds = _ds_folder(src, model)
    cfg = V4Config.from_folder(src)
    state = read_v4_folder(src, cfg)
    want = _expected_ds_state(model)
    for ours, theirs in MTP_OWN.items():  # an MTP module's own tensors: as the file holds them
        want[f"mtp.0.{ours}"] = ds[f"mtp.0.{theirs}"]
    assert sorted(state) == sorted(want)
    for k, t in want.items():
        assert state[k].dtype == t.dtype and torch.equal(state[k], t), k
    assert cfg.hf_source["key_style"] == "deepseek"

    names = save_v4_folder(state.items(), cfg, tmp_path / "out", dtype=torch.bfloat16, max_shard_bytes=20_000)
    assert len(names) > 1 and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    _assert_same_files(src, tmp_path / "out")
    with open(src / "config.json") as a, open(tmp_path / "out" / "config.json") as b:
        assert json.load(a) == json.load(b)

    theirs = _load_hf(src)
    ours = {k: t for k, t in state.items() if not k.startswith("mtp.")}
    assert sorted(_memory_names(theirs)) == sorted(ours)
    for k, t in _memory_names(theirs).items():
        assert torch.equal(t.float(), ours[k].float()), k


def test_fp32_model_written_in_bf16_gets_deepseeks_dtypes(tmp_path):
    """The mHC weights, sinks, compressor position biases and router bias stay fp32; tid2eid int64."""
    model = _ds_model()
    _ds_folder(tmp_path / "src", model)
    cfg = V4Config.from_folder(tmp_path / "src")
    state = {
        k: t.float() if t.is_floating_point() else t for k, t in read_v4_folder(tmp_path / "src", cfg).items()
    }
    save_v4_folder(state.items(), cfg, tmp_path / "out", style="deepseek", dtype=torch.bfloat16)
    _assert_same_files(tmp_path / "src", tmp_path / "out")


def test_deepseek_folder_written_in_transformers_style(tmp_path):
    """DeepSeek names -> transformers' style: transformers loads it to the same tensors; MTP in DeepSeek's names."""
    model = _ds_model()
    _ds_folder(tmp_path / "src", model)
    cfg = V4Config.from_folder(tmp_path / "src")
    state = read_v4_folder(tmp_path / "src", cfg)
    save_v4_folder(state.items(), cfg, tmp_path / "out", style="transformers")
    written = _files(tmp_path / "out")
    assert key_style(written) == "transformers"
    assert "model.layers.1.attn.norm.weight" in written and "mtp.0.attn.kv_norm.weight" in written
    assert "mtp.0.hc_head_fn" in written and "mtp.0.ffn.experts.3.w3.weight" in written
    theirs = _load_hf(tmp_path / "out")
    for k, t in _memory_names(theirs).items():
        assert torch.equal(t.float(), state[k].float()), k
    assert read_v4_folder(tmp_path / "out", cfg).keys() == state.keys()


def test_foreign_tensors_and_folders_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not a DeepSeek-V4 checkpoint"):
        key_style(["model.layers.0.mlp.gate.weight"])
    model = _ds_model()
    ds = _ds_folder(tmp_path, model)
    ds["layers.3.attn.wkv.weight"] = ds["layers.0.attn.wkv.weight"].clone()  # a fourth layer the config lacks
    save_file(ds, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="tensors the config does not describe, e.g. layers.3.attn.wkv"):
        read_v4_folder(tmp_path, V4Config.from_folder(tmp_path))


# --------------------------------------------------------------------------- FP8 / FP4
def _e8m0(exponents: torch.Tensor) -> torch.Tensor:
    return (exponents + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _exponents(scale: torch.Tensor) -> torch.Tensor:
    return scale.view(torch.uint8).long() - 127


def _quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one power-of-two scale per 128x128 block (the last ones cut short)."""
    rows, cols = w.shape
    exps = torch.zeros(math.ceil(rows / 128), math.ceil(cols / 128), dtype=torch.long)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(exps.shape[0]):
        for j in range(exps.shape[1]):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            exps[i, j] = math.ceil(math.log2(block.abs().max().item() / 448))
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (block * 2.0 ** -exps[i, j].item()).to(
                q.dtype
            )
    return q, _e8m0(exps)


def _quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The nearest e2m1 with one power-of-two scale per 32 input columns; two per byte, the even column low."""
    rows, cols = w.shape
    exps = torch.stack(
        [
            torch.ceil(torch.log2(w[:, j : j + 32].abs().amax(1).float() / 6)).long()
            for j in range(0, cols, 32)
        ],
        1,
    )
    x = w.float() / torch.pow(2.0, exps.repeat_interleave(32, 1)[:, :cols].float())
    codes = (x.abs().unsqueeze(-1) - _FP4_MAGNITUDES).abs().argmin(-1) | ((x < 0).long() << 3)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, _e8m0(exps)


def _fp8_reference(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = q.float()
    for (i, j), e in zip(
        ((i, j) for i in range(scale.shape[0]) for j in range(scale.shape[1])), _exponents(scale).reshape(-1)
    ):
        out[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] *= 2.0 ** e.item()
    return out


def _fp4_reference(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    octets = packed.view(torch.uint8).long()
    codes = torch.empty(packed.shape[0], 2 * packed.shape[1], dtype=torch.long)
    codes[:, 0::2], codes[:, 1::2] = octets % 16, octets // 16
    values = torch.where(codes >= 8, -1.0, 1.0) * _FP4_MAGNITUDES[codes % 8]
    exps = _exponents(scale).repeat_interleave(32, 1)[:, : codes.shape[1]]
    return torch.ldexp(values, exps)


def _transformers_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return Fp8Dequantize(None)._dequantize_one(q, scale, torch.float32)


def test_fp8_blocks_of_a_shape_not_a_multiple_of_128():
    """200 x 130: a 2 x 2 grid whose last blocks are 72 rows / 2 columns (transformers derives its block from
    the grid, 100 x 65 here, so only shapes that are multiples of 128 compare with it)."""
    w = torch.randn(200, 130, generator=torch.Generator().manual_seed(0))
    w[150:, 128:] *= 1000  # each block its own scale
    q, scale = _quantize_fp8(w)
    assert scale.shape == (2, 2) and len(set(_exponents(scale).reshape(-1).tolist())) > 1
    assert torch.equal(dequantize_fp8(q, scale), _fp8_reference(q, scale))
    q, scale = _quantize_fp8(w[: 128 * 1, :128])
    assert torch.equal(dequantize_fp8(q, scale), _transformers_dequantize(q, scale))
    with pytest.raises(ValueError, match="needs a 2x2 scale grid"):
        dequantize_fp8(*_quantize_fp8(w)[:1], scale)


@pytest.mark.parametrize("cols", [96, 40])
def test_fp4_experts_dequantize_exactly(cols):
    """Every nibble value, the low one the even column, one scale per 32 columns (40: the last block 8)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(7, cols, generator=g) * torch.logspace(-3, 3, 7).unsqueeze(1)
    packed, scale = _quantize_fp4(w)
    assert (
        packed.dtype == torch.int8 and packed.shape == (7, cols // 2) and scale.shape == (7, -(-cols // 32))
    )
    codes = set((packed.view(torch.uint8) % 16).reshape(-1).tolist())
    assert len(codes) >= 12  # most of the 16 codes occur
    got = dequantize_fp4(packed, scale)
    assert torch.equal(got, _fp4_reference(packed, scale))
    if cols % 32 == 0:
        assert torch.equal(got, _transformers_dequantize(packed, scale))
    assert (got - w).abs().max() <= (w.abs().amax(1, keepdim=True) / 6).max()  # a rounding, not garbage


def _quantized_folder(path, ds: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The published form of the DeepSeek tensors `ds`: FP8 + e8m0 128x128 blocks on the projections, FP4 routed
    experts, the rest as they are; config.json with quantization_config and expert_dtype.
    -> DeepSeek name -> (the float reference, transformers' dequantization) of each quantized weight."""
    quantized, refs = {}, {}
    for k, t in ds.items():
        if _DS_FP8.search(k) or _DS_FP8_MTP.search(k):
            q, s = _quantize_fp8(t)
            refs[k] = (_fp8_reference(q, s), _transformers_dequantize(q, s))
        elif _DS_FP4.search(k):
            q, s = _quantize_fp4(t)
            refs[k] = (_fp4_reference(q, s), _transformers_dequantize(q, s))
        else:
            quantized[k] = t
            continue
        quantized[k], quantized[k.removesuffix("weight") + "scale"] = q, s
    path.mkdir()
    save_file(quantized, path / "model.safetensors")
    with open(path / "config.json", "w") as f:
        json.dump({**DS_CONFIG, "quantization_config": QUANT_CONFIG, "expert_dtype": "fp4"}, f)
    return refs


def test_quantized_deepseek_folder_dequantizes_exactly(tmp_path):
    """Each FP8/FP4 weight reads as the float reference and as transformers' dequantizer; transformers' own
    loading of the folder (dequantize=True) gives the same tensors; written back dequantized in bf16
    (losslessly: e4m3 and e2m1 times a power of two are bf16 values) with no quantization keys."""
    model = _ds_model()
    plain = _ds_folder(tmp_path / "plain", model)
    refs = _quantized_folder(tmp_path / "src", plain)
    kinds = {
        "fp4": _DS_FP4,
        "indexer": r"\.indexer\.wq_b",
        "shared": r"\.shared_experts\.",
        "mtp": r"^mtp\.0\.e_proj",
    }
    for kind, pattern in kinds.items():  # every kind of quantized weight is in the folder
        assert any(re.search(pattern, k) for k in refs), kind
    cfg = V4Config.from_folder(tmp_path / "src")
    state = read_v4_folder(tmp_path / "src", cfg)
    assert sorted(state) == sorted(read_v4_folder(tmp_path / "plain"))
    i = cfg.moe_intermediate_size
    for name, (reference, theirs) in refs.items():
        tgt = v4_to_dstrain(name, "deepseek", cfg.num_hidden_layers)
        t = state[tgt.key] if tgt.expert is None else state[tgt.key][tgt.expert]
        if tgt.half is not None:
            t = t[tgt.half * i : (tgt.half + 1) * i]
        assert t.dtype == torch.float32 and torch.equal(t, reference) and torch.equal(t, theirs), name

    quant = FineGrainedFP8Config(
        dequantize=True, weight_block_size=(128, 128), scale_fmt="ue8m0", expert_dtype="fp4"
    )
    theirs, info = DeepseekV4ForCausalLM.from_pretrained(
        tmp_path / "src", output_loading_info=True, dtype=torch.float32, quantization_config=quant
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for k, t in _memory_names(theirs).items():
        assert torch.equal(t.float(), state[k].float()), k

    save_v4_folder(state.items(), cfg, tmp_path / "out", dtype=torch.bfloat16)
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f) == DS_CONFIG  # torch_dtype bfloat16, no quantization_config or expert_dtype
    again = read_v4_folder(tmp_path / "out")
    for k, t in state.items():
        assert torch.equal(again[k].float(), t), k


# --------------------------------------------------------------------------- the model API
def test_from_pretrained_runs_both_styles_and_save_pretrained_round_trips(tmp_path):
    """dstrain.model.from_pretrained on a transformers-saved folder and on a DeepSeek-style one (MTP, bf16,
    fp32 mHC): the logits are transformers' on the same folder (1e-5); MTP loads and trains; save_pretrained
    writes the source's own files back bit for bit; transformers loads our export of its form."""
    from dstrain.model import from_pretrained, save_pretrained

    hf = tiny_v4()
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert ours.config.num_nextn_predict_layers == 1 and ours.config.hf_source["key_style"] == "transformers"
    ids = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = ours(ids).logits
    want = _logits(hf)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    save_pretrained(ours, tmp_path / "hf_out")
    main = {k: t for k, t in _files(tmp_path / "hf_out").items() if not k.startswith("mtp.")}
    assert main.keys() == _files(tmp_path / "hf").keys()
    assert all(torch.equal(t, _files(tmp_path / "hf")[k]) for k, t in main.items())
    assert torch.equal(_logits(_load_hf(tmp_path / "hf_out")), want)

    src = tmp_path / "ds"
    _ds_folder(src, _ds_model())
    model = from_pretrained(src)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.layers[0].attn_hc.fn.dtype == torch.float32  # as the file holds it
    with torch.no_grad():
        ref = _load_hf(src)
        ids = torch.randint(0, 64, (2, 300), generator=torch.Generator().manual_seed(4))
        got = from_pretrained(src, dtype=torch.float32).eval()(ids).logits
        want = ref(input_ids=ids, use_cache=False).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    save_pretrained(model, tmp_path / "ds_out")
    _assert_same_files(src, tmp_path / "ds_out")
    model = from_pretrained(src, dtype=torch.float32).train()
    out = model(ids[:, :64], labels=ids[:, :64])
    out.loss.backward()
    assert out.mtp_tokens.item() > 0 and model.mtp[0].e_proj.weight.grad.abs().sum() > 0
