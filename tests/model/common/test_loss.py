"""The head's chunked cross-entropy (gradients made in the forward, no logits kept) equals F.cross_entropy on
the full logits: loss, d input and d weight, across chunk boundaries, with masked rows, in fp32 and bf16, and
computes only the loss under no_grad."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dstrain.model.common.loss as loss_mod
from dstrain.model.common.loss import Head


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_chunked_head_loss_equals_cross_entropy(dtype, tol, monkeypatch):
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", 7 * 50)  # 7 rows a chunk: 3 chunks and a partial one
    monkeypatch.setattr(loss_mod, "CHUNK_ROWS", 1)
    g = torch.Generator().manual_seed(0)
    head = Head(16, 50, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(50, 16, generator=g))
    h = torch.randn(23, 16, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, 50, (23,), generator=g)
    valid = torch.rand(23, generator=g) > 0.3

    got = head(h, targets, valid)
    got.mul(1.7).backward()  # a scale on the loss reaches both gradients
    got_h, got_w = h.grad.clone(), head.weight.grad.clone()
    h.grad, head.weight.grad = None, None

    ce = F.cross_entropy(F.linear(h, head.weight).float(), targets, reduction="none")
    want = (ce * valid).sum()
    want.mul(1.7).backward()

    def rel(a, b):
        a, b = a.detach().float(), b.detach().float()
        return float((a - b).abs().max() / b.abs().max())

    assert got.dtype == torch.float32 and rel(got, want) <= tol
    assert got_h.dtype == dtype and rel(got_h, h.grad) <= tol
    assert got_w.dtype == dtype and rel(got_w, head.weight.grad) <= tol
    assert not got_h[~valid].any()  # masked rows get no gradient


def test_no_grad_computes_the_loss_only():
    head = Head(8, 20, bias=False)
    h = torch.randn(5, 8)
    targets = torch.randint(0, 20, (5,))
    valid = torch.ones(5, dtype=torch.bool)
    with torch.no_grad():
        got = head(h, targets, valid)
    assert got.grad_fn is None
    assert torch.allclose(got, F.cross_entropy(head(h), targets, reduction="sum"), rtol=1e-6)


def test_eval_hits_count_top1_matches_like_full_logits(monkeypatch):
    """Evaluation's MTP draft acceptance: the chunked head's top-1 hits (chunk boundary crossed) equal the
    argmax of the full logits over valid rows, and the model reports them for MTP depth 1 in eval mode only,
    the same through a plain (LoRA-style) head."""
    from dstrain.model import build_model
    from tests.helpers.tiny import tiny_config

    monkeypatch.setattr(loss_mod, "CHUNK_ROWS", 4)
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", 1)
    head = Head(8, 20, bias=False)
    h, targets = torch.randn(11, 8), torch.randint(0, 20, (11,))
    targets[:6] = head(h)[:6].argmax(-1)  # some sure hits
    valid = torch.rand(11) > 0.3
    loss, hits = head(h, targets, valid, hits=True)
    assert int(hits) == int(((head(h).argmax(-1) == targets) & valid).sum())
    assert torch.allclose(loss, head(h, targets, valid).detach())

    model = build_model(tiny_config(), seed=0)
    ids = torch.randint(0, 256, (2, 16))
    labels = ids.clone()
    assert model(ids, labels=labels).mtp_hits is None  # training mode: not computed
    model.eval()
    with torch.no_grad():
        out = model(ids, labels=labels)
        plain = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False)
        plain.weight = model.lm_head.weight
        model.lm_head = plain
        again = model(ids, labels=labels)
    assert out.mtp_hits is not None and 0 <= int(out.mtp_hits) <= int(out.mtp_tokens[0])
    assert int(again.mtp_hits) == int(out.mtp_hits)
