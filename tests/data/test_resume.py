"""Exact resume: after load_state_dict the loader yields exactly the batches the uninterrupted run would."""

import dataclasses
import json

import pytest
import torch

from dstrain.data import DataError, DataOptions, build_loader, merge_states
from tests.helpers.data_files import chat_rows, text_rows, write_jsonl, write_parquet
from tests.helpers.tiny import byte_tokenizer


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


def _global_rows(opts, tok, dp: int, n: int, states: list | None = None) -> tuple[list, list]:
    """`n` global rows as `dp` ranks of micro batch 1 read them (rank r has rows r, r + dp, ...), and the
    ranks' states after; `states`: resume every rank from these (another layout's ranks' states)."""
    loaders = [build_loader(opts, tok, 1, dp_rank=r, dp_world=dp, seed=4) for r in range(dp)]
    if states is not None:
        for ld in loaders:
            ld.load_state_dict(merge_states(states))
    rows = [next(loaders[g % dp]) for g in range(n)]
    out = [ld.state_dict() for ld in loaders]
    for ld in loaders:
        ld.close()
    return rows, out


def test_global_rows_do_not_depend_on_ranks_or_workers_and_resume_on_other_counts(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", text_rows(40))
    opts = DataOptions(data=path, seq_len=48, shuffle_buffer=5, num_workers=0)
    want, _ = _global_rows(opts, tok, 1, 48)  # one process: the global order
    assert same(_global_rows(opts, tok, 2, 48)[0], want)
    assert same(_global_rows(dataclasses.replace(opts, num_workers=2), tok, 4, 48)[0], want)
    # 2 ranks read 24 rows, then 1, 2 or 4 ranks (with workers) continue: the uninterrupted rows, none twice
    first, states = _global_rows(opts, tok, 2, 24)
    for dp, workers in ((1, 0), (4, 0), (2, 2)):
        rest, _ = _global_rows(dataclasses.replace(opts, num_workers=workers), tok, dp, 24, states)
        assert same(first + rest, want), (dp, workers)


def test_state_that_cannot_continue_is_rejected_in_one_line(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", text_rows(10))
    opts = DataOptions(data=path, seq_len=32, num_workers=0)
    _, states = _global_rows(opts, tok, 2, 2)
    other = build_loader(dataclasses.replace(opts, seq_len=64), tok, 2, seed=4)
    with pytest.raises(DataError, match="seq_len=32"):
        other.load_state_dict(merge_states(states))
    three = build_loader(opts, tok, 1, dp_rank=0, dp_world=3, seed=4)
    with pytest.raises(DataError, match="8 data streams cannot be shared by 3 data-parallel rank"):
        three.load_state_dict(merge_states(states))
    with pytest.raises(DataError, match=r"lacks stream\(s\) \[1, 3, 5, 7\]"):
        build_loader(opts, tok, 1, seed=4).load_state_dict(states[0])
    with pytest.raises(DataError, match="not a dstrain loader state"):
        other.load_state_dict({"epoch": 3})
    with pytest.raises(DataError, match="8 data streams cannot be shared by 3"):
        build_loader(dataclasses.replace(opts, data_streams=8), tok, 1, dp_rank=0, dp_world=3)
