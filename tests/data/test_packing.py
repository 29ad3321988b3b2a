"""Packed rows: position_ids restart per document, label rule at boundaries, padding, best-fit fill."""

import numpy as np
import pytest
import torch

from dstrain.batch import PAD_POSITION
from dstrain.data import DataOptions, build_loader
from dstrain.data.packing import best_fit_decreasing
from tests.helpers.data_files import chat_rows, text_rows, varied_chats, write_jsonl
from tests.helpers.tiny import byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def segments(pos: torch.Tensor) -> list[tuple[int, int]]:
    """The documents of a row, and its padding (position PAD_POSITION) as one more run."""
    n = int((pos != PAD_POSITION).sum())
    starts = (pos[:n] == 0).nonzero().flatten().tolist() + [n]
    return list(zip(starts, starts[1:])) + ([(n, len(pos))] if n < len(pos) else [])


def test_pretraining_rows_concatenate_documents_exactly(tmp_path, tok):
    rows = text_rows(30)
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    opts = DataOptions(data=path, data_streams=1, seq_len=64, shuffle=False, num_workers=0)
    loader = build_loader(opts, tok, 2)
    eos = tok.eos_token_id
    expected = []
    for r in rows:
        expected += tok(r["text"], add_special_tokens=False)["input_ids"] + [eos]
    stream, seen_rows = [], 0
    while len(stream) < len(expected):
        batch = next(loader)
        assert set(batch) == {"input_ids", "labels", "position_ids"}
        for k in batch:
            assert batch[k].dtype == torch.long and batch[k].shape == (2, 64)
        for ids, labels, pos in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
            seen_rows += 1
            assert pos[0] == 0  # every row starts a (possibly continued) document
            for a, b in segments(pos):
                assert torch.equal(pos[a:b], torch.arange(b - a))
                assert labels[a] == -100  # a document's (or continuation's) first token is never a target
                assert torch.equal(labels[a + 1 : b], ids[a + 1 : b])  # no padding, everything else trained
                # a segment is a whole document (ends with EOS) unless it is cut by the end of the row
                assert ids[b - 1] == eos or b == len(pos)
            stream += ids.tolist()
    # nothing lost, duplicated or reordered; documents split at row ends continue in the next row
    assert stream[: len(expected)] == expected
    assert loader.stats["documents"] >= 30 and loader.stats["padding"] == 0


def test_document_split_across_rows_restarts_positions(tmp_path, tok):
    long_doc = {"text": "x" * 150}
    path = write_jsonl(tmp_path / "d.jsonl", [long_doc, {"text": "short one"}])
    loader = build_loader(
        DataOptions(data=path, data_streams=1, seq_len=64, shuffle=False, num_workers=0), tok, 3
    )
    batch = next(loader)
    ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    assert torch.equal(pos[0], torch.arange(64)) and torch.equal(pos[1], torch.arange(64))
    assert (ids[0] == ids[0, 0]).all() and (ids[1] == ids[0, 0]).all()  # 128 of the 150 "x"s
    # third row: the last 22 x's + EOS as one run from 0, then the next document from 0 again
    assert pos[2, :24].tolist() == list(range(23)) + [0]
    assert ids[2, 22] == tok.eos_token_id and labels[2, 22] == tok.eos_token_id  # EOS is trained
    assert labels[2, 23] == -100 and labels[1, 0] == -100


