"""Bad input: a one-line DataError naming what is wrong and where, or a counted skip; never a hang or a
silent empty run."""

import dataclasses
import json

import pytest

from dstrain.data import DataError, DataOptions, build_loader
from tests.helpers.data_files import chat_rows, text_rows, write_jsonl
from tests.helpers.tiny import byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert "\n" not in message
    return message


def run_epoch(opts, tok):
    """Stats after the loader has read its whole source once (one data stream)."""
    loader = build_loader(dataclasses.replace(opts, data_streams=1), tok, 2)
    for _ in range(100):
        next(loader)
        if loader.epoch >= 1:
            return loader.stats
    raise AssertionError("no epoch in 100 batches")


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("data_format", "xml", "data_format must be one of auto, text, chat, instruction"),
        ("seq_len", 1, "seq_len must be an integer >= 2"),
        ("overlong", "split", "overlong must be one of drop, truncate"),
        ("shuffle_buffer", -1, "shuffle_buffer must be an integer >= 0"),
        ("data", " ", "data must name at least one source"),
        ("think", "maybe", "think must be one of last, all, none"),
    ],
)
def test_bad_options_name_the_field(field, value, match):
    with pytest.raises(DataError, match=match):
        DataOptions(**{field: value})
    assert issubclass(DataError, ValueError)


def test_missing_field_in_one_record_is_counted_or_named_with_file_and_row(tmp_path, tok):
    rows = text_rows(12)
    rows[2] = {"title": "no text here"}
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    stats = run_epoch(DataOptions(data=path, seq_len=32, shuffle=False, num_workers=0), tok)
    assert stats["skipped_missing_field"] == 1 and stats["documents"] >= 11
    loader = build_loader(DataOptions(data=path, seq_len=32, strict=True, num_workers=0), tok, 2)
    with pytest.raises(DataError) as e:
        for _ in range(10):
            next(loader)
    assert "missing field 'text'" in one_line(e) and f"{path} row 3" in str(e.value)


def test_missing_column_and_undetectable_format(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"body": "x"}] * 3)
    with pytest.raises(DataError) as e:
        build_loader(DataOptions(data=path, data_format="text"), tok, 1)
    assert "missing field 'text'" in one_line(e) and path in str(e.value) and "--text_field" in str(e.value)
    with pytest.raises(DataError, match="cannot detect the format"):
        build_loader(DataOptions(data=path), tok, 1)
    with pytest.raises(DataError, match="missing field 'messages' or 'conversations'"):
        build_loader(DataOptions(data=path, data_format="chat"), tok, 1)
    assert build_loader(DataOptions(data=path, text_field="body", num_workers=0), tok, 1).sft is False


def test_empty_and_missing_sources(tmp_path, tok):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="is empty"):
        build_loader(DataOptions(data=str(tmp_path / "empty.jsonl")), tok, 1)
    with pytest.raises(DataError, match="no file matches"):
        build_loader(DataOptions(data=str(tmp_path / "nothing*.jsonl")), tok, 1)
    (tmp_path / "sub").mkdir()
    with pytest.raises(DataError, match="holds no data files"):
        build_loader(DataOptions(data=str(tmp_path / "sub")), tok, 1)
    with pytest.raises(DataError, match="no such file or folder"):
        build_loader(DataOptions(data=str(tmp_path / "missing.parquet")), tok, 1)


def test_fewer_records_than_streams_train_on_what_there_is(tmp_path, tok):
    # 8 streams, 1 record: every stream falls back to the whole source instead of failing or spinning
    path = write_jsonl(tmp_path / "d.jsonl", text_rows(1))
    loader = build_loader(DataOptions(data=path, seq_len=16, num_workers=0), tok, 1, dp_rank=1, dp_world=2)
    assert loader.streams == 8
    assert "doc0" in tok.decode(next(loader)["input_ids"][0].tolist())


