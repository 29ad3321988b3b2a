"""Kimi-K2.5 as Moonshot ships it (issue 29, item 6): a vision tower and projector beside a Kimi-K2 text model
under `language_model.`, the routed experts INT4 (compressed-tensors "pack-quantized", symmetric groups of 32).
dstrain trains the text model from that folder and writes the folder back: the vision and projector tensors
byte for byte, the text weights in bf16. The INT4 weights here are packed by the compressed-tensors package and
dstrain's dequantization is checked against the package's own."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import re
import shutil

import pytest
import torch
from compressed_tensors.compressors import PackedQuantizationCompressor as Packed
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM

import dstrain.checkpoint.export as ex
from dstrain.checkpoint import store
from dstrain.cli import main as dstrain_main
from dstrain.errors import CheckpointError, ConfigError
from dstrain.model import ModelConfig, from_pretrained, save_pretrained
from dstrain.model.deepseek_v3.state_dict import to_hf
from dstrain.model.hf.files import SAFE_INDEX, SafetensorsFile
from dstrain.model.hf.quant import dequantize_packed
from dstrain.model.sources import open_folder
from tests.helpers.hf import make_hf_model, read_folder, v3_config
from tests.helpers.runs import read_weights, train
from tests.helpers.tiny import byte_tokenizer
from tests.model.deepseek_v3.test_config import KIMI_K25

PREFIX = "language_model."
EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")
QUANTIZATION = KIMI_K25["text_config"]["quantization_config"]
SCHEME = QuantizationConfig.model_validate(QUANTIZATION).config_groups["group_0"]
BF16 = torch.bfloat16
# K2.5's vision tower and projector keys (MoonViT in Moonshot's names), tiny: width 16, the text model's 64
VISION = {
    "vision_tower.patch_embed.proj.weight": ((16, 3, 2, 2), BF16),
    "vision_tower.patch_embed.pos_emb.weight": ((4, 4, 16), BF16),
    "vision_tower.encoder.blocks.0.wqkv.weight": ((48, 16), BF16),
    "vision_tower.encoder.blocks.0.wqkv.bias": ((48,), BF16),
    "vision_tower.encoder.final_layernorm.weight": ((16,), torch.float32),
    "mm_projector.pre_norm.weight": ((16,), torch.float32),
    "mm_projector.proj.0.weight": ((64, 64), torch.float32),
    "mm_projector.proj.2.weight": ((64, 64), BF16),
}
# what K2.5 ships beside its weights: its code, its processor's, a tokenizer model
SIDE_FILES = ("configuration_kimi_k25.py", "modeling_kimi_k25.py", "kimi_k25_processor.py", "media_utils.py",
              "preprocessor_config.json", "tiktoken.model")  # fmt: skip


def k2_text():  # noqa: ANN201 - a transformers DeepseekV3Config
    """Kimi-K2's architecture in small: no MTP layer; expert rows of 32, whole groups of 32 columns."""
    return v3_config(moe_intermediate_size=32, num_mtp_layers=0)


def pack(w: torch.Tensor, scheme: QuantizationScheme = SCHEME) -> dict[str, torch.Tensor]:
    """`w` quantized and packed by compressed-tensors (min-max scales, as its observer computes them)."""
    args = scheme.weights
    group = args.group_size or w.shape[-1]
    g = w.float().unflatten(-1, (-1, group))
    scale, zero_point = calculate_qparams(g.amin(-1), g.amax(-1), args)
    state = {"weight": w, "weight_scale": scale.to(w.dtype)}
    if not args.symmetric:
        state["weight_zero_point"] = zero_point
    return Packed.compress(state, scheme)


def unpack(state: dict[str, torch.Tensor], scheme: QuantizationScheme = SCHEME) -> torch.Tensor:
    """compressed-tensors' decompression, in the dtype of the scale."""
    return Packed.decompress(state, scheme)["weight"]


