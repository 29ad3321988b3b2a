"""DeepSeek-V4's CSA indexer: padding trains nothing, and its top-k breaks ties by DSA's rule."""

from __future__ import annotations

import pytest
import torch

from dstrain.batch import IGNORE_INDEX, PAD_POSITION
from dstrain.model import build_model, get_config

T, REAL = 32, (11, 9)  # row 1: two documents (11 and 9 tokens), then 12 padding positions


def _model():  # noqa: ANN202
    cfg = get_config("tiny-v4").replace(vocab_size=64, num_nextn_predict_layers=0)
    return build_model(cfg, seed=0, dtype=torch.float64).train()


def _indexer_grads(model, ids, pos, scale):  # noqa: ANN001, ANN202
    model.set_indexer_grad_scale(scale)
    labels = ids.masked_fill(pos == PAD_POSITION, IGNORE_INDEX) if pos is not None else ids
    out = model(ids, position_ids=pos, labels=labels)
    params = [p for ix in model.indexers() for p in ix.parameters()]
    return torch.autograd.grad(out.loss, params), out.indexer_stats


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_padding_queries_give_the_indexer_no_loss_and_no_gradient(stage: str) -> None:
    """A batch whose second row ends in padding (PAD_POSITION) gives the indexers the gradient and the KL
    figures of its rows run alone without the padding; the default scale is the mean over real queries. Within
    1e-6: V4 scores, attends and mixes in fp32 whatever the model's dtype, and the rows' shapes differ."""
    model = _model()
    model.set_sparse_attention(stage)
    ids = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(7))
    n = sum(REAL)
    row1 = torch.cat([torch.arange(REAL[0]), torch.arange(REAL[1])])
    pos = torch.stack([torch.arange(T), torch.cat([row1, torch.full((T - n,), PAD_POSITION)])])
    padded, stats = _indexer_grads(model, ids, pos, None)
    alone0, stats0 = _indexer_grads(model, ids[:1], None, 1.0)
    alone1, stats1 = _indexer_grads(model, ids[1:, :n], row1[None], 1.0)
    queries = T + n
    assert stats[1] == stats0[1] + stats1[1] <= queries * len(model.indexers())  # summed over CSA layers
    assert abs(stats[0] - stats0[0] - stats1[0]) <= 1e-6 * abs(stats[0])
    for got, a, b in zip(padded, alone0, alone1, strict=True):
        want = (a + b) / queries
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()


def _rule(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Each query's k best visible entries, written out: higher score first, the later entry on a tie."""
    chosen = torch.zeros_like(visible)
    for q in range(scores.shape[0]):
        for t in range(scores.shape[1]):
            ranked = sorted(
                (i for i in range(scores.shape[2]) if visible[q, t, i]),
                key=lambda i, q=q, t=t: (float(scores[q, t, i]), i),
                reverse=True,
            )
            chosen[q, t, ranked[:k]] = True
    return chosen


def test_indexer_top_k_breaks_ties_by_dsas_rule() -> None:
    """Scores with many ties (ReLU zeros with few indexer heads; here integers 0-2): the chosen entries are
    the DSA rule's (dsa.top_keys: the later entry wins), the same on every call."""
    indexer = _model().indexers()[0]
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (2, 12, 10), generator=g).float()
    visible = torch.rand(2, 12, 10, generator=g) < 0.8
    chosen = indexer.select(scores, visible)
    assert torch.equal(chosen, _rule(scores, visible, indexer.topk))
    assert torch.equal(chosen, indexer.select(scores.clone(), visible))
