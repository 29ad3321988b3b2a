"""Exact resume: after load_state_dict the loader yields exactly the batches the uninterrupted run would."""

import json

import pytest
import torch

from dstrain.data import DataError, DataOptions, build_loader
from tests.conftest import byte_tokenizer
from tests.data.conftest import chat_rows, text_rows, write_jsonl, write_parquet


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def roundtrip(state: dict) -> dict:
    return json.loads(json.dumps(state))  # JSON-serialisable, nothing else


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def check_resume(opts, tok, mbs, n, points, dp_world=1, seed=0, exact_state=True):
    """Reference run of `n` batches per rank, saving the state before batch p for p in `points`; fresh
    loaders restored at each point (and restored twice: first point -> last point -> end) must match."""
    per_rank = []
    for rank in range(dp_world):

        def fresh(rank=rank):
            return build_loader(opts, tok, mbs, dp_rank=rank, dp_world=dp_world, seed=seed)

        ref_loader, ref, states = fresh(), [], {}
        for i in range(n):
            if i in points:
                states[i] = roundtrip(ref_loader.state_dict())
            ref.append(next(ref_loader))
        for p in points:
            loader = fresh()
            loader.load_state_dict(states[p])
            assert same([next(loader) for _ in range(n - p)], ref[p:]), f"rank {rank} resumed at {p}"
        p1, p2 = points[0], points[-1]
        first = fresh()
        first.load_state_dict(states[p1])
        got = [next(first) for _ in range(p2 - p1)]
        again = roundtrip(first.state_dict())
        if exact_state:
            assert again == states[p2]  # the state itself is reproduced exactly
        second = fresh()
        second.load_state_dict(again)
        got += [next(second) for _ in range(n - p2)]
        assert same(got, ref[p1:]), f"rank {rank} resumed twice"
        per_rank.append((ref, ref_loader))
        for loader in (first, second, ref_loader):
            loader.close()
    if dp_world > 1:
        assert not same(per_rank[0][0], per_rank[1][0])
    return per_rank


def test_pretraining_shuffled_resume_across_epochs(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", text_rows(20))
    opts = DataOptions(data=path, seq_len=48, shuffle_buffer=8, num_workers=0)
    [(ref, loader)] = check_resume(opts, tok, 2, 40, [0, 3, 17, 31])
    assert loader.epoch >= 2  # the resume points span several epoch boundaries
    state = loader.state_dict()
    assert len(json.dumps(state)) < 20_000


def test_two_ranks_with_weighted_mix(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", text_rows(30, prefix="a"))
    b = write_parquet(tmp_path / "b.parquet", text_rows(25, prefix="b"), row_group_size=7)
    opts = DataOptions(data=f"{a}:0.7,{b}:0.3", seq_len=40, shuffle_buffer=10, num_workers=0)
    check_resume(opts, tok, 2, 30, [2, 11, 23], dp_world=2, seed=7)


def test_sft_best_fit_resume_one_and_two_ranks(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", chat_rows(40, turns=2))
    opts = DataOptions(data=path, seq_len=256, pack_buffer=24, shuffle_buffer=6, num_workers=0)
    for world in (1, 2):
        check_resume(opts, tok, 2, 26, [1, 5, 14, 22], dp_world=world, seed=3)


def test_resume_with_dataloader_workers(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", text_rows(30))
    opts = DataOptions(data=path, seq_len=32, shuffle_buffer=5, num_workers=2)
    # 21 batches: past each worker's first snapshot (every 8 of its batches), resumed mid-snapshot too
    check_resume(opts, tok, 2, 24, [3, 21], exact_state=False)


def test_workers_0_and_1_give_the_same_batches(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", chat_rows(20))
    batches = []
    for workers in (0, 1):
        loader = build_loader(
            DataOptions(data=path, seq_len=128, pack_buffer=10, num_workers=workers), tok, 2
        )
        batches.append([next(loader) for _ in range(6)])
        loader.close()
    assert same(*batches)


def test_state_from_another_layout_is_rejected(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", text_rows(10))
    opts = DataOptions(data=path, seq_len=32, num_workers=0)
    loader = build_loader(opts, tok, 2, dp_rank=0, dp_world=2)
    next(loader)
    state = loader.state_dict()
    other = build_loader(opts, tok, 2, dp_rank=0, dp_world=1)
    with pytest.raises(DataError, match="dp_world=2"):
        other.load_state_dict(state)
    with pytest.raises(DataError, match="not a dstrain loader state"):
        other.load_state_dict({"epoch": 3})
