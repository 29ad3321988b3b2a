"""Routed experts as grouped GEMMs: equal to a per-expert loop (output and every gradient) in fp32 and bf16,
with idle experts, sizes grouped_mm cannot take (the exact fallback), the expert-parallel pieces, and no
host sync in a block: the whole model's forward + backward compiles with fullgraph=True."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dstrain.model.common.experts import Adapters, combine, group_by_expert, grouped_swiglu, routed_experts
from tests.helpers.tiny import CAPTURE_BACKEND, compile_backend, tiny_config


def reference(x, idx, weights, gate_up, down):
    """One expert at a time, plain autograd: sum_j w_j * down_e(silu(gate_e x) * up_e x)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    i = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        rows, slots = (idx == e).nonzero(as_tuple=True)
        if rows.numel():
            h = F.linear(x[rows], gate_up[e])
            y = F.linear(F.silu(h[:, :i]) * h[:, i:], down[e])
            out = out.index_add(0, rows, y.float() * weights[rows, slots].unsqueeze(-1))
    return out.to(x.dtype)


def _inputs(n=40, d=16, i=8, e=6, k=3, dtype=torch.float32, idle=(2,), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
    allowed = torch.tensor([j for j in range(e) if j not in idle])
    idx = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(n)])
    w = torch.rand(n, k, generator=g).requires_grad_()
    gate_up = (0.3 * torch.randn(e, 2 * i, d, generator=g)).to(dtype).requires_grad_()
    down = (0.3 * torch.randn(e, d, i, generator=g)).to(dtype).requires_grad_()
    return x, idx, w, gate_up, down


def _run(fn, inputs, dout):
    x, idx, w, gate_up, down = inputs
    leaves = [x, w, gate_up, down]
    out = fn(x, idx, w, gate_up, down)
    grads = torch.autograd.grad(out, leaves, dout)
    return out, grads


@pytest.mark.parametrize(
    ("dtype", "d", "i", "tol"),
    [
        (torch.float32, 16, 8, 1e-5),  # grouped_mm
        (torch.float32, 16, 6, 1e-5),  # I not a multiple of 4: the exact per-group fallback
        (torch.bfloat16, 16, 8, 3e-2),
    ],
)
@pytest.mark.parametrize("align", [1, 16])
def test_grouped_equals_the_per_expert_loop(dtype, d, i, tol, align, monkeypatch):
    """align 16: each expert's rows start at a multiple of 16 in a zero-padded buffer (what CPU bf16 runs
    with), checked here in every dtype."""
    import dstrain.model.common.experts as experts

    monkeypatch.setattr(experts, "group_alignment", lambda like: align)
    inputs = _inputs(d=d, i=i, dtype=dtype)
    dout = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    got, got_grads = _run(routed_experts, inputs, dout)
    want, want_grads = _run(reference, inputs, dout)
    assert got.dtype == dtype

    def rel(a, b):
        a, b = a.detach().float(), b.detach().float()
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))

    assert rel(got, want) <= tol
    for name, a, b in zip(("x", "weights", "gate_up", "down"), got_grads, want_grads):
        assert a.dtype == b.dtype and rel(a, b) <= tol, (name, rel(a, b))
    # the idle expert gets an exact zero gradient (and still one: ZeRO-3 waits for every parameter's)
    assert not got_grads[2][2].any() and not got_grads[3][2].any()


