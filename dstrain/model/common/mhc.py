"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4; GLM-5.3-Flash's too): the residual is `hc_mult`
streams.

Each sublayer reads one collapsed input (a weighted sum of the streams, the `pre` weights) and writes back
`post * output + comb^T @ streams`, where `comb` (n x n per token) is pushed towards a doubly stochastic matrix
by Sinkhorn-Knopp iterations. All weights are computed in fp32 from the streams themselves, from the mHC
parameters upcast (they reach the forward in bf16 under DeepSpeed's bf16 engine), and the streams are
collapsed and mixed in fp32. A final head collapses the streams before the model's norm (V4's `HyperHead`;
GLM-5.3-Flash's is an unweighted mean, in its model.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """(..., n, n) fp32 -> softmax over the last axis, then alternating column and row normalisations ending
    with a column one (DeepSeek's order: a column first, then iters - 1 (row, column) pairs; eps inside each
    denominator). Columns sum to 1 - O(eps) always; rows converge at the scales training keeps."""
    comb = logits.softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """The mHC of one sublayer: fn ((2 + n) n, n D), base ((2 + n) n,), scale (3,) for pre, post, comb."""

    def __init__(self, hidden_size: int, hc_mult: int, iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        n = hc_mult
        self.n, self.iters, self.hc_eps, self.norm_eps = n, iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden_size))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams (B, T, n, D) -> fp32 pre (B, T, n), post (B, T, n), comb (B, T, n, n)."""
        n = self.n
        flat = unweighted_rms(streams.flatten(2).float(), self.norm_eps)
        mix = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        base = self.base.float()
        pre_b, post_b, comb_b = base.split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = sinkhorn(comb_w.unflatten(-1, (n, n)) * s_comb + comb_b.view(n, n), self.iters, self.hc_eps)
        return pre, post, comb

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> post, comb (fp32) and the sublayer's input: the streams collapsed by `pre` (B, T, D)."""
        pre, post, comb = self.weights(streams)
        return post, comb, collapse(pre, streams)


def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """sum_j pre_j * stream_j, the product in fp32, in the streams' dtype."""
    return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)


def expand(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The streams after a sublayer: stream_k = post_k * out + sum_j comb[j, k] * stream_j, mixed in fp32 and
    returned in the streams' dtype (DeepSeek's hc_post; transformers casts the weights to bf16 first, which
    rounds post and comb to 8 bits before they act)."""
    return _Expand.apply(post, comb, out, streams)


class _Expand(torch.autograd.Function):
    """`expand` keeping for backward only its inputs as they came (bf16 streams, not an fp32 copy of them per
    sublayer), upcast again there."""

    @staticmethod
    def forward(ctx, post, comb, out, streams):  # noqa: ANN001, ANN205
        ctx.save_for_backward(post, comb, out, streams)
        work = torch.promote_types(streams.dtype, torch.float32)
        mixed = post.to(work).unsqueeze(-1) * out.to(work).unsqueeze(-2)
        carried = torch.matmul(comb.to(work).transpose(-1, -2), streams.to(work))
        # fp32: not add_ (nor .to()) last: torch 2.11's Dynamo gives a Function's output made by a call returning
        # its own input no gradient (all 0 compiled)
        if work == streams.dtype:
            return mixed + carried
        return mixed.add_(carried).to(streams.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        post, comb, out, streams = ctx.saved_tensors
        work = torch.promote_types(streams.dtype, torch.float32)
        g = grad.to(work)
        d_post = (g * out.to(work).unsqueeze(-2)).sum(-1).to(post.dtype)
        d_out = (g * post.to(work).unsqueeze(-1)).sum(-2).to(out.dtype)
        d_comb = torch.matmul(streams.to(work), g.transpose(-1, -2)).to(comb.dtype)
        d_streams = torch.matmul(comb.to(work), g).to(streams.dtype)
        return d_post, d_comb, d_out, d_streams


class HyperHead(nn.Module):
    """The final collapse of the streams (no Sinkhorn, no post): hc_fn (n, n D), hc_base (n,), hc_scale (1,)."""

    def __init__(self, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size))
        self.hc_base = nn.Parameter(torch.empty(hc_mult))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms(streams.flatten(2).float(), self.norm_eps)
        mix = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mix * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return collapse(pre, streams)
