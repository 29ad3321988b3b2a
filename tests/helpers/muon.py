"""A plain single-process Muon written from the papers' update rule (Jordan 2024; Moonlight, arXiv:2502.16982,
Algorithm 1), one 2-D matrix at a time, for the tests to hold dstrain's (batched, ZeRO-sliced) Muon against."""

from __future__ import annotations

import math

import torch


def ns5(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Newton-Schulz quintic on one matrix: X <- aX + b(XX^T)X + c(XX^T)^2 X from X = G / ||G||_F."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.t()
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        s = x @ x.t()
        x = a * x + b * (s @ x) + c * (s @ (s @ x))
    return x.t() if transposed else x


def matrices(name: str, t: torch.Tensor) -> list[torch.Tensor]:
    """The matrices of a parameter, as views: one per expert of a 3-D expert tensor, gate and up halves of
    gate_up_proj apart."""
    if t.dim() == 2:
        return [t]
    out = []
    for e in range(t.shape[0]):
        if name.endswith("gate_up_proj"):
            half = t.shape[1] // 2
            out += [t[e, :half], t[e, half:]]
        else:
            out.append(t[e])
    return out


def uses_muon(name: str, p: torch.Tensor) -> bool:
    return p.dim() >= 2 and not name.endswith(("embed_tokens.weight", "lm_head.weight"))


class ReferenceMuon:
    """Muon on `named` (name, parameter) pairs: M <- mu M + G; U = G + mu M; W <- W(1 - lr wd) - lr 0.2
    sqrt(max(A, B)) NS5(U) per matrix."""

    def __init__(self, named, weight_decay: float, momentum: float = 0.95) -> None:
        self.named, self.wd, self.mu = list(named), weight_decay, momentum
        self.buf = {n: torch.zeros_like(p) for n, p in self.named}

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for name, p in self.named:
            m = self.buf[name]
            m.mul_(self.mu).add_(p.grad)
            u = p.grad + self.mu * m
            p.mul_(1 - lr * self.wd)
            for w, d in zip(matrices(name, p), matrices(name, u)):
                w.sub_(lr * 0.2 * math.sqrt(max(d.shape)) * ns5(d))