@pytest.mark.parametrize("align", [1, 16])
def test_expert_parallel_pieces_compose_to_the_same_layer(align, monkeypatch):
    """Rows sorted by expert through grouped_swiglu, back in slot order and combined: what an EP rank pair
    computes, equal to routed_experts (output and gradients)."""
    import dstrain.model.common.experts as experts

    monkeypatch.setattr(experts, "group_alignment", lambda like: align)
    inputs = _inputs()
    dout = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(2))

    def pieces(x, idx, w, gate_up, down):
        order, offs = group_by_expert(idx, gate_up.shape[0])
        ys = grouped_swiglu(x[order // idx.shape[1]], offs, gate_up, down)
        return combine(ys, order, w)

    got, got_grads = _run(pieces, inputs, dout)
    want, want_grads = _run(routed_experts, inputs, dout)
    assert torch.allclose(got, want, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        assert torch.allclose(a, b, atol=1e-5)


def _adapters(e=6, d=16, i=8, r=4, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    shapes = [(e, r, d), (e, i, r), (e, r, d), (e, i, r), (e, r, i), (e, d, r)]
    return Adapters(*((0.3 * torch.randn(s, generator=g)).to(dtype).requires_grad_() for s in shapes))


def _merged(gate_up, down, ad, scale):
    """The effective expert weights, by plain autograd from the adapters: what the grouped adapters equal."""
    i = gate_up.shape[1] // 2
    gate = gate_up[:, :i] + scale * ad.gate_B @ ad.gate_A
    up = gate_up[:, i:] + scale * ad.up_B @ ad.up_A
    return torch.cat([gate, up], dim=1), down + scale * ad.down_B @ ad.down_A


@pytest.mark.parametrize(
    ("dtype", "r", "tol"),
    [
        (torch.float32, 4, 1e-5),  # grouped_mm
        (torch.float32, 3, 1e-5),  # r not a multiple of 4: the exact per-group fallback
        (torch.float64, 4, 1e-6),  # the exact fallback; the combine sums in fp32
        (torch.bfloat16, 8, 3e-2),
    ],
)
@pytest.mark.parametrize("frozen", [True, False])
@pytest.mark.parametrize("align", [1, 16])
def test_expert_adapters_equal_merged_weights(dtype, r, tol, frozen, align, monkeypatch):
    """Per-expert LoRA run as grouped GEMMs beside the base ones: output and every gradient (the adapters',
    x's, the routing weights', and the base weights' when they train) equal the experts with merged weights
    W + s B A; frozen base weights get no gradient computed."""
    import dstrain.model.common.experts as experts

    monkeypatch.setattr(experts, "group_alignment", lambda like: align)
    x, idx, w, gate_up, down = _inputs(dtype=dtype)
    if frozen:
        gate_up.requires_grad_(False), down.requires_grad_(False)
    ad, scale = _adapters(r=r, dtype=dtype), 1.5
    dout = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    leaves = [x, w, *ad] + ([] if frozen else [gate_up, down])
    got = routed_experts(x, idx, w, gate_up, down, ad, scale)
    got_grads = torch.autograd.grad(got, leaves, dout)
    want = reference(x, idx, w, *_merged(gate_up, down, ad, scale))
    want_grads = torch.autograd.grad(want, leaves, dout)

    def rel(a, b):
        a, b = a.detach().double(), b.detach().double()
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))

    assert rel(got, want) <= tol
    names = ["x", "weights", *Adapters._fields, "gate_up", "down"]
    for name, a, b in zip(names, got_grads, want_grads):
        assert a.dtype == b.dtype and rel(a, b) <= tol, (name, rel(a, b))

    # expert parallel's pieces take the same adapters
    order, offs = group_by_expert(idx, gate_up.shape[0])
    ys = grouped_swiglu(x[order // idx.shape[1]], offs, gate_up, down, ad, scale)
    pieces = combine(ys, order, w)
    assert rel(pieces, got) <= tol
    for name, a, b in zip(names, torch.autograd.grad(pieces, leaves, dout), got_grads):
        assert rel(a, b) <= tol, (name, rel(a, b))


def test_group_offsets_are_computed_on_the_device_in_one_sort():
    idx = torch.tensor([[3, 0], [3, 1], [0, 3]])
    order, offs = group_by_expert(idx, 5)
    assert offs.dtype == torch.int32 and offs.tolist() == [2, 3, 3, 6, 6]
    assert idx.flatten()[order].tolist() == [0, 0, 1, 3, 3, 3]
    assert order.tolist() == [1, 4, 3, 0, 2, 5]  # stable: token order within an expert


@pytest.mark.parametrize("lora", [False, True])
def test_whole_model_compiles_fullgraph_no_host_sync(lora):
    """A host sync (.tolist(), .item()) or Python branch on data in any block breaks the graph, which
    fullgraph=True turns into an error: the whole model's forward, MoE and MTP included, and the backward
    AOTAutograd traces with it (a sync there fails the trace). With LoRA on the experts, the routers and
    the attention too, in one MoE block that holds each of them, compiled by Inductor: --compile's kernels for
    the model without adapters are tested block by block, as it compiles them, in tests/training/test_compile.py;
    here that model needs the capture alone."""
    from dstrain.model import build_model
    from dstrain.model.common.kernels import KERNEL_POLICY
    from dstrain.model.common.lora import apply_lora
    from tests.model.common.test_lora import randomize_adapters

    torch._dynamo.reset()
    torch.manual_seed(0)  # the token ids and LoRA's A: the same case whatever ran before in this process
    # On a GPU the experts' grouped GEMM runs without a host sync in bf16 only (fp32 takes the per-group
    # loop, which reads the offsets once per layer): under the CUDA policy the model is bf16
    gpu = KERNEL_POLICY == "cuda"
    one_moe_block = dict(num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0)
    cfg = tiny_config(**one_moe_block) if lora else tiny_config()
    model = build_model(cfg, seed=0, dtype=torch.bfloat16 if gpu else torch.float32)
    if lora:  # r: a grouped GEMM's inner size, a multiple of 16 bytes
        apply_lora(model, 8 if gpu else 4, 8.0, ["experts", "gate", "q_b_proj", "o_proj"])
        randomize_adapters(model)
    ids = torch.randint(0, 256, (2, 16))

    def step(forward):
        out = forward(ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), out.expert_load

    eager_loss, eager_load = step(model)
    eager_grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    backend = compile_backend() if lora else CAPTURE_BACKEND
    loss, load = step(torch.compile(model, fullgraph=True, backend=backend))
    rtol, atol = (2e-2, 2e-3) if gpu else (1e-4, 1e-6)
    assert torch.allclose(loss, eager_loss, rtol=rtol / 10)
    # bf16 rounds the router's input differently compiled: a token may land on its next expert
    assert (load - eager_load).abs().sum() <= (4 if gpu else 0)
    for p, g in zip([p for p in model.parameters() if p.requires_grad], eager_grads, strict=True):
        assert torch.allclose(p.grad.float(), g.float(), rtol=rtol, atol=atol)


def test_compiled_blocks_with_recomputed_moe_give_eager_gradients():
    """--compile with --activation_checkpointing mlp: the MoE sublayer recomputed inside a compiled block
    (torch 2.13 lost the router's gradient from the experts there when traced; it now runs eagerly). Captured
    (Dynamo, AOTAutograd and its partitioner, as Inductor gets them), not compiled: Inductor's kernels of this
    very setting (blocks compiled, the MoE recomputed) train like one eager process in tests/training/
    test_compile.py's PP2 and EP2 layouts, and the C++ compilation of this test's kernels cost 25 CPU-s."""
    from dstrain.model import build_model

    torch._dynamo.reset()
    cfg = tiny_config(first_k_dense_replace=0, num_nextn_predict_layers=0)
    eager, compiled = build_model(cfg, seed=0), build_model(cfg, seed=0)
    compiled.set_activation_checkpointing("mlp")
    compiled.compile_blocks(backend=CAPTURE_BACKEND)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    for model in (eager, compiled):
        model(ids, labels=ids).loss.backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), name
