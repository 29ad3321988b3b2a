"""Muon on the hidden matrices, AdamW on the rest, as one torch optimizer DeepSpeed's ZeRO wraps.

Muon (Keller Jordan 2024; Moonlight, Liu et al. 2025, arXiv:2502.16982) keeps one momentum buffer per matrix
and replaces the update by its nearest semi-orthogonal matrix, computed with five Newton-Schulz iterations:

    M <- mu M + G;  U = G + mu M (Nesterov);  O = NS5(U);  W <- W (1 - lr wd) - lr * scale(A, B) * O

scale (Moonlight's rule, default): 0.2 sqrt(max(A, B)), so the update's RMS is about AdamW's (0.2-0.4) and
AdamW's learning rate and weight decay carry over; or Keller Jordan's / DeepSpeed's sqrt(max(1, A / B)), whose
learning rate is in spectral-norm units (0.02). Where one tensor holds several matrices, each is its own
block: a fused expert tensor is orthogonalised per expert, gate and up apart; an attention up-projection per
head with `per_head` ("Muon split", as GLM-5 trains). Newton-Schulz runs in fp32: its result is then the same
to rounding on every layout (bf16, as Moonlight runs it on GPUs, is 3 significant digits).

The momentum is elementwise, so it lives with whatever ZeRO gives the optimizer (a flat slice of the
parameter); only Newton-Schulz needs the whole matrix. Each Muon parameter is its own parameter group, so a
ZeRO rank holds one contiguous slice of it: the step all-gathers the slices' Nesterov updates over the
group's data-parallel ranks, orthogonalises the whole matrix and keeps its own slice (Moonlight's
"Distributed Muon": every rank pays one all-gather of the matrix in fp32 and the whole Newton-Schulz).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as tdist

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # the quintic's coefficients (Keller Jordan), as Moonlight uses them
SCALES = ("rms", "spectral")


def newton_schulz(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """(N, A, B) -> each matrix's approximate orthogonalisation U S' V^T (S' in about [0.7, 1.2]), in fp32."""
    a, b, c = NS_COEFFS
    tall = x.size(-2) > x.size(-1)
    y = x.float().mT if tall else x.float()
    y = y / (torch.linalg.matrix_norm(y, keepdim=True) + 1e-7)  # spectral norm <= Frobenius <= 1
    for _ in range(steps):
        gram = y @ y.mT
        y = a * y + (b * gram + c * gram @ gram) @ y
    return y.mT if tall else y


def update_scale(rows: int, cols: int, rule: str) -> float:
    """The factor on one orthogonalised (rows, cols) block."""
    if rule == "rms":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def blocks(t: torch.Tensor, split: str) -> torch.Tensor:
    """The matrices Muon orthogonalises apart, as a (N, A, B) view of the whole tensor `t`:
    'matrix' one; 'experts' one per expert (E, A, B); 'experts_gate_up' per expert and half (gate rows, then up
    rows: E*2); 'heads:H' H row blocks of a 2-D projection (one per attention head)."""
    if split == "matrix":
        return t.view(1, *t.shape)
    if split == "experts":
        return t
    if split == "experts_gate_up":
        e, rows, cols = t.shape
        return t.reshape(e * 2, rows // 2, cols)
    kind, _, n = split.partition(":")
    assert kind == "heads" and t.ndim == 2, split
    return t.view(int(n), t.shape[0] // int(n), t.shape[1])


def orthogonal_update(u: torch.Tensor, split: str, steps: int, rule: str) -> torch.Tensor:
    """Muon's update of the whole tensor `u` (its Nesterov momentum): each block orthogonalised and scaled."""
    m = blocks(u, split)
    return (newton_schulz(m, steps) * update_scale(m.shape[-2], m.shape[-1], rule)).view(u.shape)


class MuonAdamW(torch.optim.AdamW):
    """torch's AdamW for the groups without a "muon" key; Muon for those with one. A Muon group holds one
    parameter: "muon" its split (see `blocks`), "shape" its whole shape (this rank's expert-parallel slice),
    "param" its name; plus "momentum", "nesterov", "ns_steps", "scale". What a ZeRO optimizer hands the step in
    its place (a flat slice of the padded, flattened tensor) is gathered over `gather[param]`, the process
    group its slices are spread over (`bind`)."""

    def __init__(self, groups: list[dict[str, Any]], **adamw: Any) -> None:
        super().__init__(groups, **adamw)
        self.gather: dict[str, Any] = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: ANN401 - torch's signature
        assert closure is None, "no closures: DeepSpeed calls step() without one"
        everything = self.param_groups
        for g in everything:
            if g.get("muon"):
                for p in g["params"]:
                    self._muon(p, g)
        adamw = [g for g in everything if not g.get("muon")]
        if adamw:
            self.param_groups = adamw
            try:
                super().step()
            finally:
                self.param_groups = everything
        return None

    def _muon(self, p: torch.Tensor, g: dict[str, Any]) -> None:
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            # the updates taken, kept as AdamW keeps them: a resume on another layout reads the count
            state["step"] = torch.zeros((), dtype=torch.float32)
        state["step"] += 1
        m = state["momentum_buffer"]
        m.mul_(g["momentum"]).add_(grad)
        u = grad.add(m, alpha=g["momentum"]) if g["nesterov"] else m
        shape = torch.Size(g["shape"])
        whole, mine = self._whole(u, shape, g["param"])
        update = orthogonal_update(whole, g["muon"], g["ns_steps"], g["scale"])
        p.mul_(1 - g["lr"] * g["weight_decay"])
        p.add_(mine(update).to(p.dtype), alpha=-g["lr"])

    def _whole(self, u: torch.Tensor, shape: torch.Size, name: str) -> tuple[torch.Tensor, Any]:
        """-> (the whole matrix of `u`, a function from a whole tensor to what this rank holds of it)."""
        if u.shape == shape:  # no ZeRO (or ZeRO-0 in fp32): the parameter itself
            return u, lambda t: t
        numel = shape.numel()
        group = self.gather.get(name)
        world = tdist.get_world_size(group) if group is not None else 1
        part = u.numel()
        assert part * world >= numel, (name, part, world, numel)
        if world == 1:
            flat = u
        else:
            flat = u.new_empty(part * world)
            tdist.all_gather_single(flat, u.contiguous(), group=group)
        start = (tdist.get_rank(group) if world > 1 else 0) * part

        def mine(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(part)  # padding past the tensor's end stays 0
            seg = t.reshape(-1)[start : start + part]
            out[: seg.numel()] = seg
            return out

        return flat[:numel].view(shape), mine


def bind(wrapper: Any, base: MuonAdamW) -> None:
    """Tell `base` which process group holds the slices of each Muon parameter under DeepSpeed's optimizer
    `wrapper` (ZeRO-1/2 and bf16: each group's data-parallel group, the expert-data-parallel one for experts;
    ZeRO-3: the data-parallel group). Without a wrapper the step sees whole parameters."""
    per_group = getattr(wrapper, "real_dp_process_group", None)
    for i, g in enumerate(base.param_groups):
        if not g.get("muon"):
            continue
        if per_group is not None:
            base.gather[g["param"]] = per_group[i]
        elif hasattr(wrapper, "fp32_partitioned_groups_flat"):
            base.gather[g["param"]] = wrapper.dp_process_group
