"""Preference pairs (DPO): TRL's formats, the completion-only targets, pairs kept in one row, the audit."""

import numpy as np
import pytest
import torch

from dstrain.batch import IGNORE_INDEX, document_index
from dstrain.cli import main as dstrain_main
from dstrain.data import DataOptions, build_loader
from dstrain.data.formats import Normalizer, Skip, normalize_pair
from dstrain.data.preference import PreferenceEncoder
from dstrain.data.sources import resolve_sources
from tests.helpers.data_files import write_jsonl
from tests.helpers.tiny import byte_tokenizer

PROMPT = [{"role": "user", "content": "Say hi"}]


def where() -> str:
    return "row 1"


def test_explicit_text_and_conversational_pairs_normalize_alike():
    text = normalize_pair({"prompt": "Say hi", "chosen": "hi", "rejected": "no"}, where)
    conv = normalize_pair(
        {
            "prompt": PROMPT,
            "chosen": [{"role": "assistant", "content": "hi"}],
            "rejected": [{"role": "assistant", "content": "no"}],
        },
        where,
    )
    assert (
        text
        == conv
        == {
            "prompt": PROMPT,
            "chosen": [{"role": "assistant", "content": "hi"}],
            "rejected": [{"role": "assistant", "content": "no"}],
        }
    )


def test_implicit_prompt_is_the_shared_prefix_and_its_replies_are_context():
    turns = [*PROMPT, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    pair = normalize_pair(
        {
            "chosen": [*turns, {"role": "assistant", "content": "hi"}],
            "rejected": [*turns, {"role": "assistant", "content": "no"}],
            "prompt": "Say hi",  # UltraFeedback's text prompt beside conversations: ignored (TRL's rule)
            "system": "Be kind.",
        },
        where,
    )
    assert [m["role"] for m in pair["prompt"]] == ["system", "user", "assistant", "user"]
    assert pair["prompt"][2]["weight"] == 0  # an earlier reply is context, never a target
    assert pair["chosen"] == [{"role": "assistant", "content": "hi"}]
    with pytest.raises(Skip, match="prompt"):
        normalize_pair({"chosen": "hi", "rejected": "no"}, where)


def test_completion_tokens_alone_are_targets():
    tok = byte_tokenizer()
    doc = normalize_pair({"prompt": "Say hi", "chosen": "hi", "rejected": "nope"}, where)
    (pair,) = PreferenceEncoder(tok).encode([doc], keep_text=True)
    for side, reply in ((pair.chosen, "hi"), (pair.rejected, "nope")):
        assert side.text.startswith("<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n")
        trained = tok.decode([int(i) for i, lab in zip(side.ids, side.labels) if lab != IGNORE_INDEX])
        assert trained == reply + "<|im_end|>"  # nothing of the prompt
        assert side.n_targets() == len(reply) + 1
    # the pair is one sample of both documents, chosen first
    assert [len(ids) for ids, _ in pair.pieces()] == [len(pair.chosen.ids), len(pair.rejected.ids)]
    cut = pair.truncated(40)  # each side keeps at least half the row: cut past their replies, no targets
    assert (len(cut.chosen.ids), len(cut.rejected.ids), cut.targets) == (20, 20, [])
    cut = pair.truncated(58)  # the longer side (rejected, 31 tokens) loses its end first
    assert (len(cut.chosen.ids), len(cut.rejected.ids), cut.rejected.n_targets()) == (29, 29, 4)


def test_detection_and_no_mixing_with_chats(tmp_path):
    pairs = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    chats = write_jsonl(
        tmp_path / "c.jsonl", [{"messages": [*PROMPT, {"role": "assistant", "content": "x"}]}]
    )
    assert resolve_sources(DataOptions(data=pairs))[0].fmt == "preference"
    with pytest.raises(Exception, match="cannot mix"):
        resolve_sources(DataOptions(data=f"{pairs},{chats}"))
    assert Normalizer("preference", DataOptions())(
        {"prompt": "a", "chosen": "b", "rejected": "c"}, where
    ) == [normalize_pair({"prompt": "a", "chosen": "b", "rejected": "c"}, where)]


def pair_rows(n: int) -> list[dict]:
    return [
        {"prompt": f"q{i}" + "?" * (i % 5), "chosen": f"good {i}" + "!" * (i % 3), "rejected": f"bad {i}"}
        for i in range(n)
    ]


def test_packed_rows_hold_whole_pairs_chosen_then_rejected(tmp_path):
    tok = byte_tokenizer()
    decode = tok.decode
    rows = pair_rows(40)
    opts = DataOptions(data=write_jsonl(tmp_path / "p.jsonl", rows), seq_len=160, shuffle=False)
    loader = build_loader(opts, tok, 3, seed=0)
    seen = 0
    for _ in range(4):
        batch = next(loader)
        docs = document_index(batch["labels"], batch["position_ids"])
        n = int(docs.max()) + 1
        assert n % 2 == 0
        for k in range(0, n, 2):
            rows_c = {int(r) for r in torch.nonzero(docs == k)[:, 0]}
            rows_r = {int(r) for r in torch.nonzero(docs == k + 1)[:, 0]}
            assert rows_c == rows_r and len(rows_c) == 1  # a pair in one row
            (row,) = rows_c

            def text(d: int, row: int = row, labels=batch["labels"], docs=docs) -> str:  # noqa: ANN001
                ids = labels[row][(docs[row] == d) & (labels[row] != IGNORE_INDEX)]
                return decode(ids.tolist(), skip_special_tokens=True)

            assert text(k).startswith("good ") and text(k + 1).startswith("bad ")
            assert text(k).split()[1].rstrip("!") == text(k + 1).split()[1]  # the same pair's two sides
            seen += 1
        # each document restarts its positions: no attention across documents
        pos = batch["position_ids"]
        assert int((pos == 0).sum()) >= n
    assert seen >= 12


def test_document_index_numbers_target_documents_only():
    labels = torch.tensor([[-100, 5, 6, -100, -100, 7, -100], [-100, -100, 8, -100, 9, -100, -100]])
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, -1], [0, 1, 2, 0, 1, -1, -1]])
    # row 0: docs [0..2] (targets), [3] (none), [4..5] (targets); row 1: [0..2], [3..4]
    expected = [[0, 0, 0, -1, 1, 1, -1], [2, 2, 2, 3, 3, -1, -1]]
    assert document_index(labels, pos).tolist() == expected
    assert np.array_equal(document_index(labels, None)[0].numpy(), np.zeros(7))


def test_audit_shows_a_pair(tmp_path, capsys):
    tok_dir = tmp_path / "tok"
    byte_tokenizer().save_pretrained(str(tok_dir))
    path = write_jsonl(tmp_path / "p.jsonl", pair_rows(3))
    code = dstrain_main(
        ["data", "audit", "--data", path, "--tokenizer", str(tok_dir), "--n", "1", "--color", "never"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "### chosen: " in out and "### rejected: " in out
    assert "<|im_start|>assistant\n[[good 0<|im_end|>]]" in out
    assert "<|im_start|>assistant\n[[bad 0<|im_end|>]]" in out
    assert "samples: 3\n" in out
