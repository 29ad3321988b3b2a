"""Sources: `--data` grammar, files / globs / folders / built-in / hub names, formats of every file type."""

import gzip
import json

import pytest

from dstrain.data import DataError, DataOptions, build_loader
from dstrain.data import sources as sources_mod
from dstrain.data.pipeline import SourceReader
from dstrain.data.sources import resolve_sources, split_spec
from tests.helpers.data_files import chat_rows, text_rows, write_jsonl, write_parquet
from tests.helpers.tiny import byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def all_docs(opts):
    out = []
    for i, src in enumerate(resolve_sources(opts)):
        reader = SourceReader(src, i, opts, 0, 1, 0, on_skip=lambda skip, origin: None, epochs=1)
        while (item := reader.next()) is not None:
            out.append(item[0])
    return out


def test_spec_grammar():
    assert split_spec("a.jsonl:0.7, b.parquet:0.3") == [("a.jsonl", 0.7), ("b.parquet", 0.3)]
    assert split_spec("allenai/c4:en@validation:2") == [("allenai/c4:en@validation", 2.0)]
    assert split_spec("glue:cola,x.txt") == [("glue:cola", 1.0), ("x.txt", 1.0)]
    with pytest.raises(DataError, match="weight of 'a.jsonl' must be > 0"):
        split_spec("a.jsonl:0")
    with pytest.raises(DataError, match="empty source"):
        split_spec("a.jsonl,,b.jsonl")


def test_every_file_type_and_format(tmp_path):
    rows = text_rows(5)
    write_jsonl(tmp_path / "t.jsonl", rows)
    (tmp_path / "t.json").write_text(json.dumps(rows))
    write_parquet(tmp_path / "t.parquet", rows, row_group_size=2)
    (tmp_path / "t.csv").write_text("text,other\n" + "".join(f'"{r["text"]}",1\n' for r in rows))
    with gzip.open(tmp_path / "t.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    expected = [r["text"] for r in rows]
    for name in ("t.jsonl", "t.json", "t.parquet", "t.csv", "t.jsonl.gz", "saved"):
        assert all_docs(DataOptions(data=str(tmp_path / name))) == expected, name
    # a save_to_disk folder: only its .arrow files, never dataset_info.json / state.json
    [src] = resolve_sources(DataOptions(data=str(tmp_path / "saved")))
    assert [p.endswith(".arrow") for p, _ in src.files] == [True]


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("paragraph", ["one\ntwo", "three", "four"]),
        ("line", ["one", "two", "", "three", "", "", "four"]),
        ("document", ["one\ntwo\n\nthree\n\n\nfour\n"]),
    ],
)
def test_txt_split_modes(tmp_path, mode, expected):
    (tmp_path / "a.txt").write_text("one\ntwo\n\nthree\n\n\nfour\n")
    docs = all_docs(DataOptions(data=str(tmp_path / "a.txt"), txt_split=mode))
    assert docs == [d for d in expected if d.strip()]  # blank lines are skipped as empty documents


