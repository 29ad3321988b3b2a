"""DSA's Triton kernels (dsa_kernels.py, index_kernels.py) under Triton's CPU interpreter, against the torch path they replace
(the CPU kernel and the oracle): sparse attention forward and backward, the indexer's scores, top-k's tie rule
and the KL's gradient, and a V3.2 model's step with the kernels selected (DSTRAIN_KERNEL_POLICY=cuda).
Triton's interpreter is chosen when Triton is imported (TRITON_INTERPRET=1), which the test session has done
long before (DeepSpeed imports it): the kernels' tests run in one child pytest of this file with the variable
set (`test_the_kernels_in_triton_s_interpreter`), and are skipped in the parent.
Bounds: fp32 forward 1e-5 and gradients 1e-4 relative (to the largest entry); bf16 inputs against the fp32
oracle within 2e-2 (bf16's own rounding of the inputs and outputs: 2^-8 each)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

import dstrain.model.common.kernels as kernels  # noqa: E402
from dstrain.model import DeepSeekLM, kernel_paths  # noqa: E402
from dstrain.model.common import dsa  # noqa: E402
from dstrain.model.common.attention import _cpu_attention  # noqa: E402
from dstrain.model.common.dsa import Target, index_pass, top_keys  # noqa: E402
from dstrain.model.sources import init_weights  # noqa: E402
from tests.helpers.tiny import ROOT, tiny_config  # noqa: E402

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def _squeezed_loop_bounds() -> None:
    """Triton 3.6's interpreter reads a runtime loop bound (`range(H)`) with int() of a one-element array, which
    numpy >= 2.4 refuses; Triton 3.9 squeezes it first, as this does for 3.6 (the interpreter only: compiled
    kernels take their bounds as integers, without numpy)."""
    from triton.runtime import interpreter

    install = interpreter._patch_lang_tensor
    if "squeeze" in inspect.getsource(install):
        return

    def patched(tensor, scope):  # noqa: ANN001, ANN202
        install(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


if INTERPRETER:
    _squeezed_loop_bounds()


@pytest.mark.skipif(INTERPRETER, reason="this is the interpreter's process")
def test_the_kernels_in_triton_s_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed, 1 skipped" in run.stdout, run.stdout[-2000:]  # skipped there: this test


@pytest.fixture
def triton_cpu(monkeypatch):
    """dsa_kernels' and index_kernels' functions, the CUDA branch of every kernel choice taken (the kernels run
    by the interpreter)."""
    if not INTERPRETER:
        pytest.skip("runs in test_the_kernels_in_triton_s_interpreter's child process")
    monkeypatch.setattr(kernels, "KERNEL_POLICY", "cuda")
    from types import SimpleNamespace

    from dstrain.model.common import dsa_kernels, index_kernels

    names = ("SparseAttention", "sparse_attend", "sparse_forward", "usable_keys")
    return SimpleNamespace(**{n: getattr(dsa_kernels, n) for n in names}, index_scores=index_kernels.index_scores,
                           index_score_grads=index_kernels.index_score_grads,
                           head_probs=index_kernels.head_probs)  # fmt: skip


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _docs(b: int, t: int, packed: bool) -> torch.Tensor | None:
    if not packed:
        return None
    cut = torch.tensor([t // 3, t // 2])[:b]
    return (torch.arange(t)[None, :] >= cut[:, None]).long()  # two documents per row, split differently


def _selection(b: int, t: int, topk: int, doc: torch.Tensor | None, seed: int) -> torch.Tensor:
    """What index_pass hands attend: each row's top keys among those it may see, padded with repeats."""
    scores = torch.randn(b, t, t, generator=torch.Generator().manual_seed(seed))
    return index_pass(
        scores.unsqueeze(2), torch.eye(t).expand(b, t, t), torch.ones(b, t, 1), topk, doc
    ).selection


def _oracle(q, k, v, scale, doc, sel):  # noqa: ANN001, ANN202
    """attend's CPU kernel on (B, T, H, d) tensors."""
    b, t, h, dv = v.shape
    rows = [x.transpose(1, 2).reshape(b * h, t, -1) for x in (q, k, v)]
    return _cpu_attention(*rows, scale, doc, sel)[0].view(b, h, t, dv).transpose(1, 2)


