"""Routed experts as grouped GEMMs: no loop over experts in Python and no host sync.

Tokens are grouped by expert with a device-side sort (`group_by_expert`: the permutation and int32 group
offsets, static shapes); every expert's SwiGLU then runs as two `torch.nn.functional.grouped_mm` calls over
the fused 3-D weights, gate_up_proj (E, 2I, D) [gate rows, then up rows] and down_proj (E, D, I).

`routed_experts` is one autograd Function for gather -> SwiGLU -> weighted combine. It saves the layer input
x (alive anyway: the router and the residual hold it), the routing permutation and weights, and the (S, 2I)
pre-activation; backward re-gathers x and recomputes silu(gate) * up. Plain autograd would also keep the
gathered (S, D) copy of x, silu(gate) and the product (2 x (S, I)), the (S, D) expert outputs and an fp32
(S, D) copy for the weighting. The routing weights scale the activation before the down projection
(w * (h W^T) = (w * h) W^T, on (S, I) rather than (S, D)) and their gradient is rowsum(d(w h) * h). The
combine and dx sum each token's k rows in fp32, deterministically: on the CPU by a scatter-add by token, on
GPUs by a gather with the inverse permutation and a sum (no atomics).

`grouped_swiglu` is the same SwiGLU for rows already sorted by expert (expert parallelism, where rows arrive
from other ranks): it saves those rows and the pre-activation; `combine` weights and sums each token's rows
once they are back.

LoRA on the experts (`Adapters`, per expert its own A and B) runs as four more grouped GEMMs of width r in
forward, beside the base ones; frozen base weights get no gradient computed. Their rank r is an inner size
too: a multiple of 4 (fp32) or 8 (bf16) keeps them on grouped_mm, others take the per-group loop.

grouped_mm's rules (torch 2.13): both operands of one dtype (no autocast; bf16 kernels on CPUs without native
bf16 run in fp32, like `kernels.linear`), int32 offsets, and row strides that are multiples of 16 bytes, so
hidden and moe_intermediate sizes must be multiples of 16 / element size. Its fast CUDA kernels take bf16 on
sm90 and sm100 only (other dtypes and GPUs run torch's own per-group loop, which copies the offsets to the
host in every call: six times per MoE layer and micro batch). Where the rules do not hold (fp64, misaligned
sizes, no fast kernel) `_grouped_mm` runs an exact per-group loop instead, reading the offsets to the host
once per layer's forward and reusing them in its backward (`Offsets`); an expert without rows gets an
exactly zero weight gradient on every path (torch's CUTLASS kernel has given nonzero ones on B200,
pytorch#172439). Under torch.compile, grouped_mm's meta function admits bf16 only: other dtypes go through
the opaque custom op `dstrain::grouped_mm`.

On the CPU, bf16 grouped_mm runs one oneDNN GEMM per group, and oneDNN builds (JIT-compiles) a kernel for each
new row count: with routing changing every step that is most of the time (measured: 36 ms vs 12 ms for one
(12288 x 512) x (64 x 512 x 256) product). There, each expert's rows start at a multiple of `CPU_GROUP_ROWS`
in a zero-padded buffer, so the row counts come from a small set and the kernels are reused. Padding rows
are zero in and zero out, and rows past the last group are never computed nor read.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .kernels import FAST_GROUPED_GEMM, compute_dtype, cuda_capability, gpu_kernels

CPU_GROUP_ROWS = 16


def group_by_expert(idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """idx (N, k) expert ids -> (order, offs): `order` (N*k,) sorts the flattened (token, slot) pairs by expert
    (stable: by token within an expert), `offs` (E,) int32 is the end of each expert's rows in that order."""
    flat = idx.flatten()
    ids, order = flat.sort(stable=True)
    experts = torch.arange(num_experts, device=idx.device, dtype=ids.dtype)
    return order, torch.searchsorted(ids, experts, right=True, out_int32=True)


def grouped_mm_ok(dtype: torch.dtype, device: torch.device, *sizes: int) -> bool:
    """Whether torch's grouped_mm takes operands of this dtype whose inner sizes are `sizes` (on a GPU: with
    its fast kernel)."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if gpu_kernels(device) and (dtype != torch.bfloat16 or cuda_capability(device) not in FAST_GROUPED_GEMM):
        return False  # torch's loop with a host copy of the offsets per call: ours reads them once
    align = 16 // torch.empty((), dtype=dtype).element_size()
    return all(s % align == 0 for s in sizes)


@torch.library.custom_op("dstrain::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return F.grouped_mm(a, b, offs=offs)


@_grouped_mm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])


class Offsets:
    """A layer's int32 group ends on the device, read to the host at most once (by the per-group loop)."""

    def __init__(self, ends: torch.Tensor, host: list[int] | None = None) -> None:
        self.ends, self._host = ends, host

    def host(self) -> list[int]:
        if self._host is None:
            self._host = self.ends.tolist()
        return self._host