@pytest.mark.parametrize("suffix", ["txt", "jsonl"])
def test_undecodable_bytes_skipped_with_count_or_strict_error(tmp_path, tok, suffix):
    path = tmp_path / f"bad.{suffix}"
    if suffix == "txt":
        path.write_bytes(b"first paragraph\n\nsecond \xff\xfe paragraph\n\nthird paragraph\n")
    else:
        path.write_bytes(b'{"text": "first"}\n{"text": "second \xff here"}\n{"text": "third"}\n')
    stats = run_epoch(DataOptions(data=str(path), seq_len=16, shuffle=False, num_workers=0), tok)
    assert stats["skipped_undecodable"] >= 1 and stats["documents"] >= 2
    loader = build_loader(
        DataOptions(data=str(path), seq_len=16, shuffle=False, strict=True, num_workers=0), tok, 1
    )
    with pytest.raises(DataError) as e:
        for _ in range(5):
            next(loader)
    assert "undecodable bytes" in one_line(e) and f"{path} row 2" in str(e.value)


def test_chat_without_assistant_turn(tmp_path, tok):
    rows = chat_rows(8)
    rows[4] = {"messages": [{"role": "user", "content": "anyone?"}]}
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    stats = run_epoch(DataOptions(data=path, seq_len=256, pack_buffer=8, num_workers=0), tok)
    assert stats["skipped_no_assistant"] >= 1
    loader = build_loader(
        DataOptions(data=path, seq_len=256, strict=True, shuffle=False, num_workers=0, data_streams=1), tok, 1
    )
    with pytest.raises(DataError) as e:
        next(loader)
    assert "chat without an assistant turn" in one_line(e) and "row 5" in str(e.value)


def test_unknown_role_names_it(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", [{"conversations": [{"from": "narrator", "value": "x"}]}])
    loader = build_loader(DataOptions(data=path, num_workers=0), tok, 1)
    with pytest.raises(DataError, match="unknown role 'narrator'"):
        next(loader)


def test_tokenizer_without_eos_or_chat_template(tmp_path):
    text = write_jsonl(tmp_path / "d.jsonl", text_rows(4))
    chat = write_jsonl(tmp_path / "c.jsonl", chat_rows(4))
    with pytest.raises(DataError) as e:
        build_loader(DataOptions(data=text), byte_tokenizer(eos=False), 1)
    assert "has no EOS token" in one_line(e)
    with pytest.raises(DataError, match="has no chat template"):
        build_loader(DataOptions(data=chat), byte_tokenizer(chat_template=None), 1)
    # no pad token: padding uses EOS (padding is never a target)
    no_pad = byte_tokenizer(pad=False)
    short = write_jsonl(tmp_path / "s.jsonl", [{"text": "hi"}])
    batch = next(build_loader(DataOptions(data=short, seq_len=64, packing=False, num_workers=0), no_pad, 1))
    assert (batch["input_ids"][0, -1] == no_pad.eos_token_id) and batch["labels"][0, -1] == -100


def test_nothing_usable_raises_instead_of_spinning(tmp_path, tok):
    rows = [{"messages": [{"role": "user", "content": "q" * 300}, {"role": "assistant", "content": "a"}]}] * 5
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    loader = build_loader(DataOptions(data=path, seq_len=64, pack_buffer=4, num_workers=0), tok, 1)
    with pytest.raises(DataError, match="no usable sample"):
        next(loader)  # every sample is longer than seq_len and dropped
    no_reply = write_jsonl(tmp_path / "n.jsonl", [{"messages": [{"role": "user", "content": "q"}]}] * 3)
    with pytest.raises(DataError, match="was skipped in a whole epoch"):
        next(build_loader(DataOptions(data=no_reply, num_workers=0), tok, 1))


def test_truncation_that_removes_every_target_is_counted(tmp_path, tok):
    rows = chat_rows(10, turns=1)
    rows[0] = {"messages": [{"role": "user", "content": "q" * 300}, {"role": "assistant", "content": "a"}]}
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    opts = DataOptions(data=path, seq_len=128, overlong="truncate", pack_buffer=10, num_workers=0)
    stats = run_epoch(opts, tok)
    assert stats["skipped_no_target"] >= 1


def test_worker_errors_arrive_as_one_line_data_errors(tmp_path, tok):
    rows = text_rows(6)
    rows[3] = {"nope": 1}
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    loader = build_loader(
        DataOptions(data=path, seq_len=16, strict=True, shuffle=False, num_workers=1), tok, 1
    )
    with pytest.raises(DataError) as e:
        for _ in range(20):
            next(loader)
    assert one_line(e).startswith("data: missing field 'text'") and "row 4" in str(e.value)
    json.dumps(loader.state_dict())