# (B, T, top-k, heads, packed documents, key shared by the heads): top-k above the first rows' visible keys
# everywhere (causal edges: those rows' selections are padded with repeats), and above a document's length;
# T past one 16-key block. The interpreter runs a program per (query, head block) at ~1 ms an op: the shapes
# stay this small (each case 2-4 s of the suite, run twice: the newest and the oldest Triton).
SPARSE = [(1, 16, 4, 1, False, False), (2, 20, 7, 3, True, False), (1, 33, 20, 4, True, True)]


@pytest.mark.parametrize("b, t, topk, heads, packed, shared", SPARSE)
def test_sparse_attention_forward_and_backward_equal_the_torch_path(
    triton_cpu, b, t, topk, heads, packed, shared
):
    g = torch.Generator().manual_seed(t)
    dqk, dv, scale = 24, 12, 0.3
    doc = _docs(b, t, packed)
    sel = _selection(b, t, topk, doc, seed=t)
    q = torch.randn(b, t, heads, dqk, generator=g)
    k = torch.randn(b, t, 1 if shared else heads, dqk, generator=g)
    v = torch.randn(b, t, heads, dv, generator=g)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    key = leaves[1].expand(-1, -1, heads, -1)  # MLA's shared rotary key: a stride-0 head dim
    out = triton_cpu.sparse_attend(leaves[0], key, leaves[2], scale, sel, doc)
    want = _oracle(leaves[0], key, leaves[2], scale, doc, sel)
    assert _rel(out, want) <= 1e-5
    probe = torch.randn(out.shape, generator=g)
    got_grads = torch.autograd.grad((out * probe).sum(), leaves)
    want_grads = torch.autograd.grad((want * probe).sum(), leaves)
    for name, a, r in zip("qkv", got_grads, want_grads):
        assert _rel(a, r) <= 1e-4, name
    bf = [x.bfloat16().requires_grad_() for x in (q, k, v)]
    low = triton_cpu.sparse_attend(bf[0], bf[1].expand(-1, -1, heads, -1), bf[2], scale, sel, doc)
    assert low.dtype == torch.bfloat16 and _rel(low, want) <= 2e-2
    for name, a, r in zip("qkv", torch.autograd.grad((low * probe).sum(), bf), want_grads):
        assert _rel(a, r) <= 2e-2, name