def k25_folder(path) -> dict[str, torch.Tensor]:
    """A folder laid out as moonshotai/Kimi-K2.5: transformers' tiny DeepSeek-V3 (bf16, no MTP) as the text
    model under `language_model.`, its routed experts INT4-packed by compressed-tensors (weight_shape int32,
    as shipped); the vision/projector tensors in bf16 and fp32; 3 shards with an index, text and vision mixed in
    one; K2.5's config.json around the text model's; code, processor and tokenizer files. -> the text model's
    weights as it runs them (experts as the package decompresses them, exactly: fp32 scales), by its own key."""
    text = make_hf_model(k2_text())
    text.save_pretrained(path)
    dense = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    files: dict[str, torch.Tensor] = {}
    for key, t in dense.items():
        t = t if key.endswith("e_score_correction_bias") else t.to(BF16)
        dense[key] = t.float()
        if EXPERT.fullmatch(key):
            state = pack(t)
            state["weight_shape"] = state["weight_shape"].to(torch.int32)
            dense[key] = unpack({**state, "weight_scale": state["weight_scale"].float()})
            files.update({f"{PREFIX}{key}{part[6:]}": v for part, v in state.items()})
        else:
            files[PREFIX + key] = t
    g = torch.Generator().manual_seed(5)
    for key, (shape, dtype) in VISION.items():
        files[key] = torch.randn(shape, generator=g).to(dtype)
    keys = sorted(files)  # language_model.* then mm_projector.*, vision_tower.*
    shards = [keys[: len(keys) // 2], keys[len(keys) // 2 : -3], keys[-3:]]
    weight_map = {}
    for i, part in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: files[k].contiguous() for k in part}, path / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (path / SAFE_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    text_config = json.loads((path / "config.json").read_text())
    text_config.update(model_type="kimi_k2", dtype="bfloat16", quantization_config=QUANTIZATION)
    outer = copy.deepcopy(KIMI_K25) | {"text_config": text_config}
    outer["vision_config"].update(
        vt_hidden_size=16, vt_num_hidden_layers=1, mm_hidden_size=16, text_hidden_size=64
    )
    (path / "config.json").write_text(json.dumps(outer, indent=2))
    byte_tokenizer().save_pretrained(path)
    for name in SIDE_FILES:
        (path / name).write_text(f"# {name} as shipped\n")
    return dense


def raw_tensors(path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor of a safetensors folder as its file holds it: (dtype name, shape, bytes)."""
    index = path / SAFE_INDEX
    names = (
        set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else {"model.safetensors"}
    )
    out = {}
    for name in names:
        f = SafetensorsFile(str(path / name))
        for key, e in f.entries.items():
            f.copy_to(key, data := io.BytesIO())
            out[key] = (e["dtype"], e["shape"], data.getvalue())
        f.close()
    return out


@pytest.fixture(scope="module")
def k25(tmp_path_factory):
    path = tmp_path_factory.mktemp("k25") / "Kimi-K2.5"
    path.mkdir()
    return path, k25_folder(path)


@pytest.mark.parametrize(
    "weights",
    [
        dict(num_bits=4, group_size=32, strategy="group", symmetric=True),  # K2.5's
        dict(num_bits=4, group_size=32, strategy="group", symmetric=False),
        dict(num_bits=8, strategy="channel", symmetric=True),
        dict(num_bits=2, group_size=16, strategy="group", symmetric=False),
    ],
)
def test_dequantization_equals_compressed_tensors(weights):
    """dstrain's fp32 weight is the package's with fp32 scales, and rounds to the package's bf16 one."""
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    w = (0.2 * torch.randn(40, 96, generator=torch.Generator().manual_seed(1))).to(BF16)
    state = pack(w, scheme)
    ours = dequantize_packed(state["weight_packed"], state["weight_scale"], state["weight_shape"],
                             state.get("weight_zero_point"))  # fmt: skip
    assert ours.dtype == torch.float32 and ours.shape == w.shape
    assert torch.equal(ours, unpack({**state, "weight_scale": state["weight_scale"].float()}, scheme))
    assert torch.equal(ours.to(BF16), unpack(state, scheme))
    # it is the weight: within half a step, or one where a bf16 scale rounded down clipped the largest
    assert (ours - w.float()).abs().max() <= 1.5 * state["weight_scale"].float().max()


def test_the_text_model_loads_from_the_folder_as_shipped(k25):
    """The config is the text model's (DeepSeek-V3 architecture) remembering K2.5's around it; the vision
    tensors are not the model's and no error; the logits are those of transformers' DeepSeek-V3 holding the
    weights as compressed-tensors decompresses them; every slice a layout reads equals the whole's."""
    path, dense = k25
    cfg = ModelConfig.from_folder(path)
    assert (cfg.model_type, cfg.hf_prefix, cfg.n_routed_experts) == ("deepseek_v3", PREFIX, 8)
    shipped = json.loads((path / "config.json").read_text())
    assert cfg.to_hf_dict()["vision_config"] == shipped["vision_config"]
    model = from_pretrained(path, dtype=torch.float32)
    plain = path.parent / "dequantized"  # the same text model in its own folder, the experts dequantized
    k2_text().save_pretrained(plain)
    save_file(dense, plain / "model.safetensors", metadata={"format": "pt"})
    ref = DeepseekV3ForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ref(input_ids=ids, use_cache=False).logits - model.eval()(ids).logits).abs().max()
    assert diff <= 1e-5
    with open_folder(path, cfg) as reader:
        assert sorted(reader.others) == sorted(VISION) and not reader.unexpected
        key = "layers.2.mlp.experts.gate_up_proj"
        whole = reader.read(key)
        expert = "model.layers.2.mlp.experts.{}.{}_proj.weight"
        want = torch.stack(
            [torch.cat([dense[expert.format(e, p)] for p in ("gate", "up")]) for e in range(8)]
        )
        assert whole.dtype == torch.float32 and torch.equal(whole, want)
        for dim, start, stop in ((0, 2, 5), (1, 7, 40), (2, 0, 33)):
            assert torch.equal(reader.read(key, dim, start, stop), whole.narrow(dim, start, stop - start))
        flat = reader.read_flat(key, 1000, 9000)
        assert torch.equal(flat, whole.reshape(-1)[1000:9000])


def check_export(src, out, text: dict[str, torch.Tensor], side_files: bool = True) -> None:
    """`out` is `src` with its text model's weights `text` (by key) in bf16 where `src` held them quantized:
    the vision and projector tensors byte for byte, the text model's keys as `src`'s (a packed weight's parts
    become its `weight`), K2.5's config.json around the text model's without the quantization; its side files
    (code, processor, tokenizer) where asked."""
    before, after = raw_tensors(src), raw_tensors(out)
    for key in VISION:
        assert after[key] == before[key], key
    packed = {k.removesuffix("_packed") for k in before if k.endswith(".weight_packed")}
    dense = {k for k in before if not re.search(r"\.weight_(packed|scale|shape)$", k)}
    assert packed and set(after) == dense | packed
    got = read_folder(out)
    for key, want in text.items():
        assert got[key].dtype == (torch.float32 if key.endswith("_bias") else BF16), key
        assert torch.equal(got[key], want.to(got[key].dtype)), key
    conf, shipped = (json.loads((p / "config.json").read_text()) for p in (out, src))
    assert conf["model_type"] == "kimi_k25" and conf["architectures"] == shipped["architectures"]
    assert conf["vision_config"] == shipped["vision_config"] and conf["auto_map"] == shipped["auto_map"]
    assert conf["text_config"]["model_type"] == "kimi_k2" and conf["dtype"] == "bfloat16"
    assert "quantization_config" not in conf and "quantization_config" not in conf["text_config"]
    assert all((out / name).read_bytes() == (src / name).read_bytes() for name in SIDE_FILES if side_files)


def test_save_pretrained_writes_the_folder_back(k25, tmp_path):
    """The folder the model was loaded from, the experts as compressed-tensors decompresses them in bf16
    (those of a bf16 model: the fp32 weight rounded once), every other tensor as it was."""
    path, dense = k25
    save_pretrained(from_pretrained(path), tmp_path, max_shard_bytes=64 * 1024)
    check_export(path, tmp_path, {PREFIX + k: t for k, t in dense.items()}, side_files=False)


def test_fine_tune_from_the_folder_as_shipped_and_export_it(k25, tmp_path, capsys, rank_pools):
    """`dstrain/train.py --model` the K2.5 folder, two steps; `dstrain export --dtype bfloat16 --verify`
    writes it back as shipped but for the trained text model (bf16), and transformers' DeepSeek-V3 reading the
    text model from under its prefix gives the checkpoint's logits. Without --dtype, the trained experts are
    INT4 again (the shipped tensor names and dtypes), the error quantizing introduced printed."""
    path, dense = k25
    train(rank_pools, ["--model", str(path), "--max_steps", "2", "--output_dir", str(tmp_path / "run")])
    out = tmp_path / "out"
    assert (
        dstrain_main(["export", str(tmp_path / "run"), "--out", str(out), "--dtype", "bfloat16", "--verify"])
        == 0
    )
    assert ": ok" in capsys.readouterr().out
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    cfg = ModelConfig.from_folder(path)
    trained = dict(to_hf(read_weights(ckpt), cfg))
    check_export(path, out, trained)
    assert dstrain_main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "int4"), "--verify"]) == 0
    printed = capsys.readouterr().out
    assert "48 weights quantized: relative RMS error mean" in printed and ": ok" in printed, printed
    shipped, again = raw_tensors(path), raw_tensors(tmp_path / "int4")
    assert {k: v[:2] for k, v in again.items()} == {k: v[:2] for k, v in shipped.items()}
    key = PREFIX + "model.layers.1.mlp.experts.0.up_proj.weight"
    assert not torch.equal(trained[key], dense[key.removeprefix(PREFIX)])  # it trained the INT4 experts too
    # the export copies the vision tower from the folder training started from: gone, a one-line error
    opened = store.open_checkpoint(tmp_path / "run")
    moved = dataclasses.replace(opened, source=str(tmp_path / "moved"))
    with pytest.raises(CheckpointError, match="vision tower and projector are copied from the folder"):
        ex.export(moved, tmp_path / "out2", dtype="bfloat16")
    with pytest.raises(ConfigError, match="started from a quantized folder .* that is not there"):
        ex.export(moved, tmp_path / "out3")  # its INT4 scales and form are read from it