def _loop_mm(a: torch.Tensor, b: torch.Tensor, offs: Offsets) -> torch.Tensor:
    """grouped_mm's two forms by a loop over groups: (S, K) x (E, K, N) -> (S, N); (K, S) x (S, N) ->
    (E, K, N), an empty group's block exactly zero."""
    ends = offs.host()
    starts = [0, *ends[:-1]]
    if b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[-1])
        for e, (s, t) in enumerate(zip(starts, ends)):
            torch.mm(a[s:t], b[e], out=out[s:t])
        return out
    return torch.stack([a[:, s:t] @ b[s:t] for s, t in zip(starts, ends)])


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: Offsets) -> torch.Tensor:
    """grouped_mm (2D x 3D jagged rows, or 2D x 2D jagged inner dim -> 3D), in the dtype the CPU computes
    fastest (see kernels.compute_dtype), with the fallbacks described at the top."""
    dtype = a.dtype
    cdt = compute_dtype(a)
    if cdt != dtype:
        a, b = a.to(cdt), b.to(cdt)
    inner = (a.shape[-1], b.shape[-1]) if b.dim() == 3 else (a.shape[0], b.shape[-1])
    if not grouped_mm_ok(cdt, a.device, *inner):
        return _loop_mm(a, b, offs).to(dtype)
    if torch.compiler.is_compiling() and cdt != torch.bfloat16:
        out = _grouped_mm_op(a, b, offs.ends)
    else:
        out = F.grouped_mm(a, b, offs=offs.ends)
    if b.dim() == 2 and gpu_kernels(a.device):  # weight gradients: an idle expert's exactly zero
        counts = torch.diff(offs.ends, prepend=offs.ends.new_zeros(1))
        out = out.masked_fill((counts == 0).view(-1, 1, 1), 0)
    return out.to(dtype)


def group_alignment(like: torch.Tensor) -> int:
    """Rows each expert's group starts at a multiple of (see the top): CPU_GROUP_ROWS where oneDNN runs the
    GEMMs (bf16 computed as bf16 on a CPU), else 1."""
    return CPU_GROUP_ROWS if not gpu_kernels(like.device) and compute_dtype(like) == torch.bfloat16 else 1