def test_a_repeated_key_counts_once_and_the_target_is_the_head_summed_probabilities(triton_cpu):
    """Repeats anywhere in a row (GLM-5's shared layers attend an earlier layer's selection as it is) count
    once; the forward's optional target is every head's probability of each chosen key, summed."""
    g = torch.Generator().manual_seed(3)
    b, t, heads, d = 1, 12, 2, 16
    q, k, v = (torch.randn(b, t, heads, d, generator=g) for _ in range(3))
    sel = _selection(b, t, 5, None, seed=4)
    shuffled = torch.cat([sel, sel[..., :2]], dim=-1)[..., torch.randperm(7, generator=g)]
    keys = triton_cpu.usable_keys(shuffled, None)
    out, lse, psum = triton_cpu.sparse_forward(q, k, v, keys, 0.25, target=True)
    assert _rel(out, _oracle(q, k, v, 0.25, None, sel)) <= 1e-5
    chosen = torch.zeros(b, t, t, dtype=torch.bool).scatter_(-1, sel, True)
    chosen &= torch.ones(t, t, dtype=torch.bool).tril()
    scores = torch.einsum("bthd,buhd->bhtu", q, k).mul(0.25).masked_fill(~chosen.unsqueeze(1), float("-inf"))
    want = scores.softmax(-1).sum(1).gather(-1, keys.long().clamp(min=0))
    assert _rel(psum, want.masked_fill(keys < 0, 0.0)) <= 1e-5
    assert torch.allclose(lse, scores.logsumexp(-1).transpose(1, 2), atol=1e-5)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_index_scores_and_their_gradient_equal_the_torch_path(triton_cpu, packed):
    g = torch.Generator().manual_seed(5)
    b, t, heads, d = 2, 37, 3, 20
    q, w = torch.randn(b, t, heads, d, generator=g), torch.randn(b, t, heads, generator=g)
    k = torch.randn(b, t, d, generator=g)
    doc, scale = _docs(b, t, packed), d**-0.5
    for s, e in ((0, 17), (17, 37)):  # index_pass's blocks of query rows: the first rows and a later block
        got = triton_cpu.index_scores(q, k, w, s, e, doc, scale)
        act = torch.einsum("bchd,bud->bchu", q[:, s:e], k[:, :e]).mul(scale).relu()
        valid = dsa._valid(s, e, doc, b, q.device).expand(b, e - s, e)
        want = torch.einsum("bch,bchu->bcu", w[:, s:e], act).masked_fill(~valid, float("-inf"))
        assert torch.equal(got.isinf(), want.isinf()) and _rel(got[valid], want[valid]) <= 1e-5
        cols = torch.arange(0, e, 3)  # a gathered subset of keys, as the sparse stage's blocks use
        d_index = torch.randn(b, e - s, cols.numel(), generator=g) * valid[..., cols]
        dk = torch.zeros(b, t, d)
        dq, dw = triton_cpu.index_score_grads(q, k, w, s, e, cols, d_index, scale, dk)
        leaves = [x.clone().requires_grad_() for x in (q, k, w)]
        a = torch.einsum("bchd,bud->bchu", leaves[0][:, s:e], leaves[1][:, cols]).mul(scale).relu()
        scores = torch.einsum("bch,bchu->bcu", leaves[2][:, s:e], a)
        want_q, want_k, want_w = torch.autograd.grad((scores * d_index).sum(), leaves)
        assert (
            _rel(dq, want_q[:, s:e]) <= 1e-5 and _rel(dk, want_k) <= 1e-5 and _rel(dw, want_w[:, s:e]) <= 1e-5
        )


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_the_dense_target_s_head_summed_probabilities_equal_the_torch_path(triton_cpu, packed):
    """index_kernels.head_probs (the dense stage's KL target: each head's softmax over the keys a row may see,
    summed over the heads) against dsa._target_block's torch path: blocks of rows at the start and later,
    tiles cut mid-row, a head dim padded to the next power of two, MLA's key expanded over heads. fp32 only:
    the interpreter's tl.dot of bf16 tiles is wrong (Triton 3.9: off by ~1e10 on a 16 x 16 product), so bf16
    is a GPU's check (launch/bench_gpu.sh)."""
    g = torch.Generator().manual_seed(11)
    b, t, heads, d = 2, 37, 3, 24
    q = torch.randn(b, t, heads, d, generator=g)
    k = torch.randn(b, t, 1, d, generator=g).expand(-1, -1, heads, -1)
    doc = _docs(b, t, packed)
    for s, e in ((0, 17), (17, 37)):
        valid = dsa._valid(s, e, doc, b, q.device).expand(b, e - s, e)
        target = Target(q, k, 0.3, False)
        want = dsa._target_block(target, s, e, valid, slice(0, e))
        got = triton_cpu.head_probs(q, k, s, e, doc, 0.3)
        assert torch.equal(got > 0, valid) and _rel(got / got.sum(-1, keepdim=True), want) <= 1e-5
        assert torch.allclose(got.sum(-1), torch.full((b, e - s), float(heads)), atol=1e-5)