def test_the_config_is_the_text_models_inside_k25s():
    """K2.5's config.json loads as its text model (Kimi-K2's architecture, DeepSeek-V3's) and writes back
    around it as it came; a multimodal config dstrain cannot train is a one-line error."""
    cfg = ModelConfig.from_hf_dict(KIMI_K25)
    assert cfg == ModelConfig.from_hf_dict(KIMI_K25["text_config"]) and cfg.hf_prefix == PREFIX
    assert cfg.rope_scaling["factor"] == 64.0 and cfg.aux_loss_alpha == 0.001
    out = cfg.to_hf_dict()
    assert {k: v for k, v in out.items() if k != "text_config"} == {
        k: v for k, v in KIMI_K25.items() if k != "text_config"
    }
    # the text model's fields as the file spelled them (rope_scaling with "type"), defaults added
    assert out["text_config"].items() >= KIMI_K25["text_config"].items()
    assert ModelConfig.from_hf_dict(out) == cfg and ModelConfig.from_hf_dict(out).hf_prefix == PREFIX
    qwen = dict(KIMI_K25, text_config={"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})
    for config, message in [
        (qwen, "kimi_k25 text model: config.json architectures=['Qwen3ForCausalLM']: dstrain trains"),
        ({k: v for k, v in KIMI_K25.items() if k != "text_config"}, "no text_config (its text model)"),
        (dict(KIMI_K25, model_type="qwen2_5_vl"), "model_type='qwen2_5_vl' is multimodal: dstrain trains"),
    ]:
        with pytest.raises(ValueError) as err:
            ModelConfig.from_hf_dict(config)
        assert message in str(err.value) and "\n" not in str(err.value)


def test_a_quantized_form_dstrain_does_not_read_is_an_error(k25, tmp_path):
    """compressed-tensors' activation-ordered groups (a `weight_g_idx` beside the packed weight) would
    dequantize wrong with the plain group order: refused by name before anything is read."""
    path, _ = k25
    shutil.copytree(path, tmp_path / "k25")
    extra = {f"{PREFIX}model.layers.1.mlp.experts.0.up_proj.weight_g_idx": torch.zeros(64, dtype=torch.int32)}
    save_file(extra, tmp_path / "k25" / "extra.safetensors")
    index = json.loads((tmp_path / "k25" / SAFE_INDEX).read_text())
    index["weight_map"].update(dict.fromkeys(extra, "extra.safetensors"))
    (tmp_path / "k25" / SAFE_INDEX).write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match=r"up_proj.weight is stored as weight_g_idx, weight_packed, weight_scale"
    ):
        from_pretrained(tmp_path / "k25")
