"""The eval set: documents held out of the training sources by content (never trained on, on any rank or
after a restart), the same rows whatever the seed or rank count, --eval_data read whole, the token budget."""

import re

import pytest

from dstrain.data import DataOptions, build_eval_rows, build_loader
from dstrain.data.pipeline import held_out
from dstrain.errors import DataError
from tests.helpers.data_files import chat_rows, text_rows, write_jsonl
from tests.helpers.tiny import byte_tokenizer

N = 60


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _ids(tok, input_ids) -> set[str]:
    return {m for row in input_ids for m in re.findall(r"doc(\d+):", tok.decode(row.tolist()))}


def _trained_ids(opts, tok, rank: int, world: int, batches: int, state=None) -> tuple[set[str], dict]:
    loader = build_loader(opts, tok, 4, dp_rank=rank, dp_world=world, seed=3 + rank)
    if state is not None:
        loader.load_state_dict(state)
    seen = set()
    for _ in range(batches):
        seen |= _ids(tok, next(loader)["input_ids"])
    return seen, loader.state_dict()


def test_held_out_documents_never_reach_training_on_any_rank_or_after_a_restart(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", text_rows(N))
    opts = DataOptions(
        data=path, seq_len=128, packing=False, shuffle_buffer=8, num_workers=0, eval_split=0.25
    )
    want = {str(i) for i, r in enumerate(text_rows(N)) if held_out(r["text"], 0.25)}
    assert 5 <= len(want) <= 25  # the hash splits about a quarter off
    rows = build_eval_rows(opts, tok)
    assert _ids(tok, rows["input_ids"]) == want
    # the same rows whatever reads them: built again, and with other packing-irrelevant options
    again = build_eval_rows(DataOptions(**{**vars(opts), "shuffle_buffer": 100, "num_workers": 2}), tok)
    assert all(bool((rows[k] == again[k]).all()) for k in rows)
    # training: 1 and 2 ranks over more than two epochs, and a loader resumed from its state
    one, _ = _trained_ids(opts, tok, 0, 1, batches=35)
    two = [_trained_ids(opts, tok, r, 2, batches=18)[0] for r in range(2)]
    first, state = _trained_ids(opts, tok, 0, 1, batches=5)
    resumed, _ = _trained_ids(opts, tok, 0, 1, batches=30, state=state)
    everything = {str(i) for i in range(N)}
    for seen in (one, two[0] | two[1], first | resumed):
        assert seen == everything - want


def test_eval_data_is_read_whole_and_budgeted(tmp_path, tok):
    train = write_jsonl(tmp_path / "train.jsonl", text_rows(10))
    held = write_jsonl(tmp_path / "eval.jsonl", text_rows(12, prefix="doc"))
    extra = write_jsonl(tmp_path / "eval2.jsonl", text_rows(3, prefix="doc10"))
    opts = DataOptions(data=train, seq_len=64, eval_data=f"{held},{extra}", eval_tokens=0, num_workers=0)
    rows = build_eval_rows(opts, tok)
    assert _ids(tok, rows["input_ids"]) == {str(i) for i in range(12)} | {"100", "101", "102"}
    small = build_eval_rows(DataOptions(**{**vars(opts), "eval_tokens": 100}), tok)
    assert 2 <= small["input_ids"].shape[0] < rows["input_ids"].shape[0]
    assert build_eval_rows(DataOptions(data=train), tok) is None


def test_sft_eval_rows_keep_the_training_mask(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", chat_rows(40))
    rows = build_eval_rows(DataOptions(data=path, seq_len=256, eval_split=0.3, num_workers=0), tok)
    for ids, labels in zip(rows["input_ids"], rows["labels"]):
        trained = tok.decode(ids[labels != -100].tolist())
        assert "answer" in trained and "question" not in trained


def test_eval_options_are_checked(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", text_rows(4))
    with pytest.raises(DataError, match="not both"):
        DataOptions(data=path, eval_data=path, eval_split=0.1)
    with pytest.raises(DataError, match="eval_split must be a fraction"):
        DataOptions(data=path, eval_split=1.5)
    with pytest.raises(DataError, match="gives no row with a target"):
        build_eval_rows(DataOptions(data=path, eval_split=1e-9, num_workers=0), tok)