def test_top_k_over_the_kernels_scores_keeps_the_tie_rule(triton_cpu):
    """Integer-valued inputs: every score exact in both paths, with many ties (zeros from the ReLU among them):
    the same keys, the later of equal scores winning (torch.topk over dsa._ordered's keys, exact)."""
    g = torch.Generator().manual_seed(6)
    b, t, heads, d = 2, 30, 1, 16
    q = torch.randint(-2, 3, (b, t, heads, d), generator=g).float()
    k = torch.randint(-2, 3, (b, t, d), generator=g).float()
    w = torch.ones(b, t, heads)
    doc = _docs(b, t, True)
    got = index_pass(q, k, w, 6, doc).selection
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "KERNEL_POLICY", "auto")
        want = index_pass(q, k, w, 6, doc).selection
    assert torch.equal(got, want)
    index = triton_cpu.index_scores(q, k, w, 0, t, doc, d**-0.5)
    assert torch.equal(top_keys(index, 6), got)
    assert (index == 0).sum() > t  # ties were there to break


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_index_pass_kl_and_gradient_with_the_kernels_equal_the_torch_path(triton_cpu, monkeypatch, sparse):
    """The whole pass, blocks of 8 query rows (24 for the dense stage's kernel target): the selection, the KL
    (from the kernels' scores and, dense, target) against torch's, the recall and the indexer's gradient;
    packed documents and a padded tail."""
    g = torch.Generator().manual_seed(7)
    b, t, heads, d = 2, 29, 2, 16
    q, w = torch.randn(b, t, heads, d, generator=g), torch.randn(b, t, heads, generator=g)
    k = torch.randn(b, t, d, generator=g)
    qm, km = (torch.randn(b, t, 3, 12, generator=g) for _ in range(2))
    doc = _docs(b, t, True)
    real = torch.ones(b, t, dtype=torch.bool)
    real[1, -4:] = False
    monkeypatch.setattr(dsa, "SCORE_ELEMENTS", b * 3 * t * 8)
    from dstrain.model.common import index_kernels

    calls, head_probs = [], index_kernels.head_probs
    monkeypatch.setattr(index_kernels, "head_probs", lambda *a: calls.append(1) or head_probs(*a))
    results = []
    for policy in ("cuda", "auto"):
        monkeypatch.setattr(kernels, "KERNEL_POLICY", policy)
        results.append(index_pass(q, k, w, 5, doc, Target(qm, km, 0.3, sparse, real=real), grads=True))
    fast, ref = results
    assert bool(calls) == (not sparse)  # the dense stage's target from the kernel (the sparse one: torch's)
    # the same keys (the dense stage's kernel blocks are 24 rows, torch's 8: the padding of rows with fewer
    # visible keys than top-k differs among the keys they cannot see)
    usable = [triton_cpu.usable_keys(x.selection, doc).sort(dim=-1).values for x in results]
    assert torch.equal(*usable)
    assert fast.stats[1] == ref.stats[1] and fast.stats[3] == ref.stats[3]
    assert abs(fast.stats[0] - ref.stats[0]) <= 1e-5 * ref.stats[0]
    assert abs(fast.stats[2] - ref.stats[2]) <= 1e-5 * max(ref.stats[2], 1.0)
    for name, a, r in zip("qkw", fast.grads, ref.grads):
        assert _rel(a, r) <= 1e-4, name


