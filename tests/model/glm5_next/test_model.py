"""The parts of GLM-5.3-Flash transformers does not run: MTP training, the k-pool indexer's KL rule (its
gradient against autograd), its selection's structure, the DSA stages; and the family's surface."""

from __future__ import annotations

import pytest
import torch

from dstrain.model import build_model, get_config
from dstrain.model.glm5_next import FAMILY
from dstrain.model.glm5_next.config import DSA, KDA
from dstrain.model.glm5_next.indexer import make_pools, select


def tiny(**changes):  # noqa: ANN003, ANN201
    return build_model(get_config("tiny-glm5-next").replace(vocab_size=96, **changes), seed=1)


def test_mtp_and_indexers_train() -> None:
    """One step's loss holds the MTP depth (its layer, its own indexer and router learn), the balance loss and
    the indexers' KL figures; every parameter gets a gradient, the indexers' from their KL only."""
    model = tiny().train()
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(0))
    out = model(ids, labels=ids)
    assert out.mtp_loss_sum.shape == (1,) and out.aux_loss is not None and out.expert_load.shape == (4, 8)
    kl, queries = out.indexer_stats[:2].tolist()
    assert kl > 0 and queries > 0
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum()]
    assert not missing, missing
    assert len(model.indexers()) == 2  # layer 1's and the MTP block's; layer 2 shares layer 1's
    model.zero_grad()
    model.set_sparse_attention("frozen")
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is None for i in model.indexers() for p in i.parameters())


@pytest.mark.parametrize("sparse", [False, True])
def test_indexer_kl_gradient_is_autograd_s(sparse: bool) -> None:
    """select's KL gradient with respect to q, the pool keys and w equals autograd's of the same KL written
    directly (float64), packed documents and padding included."""
    g = torch.Generator().manual_seed(3)
    b, t, h, d, heads, kpool = 2, 30, 3, 8, 2, 4
    pos = torch.cat([torch.arange(11), torch.arange(17), torch.full((2,), -1)]).expand(b, t)
    pools = make_pools(pos, b, t, kpool, torch.device("cpu"))
    npool = pools.token.shape[1]
    q = torch.randn(b, t, h, d, generator=g, dtype=torch.float64, requires_grad=True)
    pk = torch.randn(b, npool, d, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(b, t, h, generator=g, dtype=torch.float64, requires_grad=True)
    mq, mk = (torch.randn(b, t, heads, 6, generator=g, dtype=torch.float64) for _ in range(2))
    real = pos >= 0
    result = select(q, pk, w, pools, 8, (mq, mk, 0.4, sparse, None), real, grads=True)
    # the same KL by autograd: the selection fixed, the target recomputed from its definition
    index = (w.unsqueeze(-1) * (torch.einsum("bthd,bpd->bthp", q, pk) * d**-0.5).relu()).sum(2)
    at = torch.arange(t)
    visible = (pools.end[:, None, :] <= at[None, :, None]) & (
        pools.doc[:, None, :] == pools.query_doc[..., None]
    )
    chosen = torch.zeros_like(visible)
    owner = pools.owner
    for bi in range(b):
        for ti in range(t):
            for key in result.keys[bi, ti].tolist():
                if owner[bi, key] < npool and visible[bi, ti, owner[bi, key]]:
                    chosen[bi, ti, owner[bi, key]] = True
    support = chosen if sparse else visible
    token_ok = torch.cat([support, torch.zeros(b, t, 1, dtype=torch.bool)], -1).gather(
        -1, owner[:, None].expand(b, t, t)
    )
    probs = (torch.einsum("bthd,bshd->bhts", mq, mk) * 0.4).masked_fill(~token_ok[:, None], float("-inf"))
    probs = probs.softmax(-1).nan_to_num(0.0).sum(1)
    p = torch.zeros(b, t, npool + 1, dtype=torch.float64).scatter_add_(
        -1, owner[:, None].expand(b, t, t), probs
    )[..., :npool]
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-30)
    has = support.any(-1) & real
    logq = index.masked_fill(~support, float("-inf")).log_softmax(-1)
    terms = torch.where(support & has[..., None] & (p > 0), p * (p.clamp(min=1e-300).log() - logq), 0.0)
    kl = terms.sum()
    assert torch.allclose(result.stats[0], kl.detach(), rtol=1e-9)
    assert result.stats[1] == has.sum()
    kl.backward()
    for mine, want in zip(result.grads, (q.grad, pk.grad, w.grad), strict=True):
        assert torch.allclose(mine, want, rtol=1e-9, atol=1e-12)


def test_selection_is_pools_plus_tail() -> None:
    """Each query's keys: whole complete pools of its document ending at or before it, at most index_topk /
    kpool of them, plus its own incomplete pool's tokens; a query seeing no more than that attends every key."""
    pos = torch.cat([torch.arange(13), torch.arange(9)]).unsqueeze(0)
    pools = make_pools(pos, 1, 22, 4, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    q, pk, w = (
        torch.randn(1, 22, 2, 8, generator=g),
        torch.randn(1, pools.token.shape[1], 8, generator=g),
        torch.randn(1, 22, 2, generator=g),
    )
    keys = select(q, pk, w, pools, 8, None).keys[0]
    for t, p in enumerate(pos[0].tolist()):
        start = t - p  # the document's first token
        chosen = set(keys[t].tolist())
        tail = set(range(start + (p + 1) // 4 * 4, t + 1))
        whole = chosen - tail
        assert tail <= chosen and all(start <= k <= t for k in chosen)
        assert all((k - start) // 4 < (p + 1) // 4 for k in whole)  # complete pools only
        assert len(whole) == 4 * min(2, (p + 1) // 4)  # its best 2 pools, or every one it sees


def test_shared_selection_crosses_kda_layers() -> None:
    """A shared DSA layer after KDA layers attends with the previous full DSA layer's selection (transformers
    hands a selection only to the next layer)."""
    model = tiny(layer_types=[DSA, KDA, DSA, KDA], indexer_types=["full", "full", "shared", "full"])
    attn = model.layers[2].self_attn
    assert attn.indexer is None and attn.sparse.source == 0
    ids = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_lora_on_the_default_targets_merges_to_the_same_model() -> None:
    """LoRA on the family's default targets plus the routed experts, routers and MTP's eh_proj: with random
    adapters the model equals the merged one, and the adapters change it."""
    from dstrain.model.common.lora import apply_lora, lora_modules, merge_lora
    from tests.model.common.test_lora import randomize_adapters

    model = tiny().eval()
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        base = model(ids).logits
    names = apply_lora(model, 4, 8.0, [*FAMILY.lora_targets, "experts", "gate", "eh_proj"])
    assert {"layers.0.self_attn.q_proj", "layers.1.self_attn.q_b_proj", "mtp.0.eh_proj"} <= set(names)
    randomize_adapters(model)
    with torch.no_grad():
        adapted = model(ids).logits
        merge_lora(model)
        merged = model(ids).logits
    assert not lora_modules(model)
    assert (adapted - merged).abs().max() <= 1e-5 * merged.abs().max()
    assert (adapted - base).abs().max() > 1e-3


def test_family_surface() -> None:
    """Every layout and tool built (no refusal); activation checkpointing 'full' gives the same loss."""
    assert not FAMILY.unsupported
    model = tiny(num_nextn_predict_layers=0).train()
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(5))
    plain = model(ids, labels=ids).loss
    model.set_activation_checkpointing("full")
    assert torch.equal(model(ids, labels=ids).loss, plain)
    with pytest.raises(ValueError):
        model.set_activation_checkpointing("mhc")
