"""What `--epochs` counts (dstrain/data/loader.py: epoch_rows)."""

from __future__ import annotations

from dstrain.data import DataOptions, epoch_rows
from tests.helpers.data_files import chat_rows, text_rows, write_jsonl
from tests.helpers.tiny import byte_tokenizer


def test_one_epoch_of_text_is_its_tokens_over_the_row_length(tmp_path):
    rows = text_rows(37)
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    tokens = sum(len(r["text"]) + 1 for r in rows)  # bytes + EOS, packed without padding
    assert epoch_rows(DataOptions(data=path, seq_len=64), byte_tokenizer()) == -(-tokens // 64)


def test_one_epoch_of_chats_is_the_rows_the_loader_packs_them_into(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", chat_rows(30))
    opts = DataOptions(data=path, seq_len=256)
    n = epoch_rows(opts, byte_tokenizer())
    assert 0 < n < 30  # several chats a row, every chat once
    assert epoch_rows(opts, byte_tokenizer()) == n  # counted alike every time (every rank counts it)