def test_packing_off_pads_with_no_token_positions(tmp_path, tok):
    """Padding holds no token: position id PAD_POSITION (no router counts it), the pad id, no target."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "abc"}, {"text": "defgh"}])
    opts = DataOptions(data=path, data_streams=1, seq_len=16, shuffle=False, packing=False, num_workers=0)
    batch = next(build_loader(opts, tok, 2))
    pad = tok.pad_token_id
    for row, n in zip(range(2), (4, 6)):  # text + EOS
        assert batch["position_ids"][row].tolist() == list(range(n)) + [PAD_POSITION] * (16 - n)
        assert (batch["input_ids"][row, n:] == pad).all()
        assert (batch["labels"][row, n:] == -100).all()
        assert batch["labels"][row, n - 1] == tok.eos_token_id


def test_best_fit_decreasing_places_every_item_once_within_capacity():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, size=400).tolist()
    keys = rng.integers(0, 150, size=400).tolist()  # copies of the same sample share a key
    bins = best_fit_decreasing(lengths, 512, keys)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(400))
    for b in bins:
        assert sum(lengths[i] for i in b) <= 512
        assert len({keys[i] for i in b}) == len(b)  # never two copies of a sample in one row
    fills = sorted(sum(lengths[i] for i in b) for b in bins)
    assert sum(fills[:-3]) / ((len(bins) - 3) * 512) > 0.98
    assert best_fit_decreasing(lengths, 512, keys) == bins  # deterministic


def test_sft_rows_hold_whole_samples_and_fill_99_percent(tmp_path, tok):
    rows = varied_chats(200)
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    opts = DataOptions(
        data=path, data_streams=1, seq_len=512, num_workers=0, pack_buffer=200, shuffle_buffer=50
    )
    loader = build_loader(opts, tok, 4, seed=5)
    from dstrain.data.chat import ChatEncoder

    encoder = ChatEncoder(tok)
    samples = {tuple(e.ids.tolist()): e.labels for e in encoder.encode([r["messages"] for r in rows])}
    real = capacity = 0
    for _ in range(15):
        batch = next(loader)
        for ids, labels, pos in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
            segs = segments(pos)
            content = [ids[a:b].tolist() for a, b in segs]
            # whole samples only, each at most once per row; the trailing run may be padding
            pad_tail = (
                content and set(content[-1]) == {tok.pad_token_id} and tuple(content[-1]) not in samples
            )
            body = segs[:-1] if pad_tail else segs
            assert len({tuple(c) for c in content}) == len(content)
            for a, b in body:
                key = tuple(ids[a:b].tolist())
                assert key in samples
                assert torch.equal(labels[a:b], torch.as_tensor(samples[key], dtype=torch.long))
            if pad_tail:
                a, b = segs[-1]
                assert (labels[a:b] == -100).all()
            real += sum(b - a for a, b in body)
            capacity += 512
    assert real / capacity >= 0.99
    naive = np.mean([min(len(k), 512) for k in samples]) / 512
    assert naive < 0.5  # pad-to-max would waste most of each row
    assert loader.stats["tokens"] == real and loader.stats["dropped"] == 0


def test_overlong_sft_samples_dropped_or_truncated_and_counted(tmp_path, tok):
    rows = chat_rows(20, turns=1)
    rows[3]["messages"][1]["content"] = "long " * 100
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    for policy in ("drop", "truncate"):
        opts = DataOptions(
            data=path,
            seq_len=128,
            overlong=policy,
            shuffle=False,
            num_workers=0,
            pack_buffer=25,
            data_streams=1,
        )
        loader = build_loader(opts, tok, 2)
        batch = next(loader)
        stats = loader.stats
        assert stats["dropped" if policy == "drop" else "truncated"] >= 1
        assert stats["truncated" if policy == "drop" else "dropped"] == 0
        # samples are never split across rows: each segment is a whole chat (or a truncated one filling a
        # whole row), or the padding run at the end
        newline = tok.convert_tokens_to_ids(tok.tokenize("\n"))[0]
        for ids, pos in zip(batch["input_ids"], batch["position_ids"]):
            for a, b in segments(pos):
                if ids[a] == tok.pad_token_id:
                    assert b == len(pos) and (ids[a:] == tok.pad_token_id).all()
                else:
                    assert ids[a] == tok.convert_tokens_to_ids("<|im_start|>")
                    assert ids[b - 1] == newline or (policy == "truncate" and b - a == 128)


def test_bos_option_and_special_token_strings_in_raw_text(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a</s>b"}, {"text": "cd"}])
    batch = next(
        build_loader(
            DataOptions(data=path, data_streams=1, seq_len=12, add_bos=True, shuffle=False, num_workers=0),
            tok,
            1,
        )
    )
    bos, eos = tok.bos_token_id, tok.eos_token_id
    ids = batch["input_ids"][0].tolist()
    # "</s>" inside raw text stays four characters; only the appended EOS is the EOS token
    assert ids == [bos] + tok.convert_tokens_to_ids(list("a</s>b")) + [eos, bos] + tok.convert_tokens_to_ids(
        list("cd")
    ) + [eos]
    assert batch["position_ids"][0].tolist() == list(range(8)) + list(range(4))
    assert batch["labels"][0, 0] == -100 and batch["labels"][0, 8] == -100 and batch["labels"][0, 7] == eos
