"""`dstrain export`: a dstrain checkpoint back to the exact Hugging Face folder it started from, LoRA merged
or as a PEFT adapter, --verify against transformers, and the user errors."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

import dstrain.checkpoint.export as ex
from dstrain.checkpoint import store
from dstrain.checkpoint.lora import save_lora_settings
from dstrain.checkpoint.weights import save_weights
from dstrain.cli import main as dstrain_main
from dstrain.model import from_pretrained
from dstrain.model.common.lora import lora_modules, merge_lora
from dstrain.model.deepseek_v3.state_dict import to_hf
from dstrain.model.hf.files import SAFE_INDEX
from dstrain.model.hf.quantize import quantize_fp8
from dstrain.training.finetune import apply_finetune_options
from tests.helpers.hf import make_hf_model, official_folder, read_folder, v2_config, v3_config
from tests.helpers.quantized import V3_FP8, quantize_folder_fp8
from tests.helpers.runs import read_weights, train
from tests.helpers.tiny import byte_tokenizer
from tests.helpers.trainer import make_options
from tests.model.common.test_lora import expected_default, randomize_adapters
from tests.model.hf.test_kimi_k25 import raw_tensors


def test_round_trip_is_bit_identical(trained, tmp_path, capsys):
    """transformers-written folder (bf16, MTP layer, sharded) -> dstrain --max_steps 0 -> export: the same
    key set and the same bits, the config's dtype, the tokenizer alongside; small shards get an index."""
    out = tmp_path / "out"
    assert dstrain_main(["export", str(trained["full"]), "--out", str(out), "--verify"]) == 0
    assert "verify: max |logits diff|" in capsys.readouterr().out
    src, got = read_folder(trained["hf"]), read_folder(out)
    assert got.keys() == src.keys()
    for k in src:
        assert got[k].dtype == src[k].dtype and torch.equal(got[k], src[k]), k
    conf = json.loads((out / "config.json").read_text())
    assert conf["dtype"] == "bfloat16" and conf["model_type"] == "deepseek_v3"
    assert conf["num_nextn_predict_layers"] == 1
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    # the run's output dir (its `latest`), sharded small, overwritten with --force
    info = ex.export(trained["full"].parents[1], out, force=True, max_shard_bytes=64 * 1024)
    assert len(info["files"]) > 2 and (out / SAFE_INDEX).is_file()
    assert not (out / "model.safetensors").exists()  # the earlier single file did not survive
    again = read_folder(out)
    assert again.keys() == src.keys() and all(torch.equal(again[k], src[k]) for k in src)