@pytest.mark.parametrize("heads_split", [False, True], ids=["one_rank", "heads_over_two_ranks"])
def test_the_sparse_kl_from_the_attention_s_own_pass_equals_index_pass_s(
    triton_cpu, monkeypatch, heads_split
):
    """The sparse stage with the kernels: the attention forward's head-summed probabilities as the KL's
    target (dsa.sparse_kl) against index_pass recomputing it (the torch path): KL, counts and the indexer's
    gradient; packed documents, a padded tail, top-k above the first rows' visible keys (repeats), blocks of
    8 rows; heads split as tensor parallelism splits them (the target summed over both halves)."""
    g = torch.Generator().manual_seed(9)
    b, t, heads, d, mh, topk = 2, 29, 2, 16, 4, 6
    q, w = torch.randn(b, t, heads, d, generator=g), torch.randn(b, t, heads, generator=g)
    k = torch.randn(b, t, d, generator=g)
    qm, km, vm = (torch.randn(b, t, mh, 12, generator=g) for _ in range(3))
    doc = _docs(b, t, True)
    real = torch.ones(b, t, dtype=torch.bool)
    real[1, -4:] = False
    monkeypatch.setattr(dsa, "SCORE_ELEMENTS", b * mh * t * 8)
    first = index_pass(q, k, w, topk, doc, scores=True)
    parts = [slice(0, 2), slice(2, mh)] if heads_split else [slice(0, mh)]
    targets = []
    for h in parts:
        out, p, keys = triton_cpu.sparse_attend(qm[:, :, h], km[:, :, h], vm[:, :, h], 0.3, first.selection,
                                                 doc, target=True)  # fmt: skip
        assert _rel(out, _oracle(qm[:, :, h], km[:, :, h], vm[:, :, h], 0.3, doc, first.selection)) <= 1e-5
        targets.append(p)
    fast = dsa.sparse_kl(q, k, w, first, keys, sum(targets), real, grads=True)
    monkeypatch.setattr(kernels, "KERNEL_POLICY", "auto")
    ref = index_pass(q, k, w, topk, doc, Target(qm, km, 0.3, True, real=real), grads=True)
    # the same keys (the first rows' padding may differ among keys they cannot see: blocks of other sizes)
    same = triton_cpu.usable_keys(ref.selection, doc).sort(dim=-1).values
    assert torch.equal(keys.sort(dim=-1).values, same)
    assert fast.stats[1] == ref.stats[1] == b * t - 4 and fast.stats[3] == ref.stats[3] == 0
    assert abs(fast.stats[0] - ref.stats[0]) <= 1e-5 * ref.stats[0]
    for name, a, r in zip("qkw", fast.grads, ref.grads):
        assert _rel(a, r) <= 1e-4, name
    assert dsa.sparse_kl(q, k, w, first, keys, sum(targets), real, grads=False).grads is None


def test_v32_step_with_the_kernels_equals_the_default_path(triton_cpu, monkeypatch):
    """A tiny V3.2 (packed rows, sparse stage): loss, indexer figures and every gradient under the CUDA
    policy (Triton indexer, top-k, sparse attention) against the default CPU path."""
    cfg = tiny_config(model_type="deepseek_v32", index_topk=5, index_n_heads=2, index_head_dim=16,
                      num_nextn_predict_layers=0)  # fmt: skip
    model = DeepSeekLM(cfg)
    init_weights(model, 0)
    model.train().set_sparse_attention("sparse")
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(8))
    pos = torch.cat([torch.arange(15), torch.arange(9)]).expand(2, -1)
    calls, same_pass = [], []
    real = triton_cpu.SparseAttention.apply
    monkeypatch.setattr(triton_cpu.SparseAttention, "apply", lambda *a: calls.append(1) or real(*a))
    kl = dsa.sparse_kl
    monkeypatch.setattr(dsa, "sparse_kl", lambda *a: same_pass.append(1) or kl(*a))
    runs = []
    for policy in ("cuda", "auto"):
        monkeypatch.setattr(kernels, "KERNEL_POLICY", policy)
        model.zero_grad(set_to_none=True)
        out = model(ids, position_ids=pos, labels=ids)
        out.loss.backward()
        runs.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (fast, fast_grads), (ref, ref_grads) = runs
    assert calls, "the sparse kernel ran"
    assert same_pass, "the indexer's KL took its target from the kernel's pass"
    assert _rel(fast.loss, ref.loss) <= 1e-5
    assert _rel(fast.indexer_stats, ref.indexer_stats) <= 1e-5
    assert fast_grads.keys() == ref_grads.keys() and any(".indexer." in n for n in ref_grads)
    for name, a in fast_grads.items():
        assert _rel(a, ref_grads[name]) <= 1e-4, name


def test_the_kernel_line_names_the_sparse_attention_kernels(triton_cpu, monkeypatch):
    cfg = tiny_config(model_type="deepseek_v32", index_topk=5, index_n_heads=2, index_head_dim=16)
    cpu = torch.device("cpu")
    for dtype in (torch.bfloat16, torch.float32):
        assert kernel_paths(cfg, cpu, dtype)["sparse attention"].startswith("triton indexer, torch top-k")
    assert "sparse attention" not in kernel_paths(tiny_config(), cpu, torch.float32)
    monkeypatch.setattr(kernels, "KERNEL_POLICY", "auto")
    assert "dstrain's CPU kernel" in kernel_paths(cfg, cpu, torch.float32)["sparse attention"]
