"""Dynamo's capture of dstrain's autograd Functions gives eager's gradients. torch 2.11's Dynamo gave none (zeros,
silently) to a Function's output that a call returning its own input produced (`+=`, `.add_()`, `.to()` or
`.float()` to the dtype it has): the loss head's, DeepSeek-V4's mHC and the routed experts' (their slot sum). The oldest end runs this with DSTRAIN_OLDEST=1 (launch/test.sh)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


def _head() -> tuple[Callable, list[torch.Tensor]]:
    from dstrain.model.common.loss import Head

    head = Head(8, 32, bias=False)
    targets, valid = torch.randint(0, 32, (6,)), torch.tensor([True, True, False, True, True, True])
    x = torch.randn(6, 8, requires_grad=True)
    return lambda x, w: head(x, targets, valid) * 2.0, [x, head.weight]


def _mhc_expand() -> tuple[Callable, list[torch.Tensor]]:
    from dstrain.model.common.mhc import expand

    shapes = [(2, 3, 4), (2, 3, 4, 4), (2, 3, 8), (2, 3, 4, 8)]  # post, comb, out, streams
    return lambda *a: (expand(*a) ** 2).sum(), [torch.randn(s, requires_grad=True) for s in shapes]


def _routed_experts() -> tuple[Callable, list[torch.Tensor]]:
    from dstrain.model.deepseek_v3.model import MoE
    from tests.helpers.tiny import tiny_config

    moe = MoE(tiny_config(hidden_size=16, moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 5, 16, requires_grad=True)
    return lambda x, w: (moe(x)[0] ** 2).sum(), [x, moe.experts.gate_up_proj]


@pytest.mark.parametrize("case", [_head, _mhc_expand, _routed_experts])
def test_compiled_function_gradients_equal_eager(case):
    torch._dynamo.reset()
    torch.manual_seed(0)
    fn, inputs = case()
    grads = []
    for run in (fn, torch.compile(fn, backend="eager", fullgraph=True)):
        for t in inputs:
            t.grad = None
        run(*inputs).backward()
        grads.append([t.grad.clone() for t in inputs])
    for eager, compiled in zip(*grads, strict=True):
        assert eager.abs().sum() > 0
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