def test_globs_folders_and_mixed_formats(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", text_rows(2, prefix="a"))
    write_jsonl(tmp_path / "b.jsonl", text_rows(3, prefix="b"))
    (tmp_path / "nested").mkdir()
    write_jsonl(tmp_path / "nested" / "c.jsonl", text_rows(1, prefix="c"))
    [src] = resolve_sources(DataOptions(data=str(tmp_path / "*.jsonl")))
    assert src.n_shards == 2
    [src] = resolve_sources(DataOptions(data=str(tmp_path)))
    assert [p.rsplit("/", 1)[1] for p, _ in src.files] == ["a.jsonl", "b.jsonl", "c.jsonl"]
    write_parquet(tmp_path / "nested" / "d.parquet", text_rows(4))
    [src] = resolve_sources(DataOptions(data=str(tmp_path)))  # parquet wins over json in a folder
    assert [b for _, b in src.files] == ["parquet"]


def test_format_detection(tmp_path):
    cases = {
        "text": [{"text": "x"}],
        "chat": chat_rows(1),
        "instruction": [{"instruction": "i", "input": "", "output": "o"}],
    }
    for fmt, rows in cases.items():
        [src] = resolve_sources(DataOptions(data=write_jsonl(tmp_path / f"{fmt}.jsonl", rows)))
        assert src.fmt == fmt
    seed = write_jsonl(
        tmp_path / "seed.jsonl", [{"instruction": "i", "instances": [{"input": "", "output": "o"}]}]
    )
    assert resolve_sources(DataOptions(data=seed))[0].fmt == "instruction"
    sharegpt = tmp_path / "sg.json"
    sharegpt.write_text(json.dumps(chat_rows(2, style="sharegpt")))
    assert resolve_sources(DataOptions(data=str(sharegpt)))[0].fmt == "chat"
    with pytest.raises(DataError, match="cannot mix pretraining text, chat/instruction"):
        resolve_sources(DataOptions(data=f"{tmp_path / 'text.jsonl'},{sharegpt}"))


def test_builtin_shakespeare_is_the_default(tok):
    opts = DataOptions(seq_len=128, shuffle=False, num_workers=0, data_streams=1)
    assert opts.data == "shakespeare"
    [src] = resolve_sources(opts)
    assert src.files[0][0].endswith("dstrain/data/builtin/tinyshakespeare.txt")
    batch = next(build_loader(opts, tok, 2))
    text = tok.decode(batch["input_ids"][0].tolist())
    assert text.startswith(
        "First Citizen:\nBefore we proceed any further, hear me speak.</s>All:\nSpeak, speak.</s>"
    )


def test_hub_names_go_through_datasets_streaming(monkeypatch, tok):
    import datasets

    calls = []

    def fake_hub(src):
        calls.append(src.hub)
        rows = {"text": [f"hub{i}: " + "x" * (i % 7) for i in range(30)]}
        return datasets.Dataset.from_dict(rows).to_iterable_dataset(num_shards=3)

    monkeypatch.setattr(sources_mod, "_load_hub", fake_hub)
    opts = DataOptions(data="someone/corpus:en@validation", seq_len=32, num_workers=0)
    [src] = resolve_sources(opts)
    assert src.hub == ("someone/corpus", "en", "validation") and src.n_shards == 3
    assert sorted(all_docs(opts)) == sorted(f"hub{i}: " + "x" * (i % 7) for i in range(30))
    # three shards over two ranks: split by shard, disjoint
    parts = []
    for rank in range(2):
        reader = SourceReader(src, 0, opts, rank, 2, 0, on_skip=lambda skip, origin: None, epochs=1)
        parts.append({item[0] for item in iter(reader.next, None)})
    assert not parts[0] & parts[1] and len(parts[0] | parts[1]) == 30
    loader = build_loader(opts, tok, 2)
    next(loader)
    assert calls[0] == ("someone/corpus", "en", "validation")


def test_unreachable_hub_name_is_one_clear_error(monkeypatch):
    def offline(src):
        raise ConnectionError("Couldn't reach the Hub\nmore detail")

    monkeypatch.setattr(sources_mod, "_load_hub", offline)
    with pytest.raises(DataError) as e:
        resolve_sources(DataOptions(data="nobody/nothing"))
    assert str(e.value) == (
        "data: cannot load 'nobody/nothing' (not a local path; as a hub data set: ConnectionError: Couldn't reach the Hub)"
    )


def test_a_small_shard_is_read_once_then_from_memory(tmp_path, monkeypatch):
    """After a whole first read, a small shard's later reads (each epoch, and resumed mid-shard) come from the
    tables kept in memory, equal to the file's; a read that starts mid-shard keeps nothing."""
    path = write_jsonl(tmp_path / "a.jsonl", text_rows(7))
    opts = DataOptions(data=str(path))
    src = resolve_sources(opts)[0]
    cache: dict = {}
    rows = [t.to_pylist() for t in sources_mod.read_shard(src, 0, 0, opts, cache)]
    assert ("tables", 0) in cache
    monkeypatch.setattr(sources_mod, "_load_file", lambda *a: pytest.fail("the file was opened again"))
    del cache[0]  # the opened dataset too: only the kept tables may serve
    again = [r for t in sources_mod.read_shard(src, 0, 0, opts, cache) for r in t.to_pylist()]
    assert again == [r for t in rows for r in t] and len(again) == 7
    tail = [r for t in sources_mod.read_shard(src, 0, 5, opts, cache) for r in t.to_pylist()]
    assert tail == again[5:]
    fresh: dict = {}
    monkeypatch.undo()
    list(sources_mod.read_shard(src, 0, 3, opts, fresh))
    assert ("tables", 0) not in fresh


def test_a_column_of_texts_and_message_lists_reads_each_as_written(tmp_path):
    """Issue 59.4: `datasets` stores a column whose type varies as JSON text, but keeps a text that its own
    parser reads as JSON ("1.", "007", "7", "true") unquoted; each comes back as the text it was written."""
    reply = [{"role": "assistant", "content": "1."}]
    rows = [
        {"prompt": "Count to one.", "chosen": "1.", "rejected": "007"},
        {"prompt": [{"role": "user", "content": "Count to one."}], "chosen": reply, "rejected": "2."},
        {"prompt": "Say 7", "chosen": "7", "rejected": "true"},
    ]
    docs = all_docs(DataOptions(data=write_jsonl(tmp_path / "mixed.jsonl", rows)))
    completions = [(d["chosen"][0]["content"], d["rejected"][0]["content"]) for d in docs]
    assert completions == [("1.", "007"), ("1.", "2."), ("7", "true")]
    assert [d["prompt"][0]["content"] for d in docs] == ["Count to one.", "Count to one.", "Say 7"]
