"""DeepSeek-V4 through `dstrain train` and `dstrain export`: fine-tuning a transformers-written folder, the
round trip back to it bit for bit, --verify against transformers, LoRA DPO on it, and the layouts refused in one
line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dstrain.cli import main as dstrain_main
from dstrain.parallel import ParallelDims
from tests.helpers.hf import read_folder
from tests.helpers.runs import train
from tests.helpers.tiny import byte_tokenizer, tiny_v4_config
from tests.helpers.v4 import tiny_v4


@pytest.fixture(scope="module")
def v4_folder(tmp_path_factory):
    """A transformers-saved V4 folder (its hybrid key names) with a byte tokenizer that fits its vocabulary."""
    path = tmp_path_factory.mktemp("v4") / "hf"
    tokenizer = byte_tokenizer()
    tiny_v4(vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_fine_tune_round_trip_and_verify(v4_folder, tmp_path, capsys, rank_pools):
    """--max_steps 0 then export: the source folder's tensors bit for bit (its key style and config.json), and
    the MTP module transformers does not write (in DeepSeek's names, started fresh). Then 3 steps of LoRA on
    V4's projections (o_a_proj's block-diagonal weight included), experts and routers under ZeRO-3 on the
    built-in text: the merged export loads in transformers with the model's logits, the hash table unchanged,
    the biased layers' bias moved; an adapter-only export is refused in one line."""
    train(rank_pools, ["--model", str(v4_folder), "--max_steps", "0", "--output_dir", str(tmp_path / "zero")])
    out = tmp_path / "same"
    assert dstrain_main(["export", str(tmp_path / "zero"), "--out", str(out), "--dtype", "float32"]) == 0
    src, got = read_folder(v4_folder), read_folder(out)
    assert {k for k in got if not k.startswith("mtp.")} == src.keys()  # + the MTP module, started fresh
    assert all(got[k].dtype == src[k].dtype and torch.equal(got[k], src[k]) for k in src)
    assert json.loads((out / "config.json").read_text())["layer_types"] == tiny_v4().config.layer_types

    targets = "q_a_proj,q_b_proj,kv_proj,o_a_proj,o_b_proj,shared_experts,experts,gate"
    run = tmp_path / "run"
    proc = train(rank_pools, ["--model", str(v4_folder), "--max_steps", "3", "--config", "zero3", "--dsa_stage", "sparse"]
                 + ["--lora_r", "4", "--lora_targets", targets, "--output_dir", str(run)]
                 + ["--moe_bias_update_speed", "1e-3"])  # LoRA keeps the bias unless asked  # fmt: skip
    assert "window + compressed entries" in proc.stdout  # the kernel line names V4's attention
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [h for h in history if "loss" in h]
    assert len(steps) == 3 and all(h["indexer_loss"] is not None for h in steps)
    capsys.readouterr()
    assert dstrain_main(["export", str(run), "--out", str(tmp_path / "merged"), "--verify"]) == 0
    assert ": ok" in capsys.readouterr().out
    trained = read_folder(tmp_path / "merged")
    table = "model.layers.0.ffn.gate.tid2eid"  # transformers' saved names
    assert torch.equal(trained[table], src[table])
    bias = "model.layers.1.ffn.gate.bias"
    assert not torch.equal(trained[bias], src[bias])  # the biased layers balance
    q_a = "model.layers.1.attn.wq_a.weight"
    assert not torch.equal(trained[q_a], src[q_a])  # the adapters trained and merged
    assert dstrain_main(["export", str(run), "--out", str(tmp_path / "adapter"), "--adapter_only"]) == 2
    assert "o_a_proj: DeepSeek-V4's grouped output projection has no PEFT form" in capsys.readouterr().err


def test_lora_dpo_on_a_v4_folder(v4_folder, tmp_path, rank_pools):
    """--objective dpo with LoRA on the transformers-written V4 folder (the default V4 targets, the reference its
    adapters off): at step 1 the adapters (B = 0) are the reference, so the loss is log 2 with zero rewards;
    4 pairs, 2 a step, so step 3 reads step 1's again: its loss below log 2, its pairs ranked right (seen: 0.693,
    0.716, 0.536; accuracy 0, 0, 1)."""
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": f"{i} plus {i}?", "chosen": f"{2 * i}.", "rejected": f"{2 * i + 1}."} for i in range(4)
    ]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "dpo"
    flags = "--objective dpo --lora_r 4 --lr 1e-2 --max_steps 3 --seq_len 64 --num_workers 0 --save_every 0"
    flags += " --no-plots --no-tensorboard"
    train(
        rank_pools,
        ["--model", str(v4_folder), "--data", str(pairs), "--output_dir", str(run), *flags.split()],
    )
    steps = [h for h in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in h]
    assert len(steps) == 3 and all(h["rewards/accuracies"] is not None for h in steps)
    assert abs(steps[0]["loss"] - math.log(2)) <= 1e-6 and steps[0]["rewards/margins"] == 0.0
    assert steps[2]["loss"] < math.log(2) - 0.01 and steps[2]["rewards/accuracies"] == 1.0


def test_tensor_parallel_sizes_are_checked_in_one_line():
    """TP keeps whole output groups per rank: --tp must divide o_groups too (tp.py, `Family.tp_sizes`)."""
    ParallelDims(world=2, tp=2).validate(tiny_v4_config(), 1)
    with pytest.raises(ValueError, match="^--tp 4 must divide o_groups 2$"):
        ParallelDims(world=4, tp=4).validate(tiny_v4_config(num_attention_heads=4), 1)
