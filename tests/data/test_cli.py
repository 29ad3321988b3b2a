"""`dstrain data audit|stats`, options as CLI flags, and tokenizer loading (real DeepSeek one, offline)."""

import argparse
import dataclasses
import json
import os

import pytest

from dstrain.cli import main as dstrain_main
from dstrain.data import DataOptions, field_help, load_tokenizer
from dstrain.data.options import add_arguments, from_args
from tests.helpers.data_files import chat_rows, text_rows, varied_chats, write_jsonl
from tests.helpers.tiny import byte_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    byte_tokenizer().save_pretrained(str(path))
    return str(path)


def test_every_option_has_a_docstring_and_a_flag():
    helps = field_help()
    names = [f.name for f in dataclasses.fields(DataOptions)]
    assert set(helps) == set(names) and all(len(h) > 20 for h in helps.values())
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    opts = from_args(
        parser.parse_args(["--data", "x.jsonl", "--seq_len", "64", "--no-shuffle", "--tokenizer", "t"])
    )
    assert (opts.data, opts.seq_len, opts.shuffle, opts.tokenizer, opts.packing) == (
        "x.jsonl",
        64,
        False,
        "t",
        True,
    )
    assert from_args(parser.parse_args([])) == DataOptions()


def test_deepseek_tokenizer_loads_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = load_tokenizer(None)
    assert tok.is_fast and len(tok) == 128815
    assert tok.eos_token == "<｜end▁of▁sentence｜>" and tok.bos_token == "<｜begin▁of▁sentence｜>"
    assert "<｜Assistant｜>" in tok.chat_template
    assert load_tokenizer("deepseek-v3").vocab_size == tok.vocab_size
    # a checkpoint folder without tokenizer files falls back to DeepSeek's
    assert len(load_tokenizer(None, str(tmp_path))) == 128815


def test_tokenizer_resolution_order(tok_dir, tmp_path):
    assert len(load_tokenizer(None, tok_dir)) == 261  # the checkpoint's own tokenizer
    assert len(load_tokenizer(tok_dir, str(tmp_path))) == 261  # --tokenizer wins
    assert len(load_tokenizer(os.path.join(tok_dir, "tokenizer.json"))) == 261
    from dstrain.data import DataError

    with pytest.raises(DataError, match="cannot load"):
        load_tokenizer(str(tmp_path / "missing_dir"))


def test_audit_marks_exactly_the_assistant_replies(tmp_path, tok_dir, capsys):
    path = write_jsonl(tmp_path / "c.jsonl", chat_rows(5, turns=2))
    code = dstrain_main(
        ["data", "audit", "--data", path, "--tokenizer", tok_dir, "--n", "2", "--color", "never"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert (
        "<|im_start|>user\nquestion 0.0<|im_end|>\n<|im_start|>assistant\n[[answer 0.0<|im_end|>]]\n" in out
    )
    assert "## sample 2:" in out and "## sample 3:" not in out
    replies = [m["content"] for r in chat_rows(5, turns=2) for m in r["messages"] if m["role"] == "assistant"]
    expected_targets = sum(len(r) + 1 for r in replies)  # one byte per token + <|im_end|>
    assert (
        f"targets: {expected_targets}\n" in out and "samples: 5\n" in out and "assistant_turns: 10\n" in out
    )


def test_audit_rejects_a_chat_without_assistant_turn(tmp_path, tok_dir, capsys):
    path = write_jsonl(
        tmp_path / "c.jsonl", chat_rows(2) + [{"messages": [{"role": "user", "content": "hm"}]}]
    )
    assert dstrain_main(["data", "audit", "--data", path, "--tokenizer", tok_dir]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dstrain: error: data: chat without an assistant turn in ") and "row 3" in err


def test_stats_reports_counts_fill_and_speed(tmp_path, tok_dir, capsys):
    rows = varied_chats(120)
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    assert (
        dstrain_main(
            [
                "data",
                "stats",
                "--data",
                path,
                "--tokenizer",
                tok_dir,
                "--seq_len",
                "512",
                "--rounds",
                "1",
                "--json",
            ]
        )
        == 0
    )
    stats = json.loads(capsys.readouterr().out)
    tok = byte_tokenizer()
    texts = [tok.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    expected_tokens = sum(len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"])
    assert stats["documents"] == 120 and stats["tokens"] == expected_tokens
    assert stats["fill"] >= 0.99 and stats["naive_fill"] < 0.5 and stats["fill_one_pass"] <= stats["fill"]
    assert stats["dropped"] == 0 and stats["truncated"] == 0 and stats["format"] == "chat"
    assert stats["tokens_per_s"] > 0 and stats["raw_tokens_per_s"] > 0 and stats["ab_runs"] == 2


def test_stats_through_the_dstrain_command_on_text(tmp_path, tok_dir, capsys):
    from dstrain.cli import main as dstrain_main

    path = write_jsonl(tmp_path / "d.jsonl", text_rows(40))
    args = ["data", "stats", "--data", path, "--tokenizer", tok_dir, "--seq_len", "64", "--rounds", "1"]
    assert dstrain_main(args + ["--max_docs", "30", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    expected = sum(len(r["text"]) + 1 for r in text_rows(30))  # bytes + EOS
    assert stats["documents"] == 30 and stats["tokens"] == expected
    assert stats["fill"] == 1.0 and stats["rows"] == -(-expected // 64)


def test_stats_reads_as_lines_without_json(tmp_path, tok_dir, capsys):
    from dstrain.cli import main as dstrain_main

    path = write_jsonl(tmp_path / "d.jsonl", text_rows(10))
    assert dstrain_main(["data", "stats", "--data", path, "--tokenizer", tok_dir, "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{path}: format text, seq_len 64"  # train's default row length
    figures = dict(line.split(None, 1) for line in lines[1:])
    assert figures["documents"] == "10" and figures["fill"] == "1.0"