def test_user_errors_exit_2(trained, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert dstrain_main(["export", str(trained["full"]), "--out", str(out)]) == 2
    assert "is not empty: choose another folder or pass --force" in capsys.readouterr().err
    partial = tmp_path / "step_00000000"
    shutil.copytree(trained["full"], partial)
    (partial / "COMPLETE").unlink()
    assert dstrain_main(["export", str(partial), "--out", str(tmp_path / "x")]) == 2
    assert "is incomplete (no COMPLETE marker" in capsys.readouterr().err
    assert dstrain_main(["export", str(tmp_path), "--out", str(tmp_path / "y")]) == 2
    assert "not a dstrain checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    # an adapter needs LoRA (shared-expert adapters are written in the serving layout: test_lora.py)
    assert dstrain_main(["export", str(trained["full"]), "--out", str(tmp_path / "a"), "--adapter_only"]) == 2
    assert "no LoRA adapters" in capsys.readouterr().err


def test_lora_merged_export(trained, tmp_path):
    """Adapted weights are exported as W + (alpha/r)·B·A, everything else bit for bit; transformers loads the
    folder and --verify (adapters unmerged on dstrain's side) agrees."""
    out = tmp_path / "out"
    assert (
        dstrain_main(["export", str(trained["lora3"]), "--out", str(out), "--dtype", "float32", "--verify"])
        == 0
    )
    weights = dict(read_weights(trained["lora3"]))
    got = read_folder(out)
    adapted = expected_default(3)
    cfg = store.read_model_config(trained["lora3"])
    moved = 0
    for m in adapted:
        w, a, b = weights[f"{m}.weight"], weights[f"{m}.lora_A"], weights[f"{m}.lora_B"]
        key = f"model.layers.{cfg.num_hidden_layers}.{m.removeprefix('mtp.0.block.')}"
        key = (f"model.{m}" if not m.startswith("mtp.") else key) + ".weight"
        assert torch.allclose(got[key], w + 2.0 * b @ a, atol=1e-6), key
        moved += not torch.equal(got[key], w)
    assert moved == len([m for m in adapted if not m.startswith("mtp.")])  # MTP adapters were frozen
    assert torch.equal(got["model.layers.1.mlp.gate.weight"], weights["layers.1.mlp.gate.weight"])
    assert got["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_verify_fails_on_a_corrupted_tensor(trained, tmp_path, monkeypatch, capsys):
    real = ex.hf_tensors

    def corrupting(*args, **kw):
        for key, t in real(*args, **kw):
            yield key, (t + 0.05 if key == "model.layers.1.self_attn.o_proj.weight" else t)

    monkeypatch.setattr(ex, "hf_tensors", corrupting)
    assert dstrain_main(["export", str(trained["full"]), "--out", str(tmp_path / "out"), "--verify"]) == 1
    assert "FAILED" in capsys.readouterr().out


def fake_checkpoint(path, model, source):
    """A complete checkpoint folder as export reads it, with `model`'s weights as checkpoint.save writes them."""
    path.mkdir(parents=True)
    save_weights(model, path, rank=0)
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    (path / "dstrain_state").mkdir()
    (path / "dstrain_state" / "rank_00000.json").write_text(json.dumps({"model": str(source)}))
    save_lora_settings(model, path, rank=0)
    marker = {"step": 0, "world_size": 1, "saved_at": 0.0, "files": store._files(path)}
    (path / "COMPLETE").write_text(json.dumps(marker))
    return path


def test_adapter_only_loads_with_peft(tmp_path, caplog):
    from peft import PeftModel
    from transformers import DeepseekV3ForCausalLM

    base = tmp_path / "base"
    make_hf_model(v3_config()).save_pretrained(base)
    ours = from_pretrained(base, dtype=torch.float32).eval()
    ours.config.bias_update_speed = 0.0
    args = ["--lora_r", "4", "--lora_targets", "q_b_proj,kv_b_proj,o_proj", "--no-train_router"]
    opts = make_options(args)
    apply_finetune_options(ours, opts.lora, opts.run.seed)
    randomize_adapters(ours)
    ckpt = fake_checkpoint(tmp_path / "step_00000000", ours, base)
    out = tmp_path / "adapter"
    assert dstrain_main(["export", str(ckpt), "--out", str(out), "--adapter_only", "--dtype", "float32"]) == 0
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == str(base)
    hf = PeftModel.from_pretrained(
        DeepseekV3ForCausalLM.from_pretrained(base, dtype=torch.float32), out
    ).eval()
    merged = {n: m.weight.detach().clone() for n, m in lora_modules(ours).items()}
    merge_lora(ours)
    assert any(not torch.equal(merged[n], ours.get_submodule(n).weight) for n in merged)
    ids = torch.randint(0, 320, (2, 20))
    with torch.no_grad():
        assert (hf(input_ids=ids, use_cache=False).logits - ours(ids).logits).abs().max() <= 1e-5
    # routers trained in full (weights and expert bias changed), expert and router adapters: the routers
    # travel as modules_to_save (peft loads them, vLLM would refuse: a warning says so)
    again = from_pretrained(base, dtype=torch.float32).eval()
    opts = make_options(["--lora_r", "4", "--lora_targets", "o_proj,experts", "--train_router"])
    apply_finetune_options(again, opts.lora, opts.run.seed)
    randomize_adapters(again)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for r in again.routers():
            r.weight.add_(0.1 * torch.randn(r.weight.shape, generator=g))
            r.e_score_correction_bias.add_(0.05 * torch.randn(r.e_score_correction_bias.shape, generator=g))
    ckpt2 = fake_checkpoint(tmp_path / "r" / "step_00000000", again, base)
    out2 = tmp_path / "a2"
    assert (
        dstrain_main(["export", str(ckpt2), "--out", str(out2), "--adapter_only", "--dtype", "float32"]) == 0
    )
    assert "modules_to_save, which peft loads and vLLM refuses" in caplog.text
    conf = json.loads((out2 / "adapter_config.json").read_text())
    routers = [
        f"model.{n}" for n, _ in again.named_modules() if n.startswith("layers.") and n.endswith(".gate")
    ]
    assert conf["modules_to_save"] == routers and "up_proj" in conf["target_modules"]
    hf = PeftModel.from_pretrained(
        DeepseekV3ForCausalLM.from_pretrained(base, dtype=torch.float32), out2
    ).eval()
    with torch.no_grad():
        assert (hf(input_ids=ids, use_cache=False).logits - again(ids).logits).abs().max() <= 1e-5


def test_adapter_only_with_shared_experts_loads_in_peft_as_written(tmp_path, capsys):
    """The README's targets (shared experts among them): the folder `--adapter_only` writes loads with
    `PeftModel.from_pretrained` unchanged and gives the merged export's logits (peft alone re-targets
    shared_experts' gate/up/down_proj onto the routed experts: 0.05 off, issue 60.3); `--verify` checks that
    folder with peft, and refuses a run that started from no Hugging Face folder before writing."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    make_hf_model(v3_config()).save_pretrained(base)
    ours = from_pretrained(base, dtype=torch.float32).eval()
    opts = make_options(
        ["--lora_r", "4", "--lora_targets", "q_b_proj,kv_b_proj,o_proj,shared_experts,experts"]
    )
    apply_finetune_options(ours, opts.lora, opts.run.seed)
    randomize_adapters(ours)
    ckpt = fake_checkpoint(tmp_path / "step_00000000", ours, base)
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    argv = ["export", str(ckpt), "--dtype", "float32", "--verify"]
    assert dstrain_main([*argv, "--out", str(merged)]) == 0
    assert dstrain_main([*argv, "--out", str(adapter), "--adapter_only"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    diff = float(
        re.search(r"verify: max \|logits diff\| (\S+) \(tolerance 0.0001, peft on transformers", line)[1]
    )
    assert diff <= 1e-5 and line.endswith(": ok")
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in conf["target_parameters"]
    assert {"gate_proj", "up_proj", "down_proj"} <= set(conf["target_modules"])  # the engines' leaf names
    ids = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        want = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(ids).logits
        effect = (plain(ids).logits - want).abs().max()
        peft = PeftModel.from_pretrained(plain, adapter).eval()
        wrapped = [n for n, m in peft.named_modules() if hasattr(m, "lora_A")]
        assert any("shared_experts.gate_proj" in n for n in wrapped)
        got = peft(input_ids=ids, use_cache=False).logits
    assert effect > 0.1 and (got - want).abs().max() <= 1e-5

    preset = from_pretrained(base, dtype=torch.float32).eval()
    apply_finetune_options(preset, opts.lora, opts.run.seed)
    ckpt2 = fake_checkpoint(tmp_path / "p" / "step_00000000", preset, "tiny")
    argv = ["export", str(ckpt2), "--out", str(tmp_path / "a2"), "--adapter_only", "--verify"]
    assert dstrain_main(argv) == 2
    assert (
        "--verify with --adapter_only: the run did not start from a Hugging Face folder"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "a2").exists()


def test_v2_lite_style_folder_fine_tunes_and_exports(tmp_path, capsys, rank_pools):
    """A V2-Lite-shaped folder transformers wrote (no q_lora_rank, softmax routing, no expert bias, no MTP):
    0 steps -> export gives its exact bits back as deepseek_v2; 2 LoRA steps -> merged export loads in
    transformers with dstrain's logits."""
    src = tmp_path / "v2"
    make_hf_model(v2_config(topk_method="greedy", n_group=1, topk_group=1)).save_pretrained(src)
    byte_tokenizer().save_pretrained(src)
    run = f"--model {src} --output_dir {tmp_path / 'run'} --lora_r 4 --lora_targets q_proj,o_proj".split()
    run.append("--no-train_router")
    assert re.search(
        r"dstrain: loaded .*v2: rank 0 read \d+ KiB of \d+ KiB",
        train(rank_pools, [*run, "--max_steps", "0"]).stdout,
    )
    train(rank_pools, [*run, "--max_steps", "2", "--resume", "auto"])
    ckpts = tmp_path / "run" / "checkpoints"
    assert dstrain_main(["export", str(ckpts / "step_00000000"), "--out", str(tmp_path / "out0")]) == 0
    want, got = read_folder(src), read_folder(tmp_path / "out0")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((tmp_path / "out0" / "config.json").read_text())["model_type"] == "deepseek_v2"
    capsys.readouterr()
    assert (
        dstrain_main(["export", str(ckpts / "step_00000002"), "--out", str(tmp_path / "out2"), "--verify"])
        == 0
    )
    assert "verify: max |logits diff|" in capsys.readouterr().out
    merged = read_folder(tmp_path / "out2")
    changed = [k for k in want if not torch.equal(merged[k], want[k])]
    assert changed and all(k.endswith(("q_proj.weight", "o_proj.weight")) for k in changed), changed


def test_export_carries_the_code_files_a_config_auto_map_names():
    """A model_type transformers does not know (Kimi-K2's kimi_k2) loads through the checkpoint's own code
    files: the export copies the ones its auto_map names, beside the tokenizer files."""
    from dstrain.checkpoint.export import _remote_code
    from dstrain.model import ModelConfig
    from tests.model.deepseek_v3.test_config import KIMI_K2

    auto_map = {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "moonshotai/Kimi-K2-Instruct--modeling_deepseek.DeepseekV3ForCausalLM",
    }
    cfg = ModelConfig.from_hf_dict(KIMI_K2 | {"auto_map": auto_map})
    assert _remote_code(cfg) == ["configuration_deepseek.py", "modeling_deepseek.py"]
    assert cfg.to_hf_dict()["auto_map"] == auto_map


@pytest.mark.parametrize("variant", ["deepseek_v3", "deepseek_v32"])
def test_lora_sft_of_a_transformers_folder_exports_verifies_and_generates(
    variant, tmp_path, capsys, rank_pools
):
    """The journey of a new user: a folder transformers wrote, LoRA SFT on chats under ZeRO-3, export --verify,
    then transformers' generate on the export. V3.2 with 4 indexer heads and top-k 16: many indexer scores are
    exactly 0 after the ReLU, and verify must not fail a correct export on how torch.topk breaks their ties."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.data_files import chat_rows, write_jsonl
    from tests.helpers.hf import v32_config

    src, run, out = tmp_path / "src", tmp_path / "run", tmp_path / "out"
    config = v3_config() if variant == "deepseek_v3" else v32_config(index_n_heads=4, index_topk=16)
    make_hf_model(config).save_pretrained(src)
    byte_tokenizer().save_pretrained(src)
    data = write_jsonl(tmp_path / "chats.jsonl", chat_rows(40))
    train(rank_pools, ["--model", str(src), "--config", "zero3", "--data", data, "--seq_len", "256", "--lora_r", "8", "--max_steps", "2",
           "--output_dir", str(run)])  # fmt: skip
    capsys.readouterr()
    assert (
        dstrain_main(["export", str(run / "checkpoints" / "step_00000002"), "--out", str(out), "--verify"])
        == 0
    )
    line = capsys.readouterr().out.splitlines()[-1]
    diff = float(re.search(r"max \|logits diff\| (\S+)", line).group(1))
    assert line.endswith(": ok") and diff < 1e-4, line
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = torch.tensor([[1, 5, 9, 2]])
    generated = hf.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 10) and torch.equal(generated[:, :4], prompt)


@pytest.mark.parametrize("family", ["kimi_linear", "glm5_next"])
def test_kda_hybrid_lora_sft_of_a_transformers_folder_exports_verifies_and_generates(
    family, tmp_path, capsys, rank_pools
):
    """The same journey for the KDA hybrids: a Kimi Linear or GLM-5.3-Flash folder transformers wrote (GLM's
    with its vision tower), LoRA SFT on chats under ZeRO-3, export --verify, transformers' generate on the
    export (GLM-5.3-Flash through its image-text-to-text class, text only)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from tests.helpers.data_files import chat_rows, write_jsonl

    src, run, out = tmp_path / "src", tmp_path / "run", tmp_path / "out"
    if family == "kimi_linear":
        from tests.model.kimi_linear.conftest import kimi_model as hf_model

        auto = AutoModelForCausalLM
    else:
        from tests.model.glm5_next.conftest import glm_model as hf_model

        auto = AutoModelForImageTextToText
    hf_model(vocab_size=272).save_pretrained(src)  # the byte tokenizer's ids
    byte_tokenizer().save_pretrained(src)
    data = write_jsonl(tmp_path / "chats.jsonl", chat_rows(40))
    train(rank_pools, ["--model", str(src), "--config", "zero3", "--data", data, "--seq_len", "256", "--lora_r", "8", "--max_steps", "2",
           "--output_dir", str(run)])  # fmt: skip
    capsys.readouterr()
    step = str(run / "checkpoints" / "step_00000002")
    assert dstrain_main(["export", step, "--out", str(out), "--verify"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    diff = float(re.search(r"max \|logits diff\| (\S+)", line).group(1))
    assert line.endswith(": ok") and diff < 1e-4, line
    hf = auto.from_pretrained(out, dtype=torch.float32).eval()
    prompt = torch.tensor([[1, 5, 9, 2]])
    generated = hf.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 10) and torch.equal(generated[:, :4], prompt)


def test_a_preset_runs_export_ships_the_tokenizer_it_trained_with(tmp_path, caplog, rank_pools):
    """No folder to copy tokenizer files from: the export saves the run's own (the bundled DeepSeek-V3
    tokenizer by default), and transformers loads it without a word about its class."""
    import logging

    from transformers import AutoTokenizer

    from dstrain.data.tokenizer import load_tokenizer

    train(rank_pools, ["--model", "tiny", "--max_steps", "0", "--output_dir", str(tmp_path / "run")])
    out = tmp_path / "out"
    info = ex.export(tmp_path / "run" / "checkpoints" / "step_00000000", out)
    assert "tokenizer.json" in info["tokenizer"] and (out / "tokenizer.json").is_file()
    with caplog.at_level(logging.WARNING):
        tok = AutoTokenizer.from_pretrained(out)
    assert not [r for r in caplog.records if "tokenizer" in r.getMessage().lower()], caplog.text
    text = "<｜User｜>Hello<｜Assistant｜>Hi there"
    assert tok(text)["input_ids"] == load_tokenizer(None)(text)["input_ids"]


def test_deepseek_v4_adapter_only_loads_in_peft_on_transformers(tmp_path, capsys):
    """No serving engine defines DeepSeek-V4 LoRA yet: `--adapter_only` writes the PEFT form transformers'
    DeepseekV4ForCausalLM loads (its module names are dstrain's under `model.`; routed experts one key per
    expert, converted for peft like V3's), and `--verify` gives peft's logits on transformers those of the
    checkpoint. The grouped output projection o_a_proj has no PEFT form: adapted, it is refused in one line."""
    from tests.model.deepseek_v4.test_state_dict import _ds_model

    base = tmp_path / "base"
    _ds_model().save_pretrained(base)
    for targets, ok in (("q_b_proj,kv_proj,o_b_proj,shared_experts,experts", True), ("o_a_proj", False)):
        ours = from_pretrained(base, dtype=torch.float32).eval()
        ours.config.bias_update_speed = 0.0  # as a LoRA run keeps it: the routers stay the base's
        opts = make_options(["--lora_r", "4", "--lora_targets", targets, "--no-train_router"])
        apply_finetune_options(ours, opts.lora, opts.run.seed)
        randomize_adapters(ours)
        ckpt = fake_checkpoint(tmp_path / targets / "step_00000000", ours, base)
        argv = [
            "export",
            str(ckpt),
            "--out",
            str(tmp_path / targets / "a"),
            "--adapter_only",
            "--dtype",
            "float32",
        ]
        if not ok:
            assert dstrain_main(argv) == 2
            assert (
                "o_a_proj: DeepSeek-V4's grouped output projection has no PEFT form"
                in capsys.readouterr().err
            )
            continue
        assert dstrain_main([*argv, "--verify"]) == 0
        line = capsys.readouterr().out.splitlines()[-1]
        diff = float(re.search(r"verify: max \|logits diff\| (\S+) \(tolerance", line)[1])
        assert diff <= 1e-5 and line.endswith(": ok"), line


def test_kimi_linear_adapter_only_loads_in_peft_on_transformers(tmp_path, capsys):
    """Kimi Linear: `--adapter_only` writes the PEFT form transformers' KimiLinearForCausalLM loads (dstrain's
    names under `model.`, KDA's forget-gate projections under `forget_gate`, routed experts one key per expert),
    adapters on KDA's projections and gates, MLA's, the shared and the routed experts; `--verify` gives peft's
    logits on transformers those of the checkpoint."""
    from tests.model.kimi_linear.conftest import kimi_model

    base = tmp_path / "base"
    kimi_model().save_pretrained(base)
    ours = from_pretrained(base, dtype=torch.float32).eval()
    ours.config.bias_update_speed = 0.0  # as a LoRA run keeps it: the routers stay the base's
    targets = "q_proj,k_proj,v_proj,f_a_proj,f_b_proj,b_proj,g_b_proj,kv_b_proj,o_proj,shared_experts,experts"
    opts = make_options(["--lora_r", "4", "--lora_targets", targets, "--no-train_router"])
    apply_finetune_options(ours, opts.lora, opts.run.seed)
    randomize_adapters(ours)
    ckpt = fake_checkpoint(tmp_path / "ckpt" / "step_00000000", ours, base)
    argv = ["export", str(ckpt), "--out", str(tmp_path / "a"), "--adapter_only", "--dtype", "float32"]
    assert dstrain_main([*argv, "--verify"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    diff = float(re.search(r"verify: max \|logits diff\| (\S+) \(tolerance", line)[1])
    assert diff <= 1e-5 and line.endswith(": ok"), line


def test_glm5_next_adapter_only_loads_in_peft_on_transformers(tmp_path, capsys):
    """GLM-5.3-Flash: `--adapter_only` writes the PEFT form transformers' Glm5NextForConditionalGeneration loads
    (dstrain's names under `model.language_model.`, KDA's forget-gate projections under `forget_gate`, routed
    experts one key per expert; the MTP layer's adapters left out: transformers builds no MTP); `--verify` gives
    peft's logits on transformers those of the checkpoint."""
    from tests.model.glm5_next.conftest import glm_model

    base = tmp_path / "base"
    glm_model().save_pretrained(base)
    ours = from_pretrained(base, dtype=torch.float32).eval()
    ours.config.bias_update_speed = 0.0  # as a LoRA run keeps it: the routers stay the base's
    targets = (
        "q_proj,k_proj,v_proj,f_a_proj,f_b_proj,g_b_proj,q_b_proj,kv_b_proj,o_proj,shared_experts,experts"
    )
    opts = make_options(["--lora_r", "4", "--lora_targets", targets, "--no-train_router"])
    apply_finetune_options(ours, opts.lora, opts.run.seed)
    randomize_adapters(ours)
    ckpt = fake_checkpoint(tmp_path / "ckpt" / "step_00000000", ours, base)
    argv = ["export", str(ckpt), "--out", str(tmp_path / "a"), "--adapter_only", "--dtype", "float32"]
    assert dstrain_main([*argv, "--verify"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    diff = float(re.search(r"verify: max \|logits diff\| (\S+) \(tolerance", line)[1])
    # the CLI's tolerance (1e-4); seen 1.1e-5 (random adapters through 4 mHC streams and every layer kind)
    assert diff <= 1e-4 and line.endswith(": ok"), line


# ------------------------------------------------------------------ the source's quantized form
def v3_fp8_folder(path):
    """A DeepSeek-V3-style FP8 folder: the official layout (MTP layer), every projection e4m3 with an fp32
    `weight_scale_inv` per 128x128 block (amax / 448), the rest bf16; quantization_config as V3's."""
    path.mkdir()
    official_folder(path, shards=1)
    byte_tokenizer().save_pretrained(path)
    quantize_folder_fp8(path)
    return path


def check_same_bytes(src, out) -> None:
    """Every tensor of `out` is `src`'s: name, dtype, shape, bytes."""
    a, b = raw_tensors(src), raw_tensors(out)
    assert a.keys() == b.keys()
    assert [k for k in a if a[k] != b[k]] == []


def test_untrained_fp8_folder_exports_byte_identical_and_verifies(tmp_path, capsys):
    """V3-style FP8 (fp32 block scales; weights held in bf16, which does not hold q x scale: the source's
    scale is kept where the block is still on its grid) -> the very tensors; quantization_config kept;
    --verify loads it with transformers' FP8 loader (dequantizing on the CPU); --dtype bfloat16: today's."""
    src = v3_fp8_folder(tmp_path / "src")
    ckpt = fake_checkpoint(tmp_path / "ckpt" / "step_00000000", from_pretrained(src), src)
    out = tmp_path / "out"
    assert dstrain_main(["export", str(ckpt), "--out", str(out), "--verify"]) == 0
    printed = capsys.readouterr().out
    assert "weights quantized, all exactly" in printed and ": ok" in printed, printed
    check_same_bytes(src, out)
    assert json.loads((out / "config.json").read_text())["quantization_config"] == V3_FP8
    ex.export(ckpt, tmp_path / "bf16", dtype="bfloat16")
    plain = read_folder(tmp_path / "bf16")
    assert (
        not any(k.endswith("_scale_inv") for k in plain) and plain[next(iter(plain))].dtype == torch.bfloat16
    )
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())


def test_untrained_v4_fp8_and_fp4_folder_exports_byte_identical(tmp_path, capsys):
    """DeepSeek-V4 as published (FP8 e8m0 128x128 blocks, FP4 experts in 1x32 e8m0 blocks, DeepSeek's names)
    -> the very tensors, quantization_config and expert_dtype kept; transformers dequantizes it on the CPU."""
    from tests.model.deepseek_v4.test_state_dict import _ds_folder, _ds_model, _quantized_folder

    _quantized_folder(tmp_path / "src", _ds_folder(tmp_path / "plain", _ds_model()))
    src = tmp_path / "src"
    ckpt = fake_checkpoint(tmp_path / "ckpt" / "step_00000000", from_pretrained(src), src)
    assert dstrain_main(["export", str(ckpt), "--out", str(tmp_path / "out"), "--verify"]) == 0
    assert ": ok" in capsys.readouterr().out
    check_same_bytes(src, tmp_path / "out")
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    want = json.loads((src / "config.json").read_text())
    assert (conf["quantization_config"], conf["expert_dtype"]) == (want["quantization_config"], "fp4")


def test_untrained_int4_folder_exports_byte_identical(tmp_path, capsys):
    """Kimi-K2.5 (compressed-tensors INT4 experts, packed by the package) -> the very tensors, vision tower
    included, text_config's quantization_config kept; verified by transformers' compressed-tensors loader."""
    from tests.model.hf.test_kimi_k25 import k25_folder

    src = tmp_path / "src"
    src.mkdir()
    k25_folder(src)
    ckpt = fake_checkpoint(tmp_path / "ckpt" / "step_00000000", from_pretrained(src), src)
    assert dstrain_main(["export", str(ckpt), "--out", str(tmp_path / "out"), "--verify"]) == 0
    assert ": ok" in capsys.readouterr().out
    check_same_bytes(src, tmp_path / "out")
    conf, want = (json.loads((p / "config.json").read_text()) for p in (tmp_path / "out", src))
    assert conf["text_config"]["quantization_config"] == want["text_config"]["quantization_config"]


def test_lora_is_merged_into_the_dequantized_base_then_quantized(tmp_path, capsys):
    """LoRA on attention and the routed experts of an FP8 folder: each adapted weight is written as
    quantize(dequantized base + (alpha / r) B A) exactly, the others byte for byte; the error is printed and
    transformers' dequantization of the folder verified."""
    src = v3_fp8_folder(tmp_path / "src")
    model = from_pretrained(src, dtype=torch.float32)
    model.config.bias_update_speed = 0.0
    opts = make_options(["--lora_r", "4", "--lora_targets", "q_b_proj,o_proj,experts", "--no-train_router"])
    apply_finetune_options(model, opts.lora, opts.run.seed)
    randomize_adapters(model)
    ckpt = fake_checkpoint(tmp_path / "ckpt" / "step_00000000", model, src)
    assert dstrain_main(["export", str(ckpt), "--out", str(tmp_path / "out"), "--verify"]) == 0
    printed = capsys.readouterr().out
    assert "relative RMS error mean" in printed and ": ok" in printed, printed
    opened = store.open_checkpoint(ckpt)
    merged = dict(to_hf(ex.merge_stream(read_weights(ckpt), opened.lora), opened.config))
    source, got = read_folder(src), read_folder(tmp_path / "out")
    moved = 0
    for key, w in merged.items():
        if key + "_scale_inv" not in source:
            continue
        want = quantize_fp8(w, torch.float32, keep=source[key + "_scale_inv"])
        assert torch.equal(got[key].view(torch.uint8), want[0].view(torch.uint8)), key
        assert torch.equal(got[key + "_scale_inv"], want[1]), key
        moved += not torch.equal(got[key].view(torch.uint8), source[key].view(torch.uint8))
    assert moved >= 3 * 2 + 8 * 3 * 2  # q_b_proj and o_proj of 3 blocks (MTP's too), every routed expert
