"""The head's chunked cross-entropy (gradients made in the forward, no logits kept) equals F.cross_entropy on
the full logits: loss, d input and d weight, across chunk boundaries, with masked rows, in fp32 and bf16, and
computes only the loss under no_grad."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import dstrain.model.common.kernels as kernels
import dstrain.model.common.loss as loss_mod
from dstrain.model.common.loss import Head
from tests.helpers.tiny import CAPTURE_BACKEND


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


def test_the_compiled_chunk_is_compiled_once_for_every_row_count():
    """--compile's loss chunks (compile_loss): the main head's rows, each MTP depth's and a last partial chunk
    differ in count; one compile serves them all (before: one for the first count, one more at the next)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    head = Head(8, 20, bias=False)
    head.compile_loss(backend=CAPTURE_BACKEND)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for rows in (12, 11, 7):
            h = torch.randn(rows, 8, generator=g, requires_grad=True)
            targets = torch.randint(0, 20, (rows,), generator=g)
            got = head(h, targets, torch.ones(rows, dtype=torch.bool))
            got.backward()
            want = F.cross_entropy(F.linear(h, head.weight), targets, reduction="sum")
            assert torch.allclose(got, want, rtol=1e-6)


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


class _Allocations(TorchDispatchMode):
    """Every tensor an op returns that shares no storage with its inputs (a fresh buffer): (shape, dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.fresh: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.fresh.append((tuple(t.shape), t.dtype))
        return out


@pytest.fixture
def cuda_policy(monkeypatch):
    monkeypatch.setattr(kernels, "KERNEL_POLICY", "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_path_accumulates_the_weight_gradient_in_one_fp32_buffer(cuda_policy, dtype, monkeypatch):
    """GPU kernels (the CUDA policy on the CPU): 4 chunks of rows, each chunk's weight gradient accumulated
    into one fp32 (vocab x hidden) buffer (no per-chunk temporary), the mask on rows; loss and gradients
    equal F.cross_entropy on the full fp32 logits within 1e-6 (fp32), bf16 within its rounding."""
    monkeypatch.setattr(loss_mod, "GPU_CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(loss_mod, "GPU_CHUNK_ROWS", 8)
    vocab, hidden, n = 96, 16, 29
    assert loss_mod.chunk_rows(vocab, True) == 8
    g = torch.Generator().manual_seed(1)
    head = Head(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g))
    head = head.to(dtype)
    h = torch.randn(n, hidden, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g)
    valid = torch.rand(n, generator=g) > 0.3

    with _Allocations() as rec:
        got = head(h, targets, valid)
        got.mul(1.3).backward()
    wide = [a for a in rec.fresh if a[0] == (vocab, hidden)]
    assert wide.count(((vocab, hidden), torch.float32)) == 1
    # besides it, only the weight's gradient itself in a bf16 head (the fp32 sum rounded once)
    assert len(wide) == (1 if dtype == torch.float32 else 2)

    got_h, got_w = h.grad.clone(), head.weight.grad.clone()
    h.grad, head.weight.grad = None, None
    hf, wf = h.detach().float().requires_grad_(), head.weight.detach().float().requires_grad_()
    want = (F.cross_entropy(F.linear(hf, wf), targets, reduction="none") * valid).sum()
    want.mul(1.3).backward()
    tol = 1e-6 if dtype == torch.float32 else 1e-2

    def rel(a, b):
        return float((a.detach().float() - b).abs().max() / b.abs().max())

    assert got.dtype == torch.float32 and rel(got, want.detach()) <= tol
    assert got_h.dtype == dtype and rel(got_h, hf.grad) <= tol
    assert got_w.dtype == dtype and rel(got_w, wf.grad) <= tol
    assert not got_h[~valid].any()


def test_per_row_head_loss_and_its_weighted_gradients_equal_cross_entropy(monkeypatch):
    """ce_rows (DPO's per-position losses): each row's cross-entropy, and gradients for unequal row weights,
    with the logits recomputed chunk by chunk in backward."""
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", 7 * 50)  # 7 rows a chunk: 3 chunks and a partial one
    monkeypatch.setattr(loss_mod, "CHUNK_ROWS", 1)
    g = torch.Generator().manual_seed(1)
    head = Head(16, 50, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(50, 16, generator=g))
    h = torch.randn(2, 12, 16, generator=g).requires_grad_()
    targets = torch.randint(0, 50, (2, 12), generator=g)
    valid = torch.rand(2, 12, generator=g) > 0.3
    weights = torch.randn(2, 12, generator=g)  # per-row upstream gradients, as a document's log-prob gets

    got = loss_mod.ce_rows(head, h, targets, valid)
    (got * weights).sum().backward()
    got_h, got_w = h.grad.clone(), head.weight.grad.clone()
    h.grad, head.weight.grad = None, None
    ce = F.cross_entropy(F.linear(h, head.weight).flatten(0, 1), targets.flatten(), reduction="none")
    want = ce.view(2, 12) * valid
    (want * weights).sum().backward()
    assert got.shape == (2, 12) and (got - want).abs().max() <= 1e-5
    assert (got_h - h.grad).abs().max() <= 1e-5 and (got_w - head.weight.grad).abs().max() <= 1e-5
