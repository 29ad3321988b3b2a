"""The CPU attention kernel (blocks of query rows as GEMMs, attention.py) against SDPA in float64."""

import pytest
import torch
import torch.nn.functional as F

import dstrain.model.common.attention as attention_mod
from dstrain.model.common.attention import CPU_BLOCK_ROWS, AttentionLayout, attend, attention_layout
from dstrain.model.common.kernels import KERNEL_POLICY
from tests.helpers.tiny import CAPTURE_BACKEND, compile_backend


def _inputs(b, t, h, dqk, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, h, dqk, generator=g).to(dtype).requires_grad_() for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=g).to(dtype).requires_grad_()
    return q, k, v, torch.randn(b, t, h, dv, generator=g).to(dtype)


def _reference(q, k, v, dout, scale, mask):
    """Output and gradients in float64 through SDPA with a dense (B, 1, T, T) mask."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    ).transpose(1, 2)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _run(q, k, v, dout, scale, layout):
    out = attend(q, k, v, scale, layout)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()  # 0 where both are 0


def _packed(b, t, seed=1):
    """position_ids of rows holding several documents each (random lengths), and their dense mask."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.zeros(b, t, dtype=torch.long)
    for row in range(b):
        i = 0
        while i < t:
            n = int(torch.randint(1, t // 2 + 2, (1,), generator=g))
            pos[row, i : i + n] = torch.arange(min(n, t - i))
            i += n
    doc = (pos == 0).cumsum(1)
    mask = (doc[:, :, None] == doc[:, None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    return pos, mask.unsqueeze(1)


@pytest.mark.parametrize("t", [1, CPU_BLOCK_ROWS - 1, CPU_BLOCK_ROWS, 2 * CPU_BLOCK_ROWS + 5])
def test_causal_matches_float64_sdpa(t):
    q, k, v, dout = _inputs(2, t, 3, 12, 8, torch.float32)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    want = _reference(q, k, v, dout, 0.3, causal)
    got = _run(q, k, v, dout, 0.3, AttentionLayout(causal_only=True))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert _rel(a, b) < 1e-5, name


def test_packed_documents_match_float64_sdpa_with_a_dense_mask():
    b, t = 3, 2 * CPU_BLOCK_ROWS + 9
    pos, mask = _packed(b, t)
    layout = attention_layout(pos, b, t, torch.device("cpu"))
    assert layout.mask is None and layout.doc is not None  # nothing (T, T)-sized on the CPU
    q, k, v, dout = _inputs(b, t, 2, 12, 8, torch.float32)
    want = _reference(q, k, v, dout, 0.3, mask)
    got = _run(q, k, v, dout, 0.3, layout)
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert _rel(a, w) < 1e-5, name


def test_bf16_is_as_close_to_float64_as_torchs_flash_kernel():
    """P and d S are rounded to bf16 for four of the GEMMs, as FlashAttention-2 does: the error must stay
    that of a bf16 attention kernel (torch's CPU flash kernel on the same inputs, with v padded)."""
    t, dqk, dv = 2 * CPU_BLOCK_ROWS, 24, 16
    q, k, v, dout = _inputs(2, t, 4, dqk, dv, torch.bfloat16)
    want = _reference(q, k, v, dout, dqk**-0.5, torch.ones(t, t, dtype=torch.bool).tril())
    got = _run(q, k, v, dout, dqk**-0.5, AttentionLayout(causal_only=True))
    qf, kf, vf = (x.detach().clone().requires_grad_() for x in (q, k, v))
    flash = F.scaled_dot_product_attention(
        qf.transpose(1, 2), kf.transpose(1, 2), F.pad(vf, (0, dqk - dv)).transpose(1, 2), is_causal=True
    )[..., :dv].transpose(1, 2)
    flash.backward(dout)
    theirs = (flash.detach(), qf.grad, kf.grad, vf.grad)
    assert got[0].dtype == torch.bfloat16
    for name, a, f, w in zip(("out", "dq", "dk", "dv"), got, theirs, want):
        assert _rel(a, w) < max(2 * _rel(f, w), 1e-2), name


def test_compiles_whole_and_matches_eager():
    b, t = 2, CPU_BLOCK_ROWS + 7
    pos, _ = _packed(b, t, seed=3)
    for layout in (
        AttentionLayout(causal_only=True),
        attention_layout(pos, b, t, torch.device("cpu")),
    ):
        q, k, v, dout = _inputs(b, t, 2, 12, 8, torch.float32)
        want = _run(q, k, v, dout, 0.3, layout)
        q, k, v, _ = _inputs(b, t, 2, 12, 8, torch.float32)
        compiled = torch.compile(attend, fullgraph=True, backend=compile_backend())
        out = compiled(q, k, v, 0.3, layout)
        out.backward(dout)
        for name, a, w in zip(("out", "dq", "dk", "dv"), (out.detach(), q.grad, k.grad, v.grad), want):
            assert torch.allclose(a, w, rtol=1e-5, atol=1e-6), name


def test_compiles_whole_on_the_process_s_first_call_and_once(monkeypatch):
    """--compile traces attention on a run's first step, before anything said which kernel runs: the path is said
    in eager code only, so that trace is one graph (a log call broke it: the block's first compile for each path
    came out in pieces), and saying it later in eager code does not make the compiled one compile again."""
    monkeypatch.setattr(attention_mod, "_logged", set())
    torch._dynamo.reset()
    q, k, v, _ = _inputs(1, 8, 2, 12, 8, torch.float32)
    compiled = torch.compile(attend, fullgraph=True, backend=CAPTURE_BACKEND)
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = compiled(q, k, v, 0.3, AttentionLayout(causal_only=True))
        want = attend(q, k, v, 0.3, AttentionLayout(causal_only=True))  # eager: says the path
        assert attention_mod._logged
        assert torch.equal(compiled(q, k, v, 0.3, AttentionLayout(causal_only=True)), out)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(KERNEL_POLICY == "cuda", reason="the CPU kernel's property; the CUDA branch runs SDPA")
def test_compiled_graph_does_not_grow_with_the_sequence():
    """torch.compile calls the kernel as one op: the traced graph is the same size at any T (no loop over
    query blocks unrolled into it, whose compile time would grow with T)."""
    sizes = []
    for t in (CPU_BLOCK_ROWS, 10 * CPU_BLOCK_ROWS):
        graphs = []

        def backend(gm, example_inputs, graphs=graphs):
            graphs.append(gm)
            return gm

        torch._dynamo.reset()
        q, k, v, _ = _inputs(1, t, 2, 12, 8, torch.float32)
        torch.compile(attend, backend=backend, fullgraph=True)(
            q, k, v, 0.3, AttentionLayout(causal_only=True)
        )
        (gm,) = graphs
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert targets.count(torch.ops.dstrain.cpu_attention.default) == 1
        sizes.append(len(gm.graph.nodes))
    assert sizes[0] == sizes[1]


@pytest.mark.parametrize("union", ["gathered", "whole"])
def test_sparse_attention_matches_float64_sdpa_with_the_chosen_keys(union, monkeypatch):
    """Each query attends only to its chosen keys (and, packed, its own document): a block of rows runs
    against the union of its rows' choices gathered, or (scattered choices) against all its keys masked."""
    import dstrain.model.common.attention as attention
    from dstrain.model.common.dsa import top_keys

    monkeypatch.setattr(attention, "UNION_DENSE", 1.0 if union == "gathered" else 0.0)
    b, t, k = 2, 3 * CPU_BLOCK_ROWS + 7, 24
    q, kk, v, dout = _inputs(b, t, 3, 12, 8, torch.float32)
    pos, docs = _packed(b, t)
    g = torch.Generator().manual_seed(5)
    near = -(torch.arange(t)[:, None] - torch.arange(t)[None, :]).abs().float()  # mostly recent keys
    sel = top_keys((near + 3 * torch.rand(b, t, t, generator=g)).masked_fill(~docs[:, 0], float("-inf")), k)
    chosen = torch.zeros(b, t, t, dtype=torch.bool).scatter_(-1, sel, True)
    layout = attention_layout(pos, b, t, torch.device("cpu"))
    out = attend(q, kk, v, 0.3, layout, sel)
    out.backward(dout)
    want = _reference(q, kk, v, dout, 0.3, docs & chosen.unsqueeze(1))
    for name, a, w in zip(("out", "dq", "dk", "dv"), (out.detach(), q.grad, kk.grad, v.grad), want):
        assert _rel(a, w) <= 1e-5, name