class _Rows:
    """The rows the grouped GEMMs read: which (token, slot) of the flattened routing each holds (`slot`),
    grouped by expert (`offs`), and the row each (token, slot) ends up in (`back`). Rows are the expert-sorted
    order itself, or (CPU bf16, see the top) spread so that each expert's group starts at a multiple of the
    alignment, padding rows pointing one past the end: at the zero row `take` appends."""

    def __init__(self, order: torch.Tensor, offs: torch.Tensor, like: torch.Tensor) -> None:
        s = order.numel()
        align = group_alignment(like)
        self.padded = align > 1
        if not self.padded:
            self.slot, self.offs, self.back = order, offs, _inverse(order)
            return
        ends = offs.long()
        counts = torch.diff(ends, prepend=ends.new_zeros(1))
        padded = (counts + align - 1) // align * align
        padded_ends = padded.cumsum(0)
        sorted_rows = torch.arange(s, device=offs.device)
        expert = torch.searchsorted(ends, sorted_rows, right=True)
        dest = sorted_rows + (padded_ends - padded - ends + counts)[expert]  # buffer row of sorted row j
        size = s + offs.numel() * (align - 1)  # the most any routing needs: a static shape
        self.slot = order.new_full((size,), s).index_copy_(0, dest, order)
        self.offs = padded_ends.to(torch.int32)
        self.back = torch.empty_like(dest).index_copy_(0, order, dest)

    def take(self, t: torch.Tensor, per: int = 1) -> torch.Tensor:
        """The buffer's rows of `t`, whose row i holds (token, slot) pairs i * per ... (i + 1) * per - 1:
        t = x (per = k, one row per token) or a per-(token, slot) tensor (per = 1). Padding rows are zero."""
        if self.padded:
            t = torch.cat([t, t.new_zeros((1, *t.shape[1:]))])
        return t.index_select(0, self.slot // per if per > 1 else self.slot)


class Adapters(NamedTuple):
    """LoRA on every routed expert, per expert its own A and B (model.lora.LoRAExperts): gate_A/up_A (E, r, D),
    gate_B/up_B (E, I, r), down_A (E, r, I), down_B (E, D, r); expert e's gate weight is gate_up[e, :I] +
    scale * gate_B[e] @ gate_A[e], and likewise up and down. Run as grouped GEMMs beside the base ones
    (x A^T, then B^T), never as merged weights: the base weights' gradients are then not computed at all
    when they are frozen, and no (E, 2I, D) delta is materialised."""

    gate_A: torch.Tensor
    gate_B: torch.Tensor
    up_A: torch.Tensor
    up_B: torch.Tensor
    down_A: torch.Tensor
    down_B: torch.Tensor


def _t(w: torch.Tensor) -> torch.Tensor:
    return w.transpose(-2, -1)


def _swiglu_forward(
    xs: torch.Tensor,
    offs: Offsets,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    w: torch.Tensor | None,
    ad: Adapters | None = None,
    scale: float = 0.0,
    limit: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """Rows grouped by expert -> (pre-activation (S, 2I), outputs (S, D), the adapters' (S, 2r) and (S, r)
    low-rank activations, or () without adapters); `w` (S,) fp32 row weights or None; `limit`: DeepSeek-V4's
    SwiGLU clamp (gate at most `limit`, up within +-`limit`)."""
    gu = _grouped_mm(xs, _t(gate_up), offs)
    acts: tuple[torch.Tensor, ...] = ()
    if ad is not None:
        r = ad.gate_A.shape[1]
        xa = _grouped_mm(xs, _t(torch.cat([ad.gate_A, ad.up_A], dim=1)), offs)  # (S, 2r)
        dg = _grouped_mm(xa[:, :r].contiguous(), _t(ad.gate_B), offs)
        du = _grouped_mm(xa[:, r:].contiguous(), _t(ad.up_B), offs)
        gu = gu + torch.cat([dg, du], dim=-1) * scale
    g, u = _clamped(gu, limit)
    h = F.silu(g) * u
    if w is not None:
        h = (h.float() * w.unsqueeze(-1)).to(h.dtype)
    ys = _grouped_mm(h, _t(down), offs)
    if ad is not None:
        ha = _grouped_mm(h, _t(ad.down_A), offs)  # (S, r)
        ys = ys + _grouped_mm(ha, _t(ad.down_B), offs) * scale
        acts = (xa, ha)
    return gu, ys, acts


def _swiglu_backward(
    dys: torch.Tensor,
    xs: torch.Tensor,
    gu: torch.Tensor,
    offs: Offsets,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    w: torch.Tensor | None,
    ad: Adapters | None = None,
    scale: float = 0.0,
    acts: tuple[torch.Tensor, ...] = (),
    base_grads: bool = True,
    limit: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, Adapters | None]:
    """Gradients of `_swiglu_forward` given d outputs: -> (d xs, d gate_up, d down, d w (S,) fp32 or None,
    the adapters' gradients or None). silu(gate) * up is recomputed from the saved pre-activation; the base
    weights' gradients are None when not `base_grads` (frozen under LoRA)."""
    g, u = _clamped(gu, limit)
    act = F.silu(g)
    h = act * u
    dh = _grouped_mm(dys, down, offs)  # (S, I): d of the down projection's (weighted) input
    if ad is not None:
        xa, ha = acts
        dha = _grouped_mm(dys, ad.down_B, offs) * scale  # (S, r)
        dh = dh + _grouped_mm(dha, ad.down_A, offs)
    dw = None
    if w is not None:
        dw = (dh.float() * h.float()).sum(-1)
        wide = w.unsqueeze(-1)
        h = (h.float() * wide).to(h.dtype)
        dh = (dh.float() * wide).to(dh.dtype)
    d_down = _grouped_mm(dys.t(), h, offs) if base_grads else None  # (E, D, I)
    dg, du = torch.ops.aten.silu_backward(dh * u, g), dh * act
    if limit is not None:  # torch's clamp: the gradient passes where the input is within the bounds
        raw_g, raw_u = gu.chunk(2, dim=-1)
        dg, du = dg * (raw_g <= limit), du * (raw_u.abs() <= limit)
    dgu = torch.cat([dg, du], dim=-1)
    d_gate_up = _grouped_mm(dgu.t(), xs, offs) if base_grads else None  # (E, 2I, D)
    dxs = _grouped_mm(dgu, gate_up, offs)  # (S, D)
    if ad is None:
        return dxs, d_gate_up, d_down, dw, None
    r, i = ad.gate_A.shape[1], ad.gate_B.shape[1]
    dg, du = dgu[:, :i].contiguous(), dgu[:, i:].contiguous()
    xg, xu = xa[:, :r].contiguous(), xa[:, r:].contiguous()
    dxa = torch.cat([_grouped_mm(dg, ad.gate_B, offs), _grouped_mm(du, ad.up_B, offs)], dim=-1) * scale
    d_a = _grouped_mm(dxa.t(), xs, offs)  # (E, 2r, D)
    dxs = dxs + _grouped_mm(dxa, torch.cat([ad.gate_A, ad.up_A], dim=1), offs)
    grads = Adapters(
        gate_A=d_a[:, :r],
        gate_B=_grouped_mm(dg.t(), xg, offs) * scale,
        up_A=d_a[:, r:],
        up_B=_grouped_mm(du.t(), xu, offs) * scale,
        down_A=_grouped_mm(dha.t(), h, offs),
        down_B=_grouped_mm(dys.t(), ha, offs) * scale,
    )
    return dxs, d_gate_up, d_down, dw, grads


def _clamped(gu: torch.Tensor, limit: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of the pre-activation, clamped as DeepSeek-V4's SwiGLU clamps them."""
    g, u = gu.chunk(2, dim=-1)
    if limit is None:
        return g, u
    return g.clamp(max=limit), u.clamp(-limit, limit)


def _sum_per_token(t: torch.Tensor, rows: _Rows, n: int, k: int) -> torch.Tensor:
    """(n, ...): each token's k buffer rows of `t` summed, accumulated in fp32, in t's dtype. In eager on the
    CPU a scatter-add by token (index_add_ is deterministic there, and twice as fast as gathering the rows
    back: 2.3 vs 4.8 ms for 24576 x 512 fp32; under torch.compile inductor makes it a scatter loop 30x slower
    than eager's, 34 ms vs ~1 ms); elsewhere the gather of `_slot_sum` (index_add_ on CUDA uses atomics)."""
    if gpu_kernels(t.device) or torch.compiler.is_compiling():
        return _slot_sum(t, rows.back, n, k)
    acc = t.new_zeros((n + 1, *t.shape[1:]), dtype=torch.float32)  # row n: padding rows land there
    acc.index_add_(0, rows.slot // k, t.float())
    return acc[:n].to(t.dtype)


def _slot_sum(
    t: torch.Tensor, back: torch.Tensor, n: int, k: int, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """(n, D): sum over j of weights[i, j] * t[back[i * k + j]] (unweighted without `weights` (n, k) fp32),
    accumulated in fp32, in t's dtype: token i's k slots gathered back from their rows."""
    if torch.compiler.is_compiling():
        # k indexed loads added in fp32: one pointwise kernel; the gather-then-sum form became a reduction
        # over the middle axis that inductor vectorised badly on some shapes (28 ms vs 0.8 ms, `fine-b` bf16)
        # No cast to the dtype a tensor already has: under torch 2.11's Dynamo an autograd Function's output
        # that a self-returning call (.float(), .to(), +=) produced gets no gradient (all of the experts' 0)
        slots = back.view(n, k)
        acc = None
        for j in range(k):
            row = t.index_select(0, slots[:, j])
            row = row if row.dtype == torch.float32 else row.float()
            row = row if weights is None else row * weights[:, j : j + 1]
            acc = row if acc is None else acc + row
        return acc if acc.dtype == t.dtype else acc.to(t.dtype)
    gathered = t.index_select(0, back).view(n, k, *t.shape[1:])
    if weights is None:
        return gathered.sum(dim=1)
    return (gathered.float() * weights.unsqueeze(-1)).sum(dim=1).to(t.dtype)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    # scatter, not index assignment: the same kernel, and one FakeTensor can trace for a GPU on a CPU build
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def _base(ctx, gate_up, down, like: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
    """What to save of the base weights: the tensors, or for a stored base (stored.StoredExperts), which is
    dequantized a group of experts at a time in forward and again in backward and never saved, empty
    stand-ins."""
    if isinstance(gate_up, torch.Tensor):
        ctx.stored = None
        return gate_up, down
    ctx.stored = gate_up
    return like.new_empty(0), like.new_empty(0)


def _chunks(stored, offs: Offsets) -> Iterator[tuple[int, int, int, int, Offsets]]:  # noqa: ANN001
    """(first expert, end expert, first row, end row, their groups' ends) of each group of `stored.chunk`
    experts: rows are grouped by expert, so a group of experts is a range of rows."""
    ends = offs.host()
    for e0 in range(0, len(ends), stored.chunk):
        e1 = min(len(ends), e0 + stored.chunk)
        r0, r1 = (ends[e0 - 1] if e0 else 0), ends[e1 - 1]
        yield e0, e1, r0, r1, Offsets(offs.ends[e0:e1] - r0, [e - r0 for e in ends[e0:e1]])


def _sliced(ad: Adapters | None, e0: int, e1: int) -> Adapters | None:
    return None if ad is None else Adapters(*(t[e0:e1] for t in ad))


def _stored_forward(stored, xs, offs, w, ad, scale, limit):  # noqa: ANN001, ANN202
    """`_swiglu_forward` over a stored base, a group of experts at a time (their rows, their weights)."""
    weights = stored.weights(xs.dtype)
    n, (_, two_i, d) = xs.shape[0], stored.shape
    gu, ys = xs.new_zeros(n, two_i), xs.new_zeros(n, d)
    r = 0 if ad is None else ad.gate_A.shape[1]
    acts = () if ad is None else (xs.new_zeros(n, 2 * r), xs.new_zeros(n, r))
    for e0, e1, r0, r1, part in _chunks(stored, offs):
        if r1 == r0:
            continue
        rows = slice(r0, r1)
        out = _swiglu_forward(xs[rows], part, *weights(e0, e1), None if w is None else w[rows],
                              _sliced(ad, e0, e1), scale, limit)  # fmt: skip
        gu[rows], ys[rows] = out[0], out[1]
        for held, a in zip(acts, out[2]):
            held[rows] = a
    return gu, ys, acts


def _stored_backward(stored, dys, xs, gu, offs, w, ad, scale, acts, limit):  # noqa: ANN001, ANN202
    """`_swiglu_backward` over a stored base (frozen: no base gradients), a group of experts at a time."""
    weights = stored.weights(dys.dtype)
    dxs, dw = torch.zeros_like(xs), None if w is None else torch.zeros_like(w)
    grads: list[Adapters] = []
    for e0, e1, r0, r1, part in _chunks(stored, offs):
        rows = slice(r0, r1)
        dx, _, _, dwc, g = _swiglu_backward(
            dys[rows], xs[rows], gu[rows], part, *weights(e0, e1), None if w is None else w[rows],
            _sliced(ad, e0, e1), scale, tuple(a[rows] for a in acts), False, limit,
        )  # fmt: skip
        dxs[rows] = dx
        if dw is not None:
            dw[rows] = dwc
        if g is not None:
            grads.append(g)
    return dxs, None, None, dw, (Adapters(*(torch.cat(t) for t in zip(*grads))) if grads else None)


class _RoutedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, order, offs, gate_up, down, scale, limit, *lora):  # noqa: ANN001, ANN205
        n, k = weights.shape
        keep = _base(ctx, gate_up, down, x)
        ad = Adapters(*lora) if lora else None
        rows = _Rows(order, offs, x)
        w = rows.take(weights.flatten().float())
        groups = Offsets(rows.offs)
        if ctx.stored is None:
            gu, ys, acts = _swiglu_forward(rows.take(x, per=k), groups, gate_up, down, w, ad, scale, limit)
        else:
            gu, ys, acts = _stored_forward(ctx.stored, rows.take(x, per=k), groups, w, ad, scale, limit)
        ctx.scale, ctx.limit, ctx.host = (
            scale,
            limit,
            groups._host,
        )  # offsets read to the host in forward serve backward too
        ctx.save_for_backward(x, weights, order, offs, gu, *keep, *acts, *lora)
        return _sum_per_token(ys, rows, n, k)

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        x, weights, order, offs, gu, gate_up, down, *rest = ctx.saved_tensors
        acts, ad = _split_saved(rest)
        n, k = weights.shape
        rows = _Rows(order, offs, x)
        w = rows.take(weights.flatten().float())
        dys, xs = rows.take(dout.contiguous(), per=k), rows.take(x, per=k)
        base = any(ctx.needs_input_grad[4:6])
        groups = Offsets(rows.offs, ctx.host)
        if ctx.stored is None:
            dxs, d_gate_up, d_down, dw, d_ad = _swiglu_backward(
                dys, xs, gu, groups, gate_up, down, w, ad, ctx.scale, acts, base, ctx.limit
            )
        else:
            dxs, d_gate_up, d_down, dw, d_ad = _stored_backward(
                ctx.stored, dys, xs, gu, groups, w, ad, ctx.scale, acts, ctx.limit
            )
        dx = _sum_per_token(dxs, rows, n, k)
        dweights = dw.index_select(0, rows.back).view(n, k).to(weights.dtype)
        return dx, dweights, None, None, d_gate_up, d_down, None, None, *(d_ad or ())


def _split_saved(rest: list[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], Adapters | None]:
    """The saved tensors after the base ones: () and None without adapters, else the two low-rank
    activations and the six adapter tensors."""
    if not rest:
        return (), None
    return tuple(rest[:2]), Adapters(*rest[2:])


def routed_experts(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    adapters: Adapters | None = None,
    scale: float = 0.0,
    limit: float | None = None,
) -> torch.Tensor:
    """x (N, D), idx (N, k) expert ids, weights (N, k) fp32 -> (N, D): sum_j weights[:, j] * expert_{idx[:, j]}(x),
    each expert a SwiGLU (plus its LoRA adapters scaled by `scale`, if given; clamped at `limit` if given),
    in x's dtype."""
    order, offs = group_by_expert(idx, gate_up_proj.shape[0])
    return _RoutedExperts.apply(
        x, weights, order, offs, gate_up_proj, down_proj, scale, limit, *(adapters or ())
    )


class _GroupedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xs, offs, gate_up, down, scale, limit, *lora):  # noqa: ANN001, ANN205
        keep = _base(ctx, gate_up, down, xs)
        ad = Adapters(*lora) if lora else None
        rows = _Rows(torch.arange(xs.shape[0], device=xs.device), offs, xs)
        groups = Offsets(rows.offs)
        inputs = rows.take(xs) if rows.padded else xs
        if ctx.stored is None:
            gu, ys, acts = _swiglu_forward(inputs, groups, gate_up, down, None, ad, scale, limit)
        else:
            gu, ys, acts = _stored_forward(ctx.stored, inputs, groups, None, ad, scale, limit)
        ctx.scale, ctx.limit, ctx.host = scale, limit, groups._host
        ctx.save_for_backward(xs, offs, gu, *keep, *acts, *lora)
        return ys.index_select(0, rows.back) if rows.padded else ys

    @staticmethod
    def backward(ctx, dys):  # noqa: ANN001, ANN205
        xs, offs, gu, gate_up, down, *rest = ctx.saved_tensors
        acts, ad = _split_saved(rest)
        rows = _Rows(torch.arange(xs.shape[0], device=xs.device), offs, xs)
        dys = dys.contiguous()
        if rows.padded:
            dys, xs = rows.take(dys), rows.take(xs)
        base = any(ctx.needs_input_grad[2:4])
        groups = Offsets(rows.offs, ctx.host)
        if ctx.stored is None:
            dxs, d_gate_up, d_down, _, d_ad = _swiglu_backward(
                dys, xs, gu, groups, gate_up, down, None, ad, ctx.scale, acts, base, ctx.limit
            )
        else:
            dxs, d_gate_up, d_down, _, d_ad = _stored_backward(
                ctx.stored, dys, xs, gu, groups, None, ad, ctx.scale, acts, ctx.limit
            )
        dxs = dxs.index_select(0, rows.back) if rows.padded else dxs
        return dxs, None, d_gate_up, d_down, None, None, *(d_ad or ())


def grouped_swiglu(
    xs: torch.Tensor,
    offs: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    adapters: Adapters | None = None,
    scale: float = 0.0,
    limit: float | None = None,
) -> torch.Tensor:
    """Rows sorted by expert (expert e's rows end at offs[e]) -> each row through its expert's SwiGLU (and
    LoRA adapters; clamped at `limit` if given)."""
    return _GroupedSwiGLU.apply(xs, offs, gate_up_proj, down_proj, scale, limit, *(adapters or ()))


def combine(ys: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Expert outputs of the (token, slot) rows in `order` -> (N, D): the routing-weighted sum per token, in
    fp32, returned in ys's dtype."""
    n, k = weights.shape
    return _slot_sum(ys, _inverse(order), n, k, weights)
