"""The checkpoint store without a process group: RNG state as JSON, finding checkpoints (complete, newest,
corrupt, partial), pruning, and DeepSpeed files read with the weights-only unpickler."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from dstrain.checkpoint import store
from dstrain.errors import CheckpointError


def test_rng_state_roundtrips_through_json():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = json.loads(json.dumps(store.rng_state()))
    want = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    store.set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == want


def _fake_ckpt(root, step: int, saved_at: float, complete: bool = True):
    path = root / store.tag_for(step)
    (path / "dstrain_state").mkdir(parents=True)
    (path / "model.pt").write_bytes(b"x" * step)
    (path / "dstrain_state" / "rank_00000.json").write_text("{}")
    if complete:
        files = {"model.pt": step, "dstrain_state/rank_00000.json": 2}
        (path / store.MARKER).write_text(
            json.dumps({"step": step, "world_size": 1, "saved_at": saved_at, "files": files})
        )
    return path


def test_resume_resolution_and_errors(tmp_path):
    root = tmp_path / "checkpoints"
    assert store.resolve_resume("auto", str(tmp_path)) is None
    a = _fake_ckpt(root, 2, 1.0)
    b = _fake_ckpt(root, 4, 2.0)
    partial = _fake_ckpt(root, 6, 3.0, complete=False)
    assert store.resolve_resume("auto", str(tmp_path)) == b
    assert store.resolve_resume(str(tmp_path), str(tmp_path)) == b
    assert store.resolve_resume(str(a), str(tmp_path)) == a
    with pytest.raises(CheckpointError, match="incomplete"):
        store.resolve_resume(str(partial), str(tmp_path))
    with pytest.raises(CheckpointError, match="no such file"):
        store.resolve_resume(str(tmp_path / "nope"), str(tmp_path))
    (b / "model.pt").write_bytes(b"x")  # truncated after completion
    with pytest.raises(CheckpointError, match="model.pt has 1 bytes, expected 4"):
        store.resolve_resume(str(b), str(tmp_path))
    assert store.resolve_resume("auto", str(tmp_path)) == a  # the corrupt one is passed over
    (a / store.MARKER).write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt COMPLETE marker"):
        store.resolve_resume(str(a), str(tmp_path))
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        store.resolve_resume(str(tmp_path / "checkpoints" / ".."), str(tmp_path / "x"))


def test_newest_is_most_recently_completed_and_prune_keeps_it(tmp_path):
    root = tmp_path / "checkpoints"
    old_hi = _fake_ckpt(root, 8, 1.0)  # a later step of an abandoned run
    mid = _fake_ckpt(root, 2, 2.0)
    new = _fake_ckpt(root, 3, 3.0)
    partial = _fake_ckpt(root, 9, 4.0, complete=False)
    assert store.newest_complete(root) == new
    store._prune(root, keep_last=2, keep=new)
    assert not old_hi.exists() and mid.exists() and new.exists() and partial.exists()
    store._prune(root, keep_last=1, keep=new)
    assert not mid.exists() and new.exists()


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_deepspeed_checkpoints_load_weights_only(tmp_path):
    """Resume reads DeepSpeed's files with the weights-only unpickler: DeepSpeed's state classes load, a
    pickle that would run code is refused."""
    from types import SimpleNamespace

    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.zero.config import ZeroStageEnum

    engine = SimpleNamespace(checkpoint_engine=TorchCheckpointEngine())
    store.install_safe_loading(engine)
    assert type(engine.checkpoint_engine).__name__ == "SafeCheckpointEngine"
    good = {"zero_stage": ZeroStageEnum.weights, "t": torch.ones(2)}
    torch.save(good, tmp_path / "good.pt")
    loaded = engine.checkpoint_engine.load(str(tmp_path / "good.pt"))
    assert loaded["zero_stage"] == ZeroStageEnum.weights and torch.equal(loaded["t"], torch.ones(2))
    torch.save({"x": _Boom()}, tmp_path / "bad.pt")
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        engine.checkpoint_engine.load(str(tmp_path / "bad.pt"))
