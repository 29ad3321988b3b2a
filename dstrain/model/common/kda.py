"""Kimi Delta Attention (KDA): a gated delta-rule linear attention with a fixed-size state per head, the linear
layers of Kimi Linear (and of GLM-5.3-Flash, which adds a lower bound to the forget gate).

Per head, with q, k L2-normalised (q scaled by 1/sqrt(d)), a per-channel log-decay g_t <= 0 and a write strength
beta_t in (0, 1), the state S (d_k x d_v, fp32) evolves as

    S_t = diag(exp(g_t)) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t.

`kda_recurrent` runs that loop token by token (the reference); `kda_chunked` computes the same in chunks of C
tokens (what trains): inside a chunk the delta rule's writes are solved at once by a unit lower-triangular solve
(the WY form), and only the chunk-to-chunk state update is sequential, T / C steps. Packed rows: the state and
the short convolution restart where a document starts (`starts`), so each document computes as it does alone.

Memory: the chunked form keeps the pairwise decays exp(G_i - G_j) of each chunk, (C x C x d_k) per chunk and
head (about C times q's size), the safe form in fp32 (no exp of a positive exponent is ever taken).

On a GPU with flash-linear-attention installed (`pip install flash-linear-attention`, an extra), its Triton
`chunk_kda` runs the delta rule instead (`fla_kda`; packed rows as its variable-length sequences, `cu_seqlens`):
the same function, its own chunking and rounding; the torch form otherwise (`kernel_path` names which).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import Linear

# tokens per chunk of the training form: 16 rounds 3x less than fla's and transformers' 64 in fp32 and ran 6x
# faster on a CPU (the delta rule's forward and backward, 2 x 512 tokens, 4 heads of 64); a 64 chunk's pairwise
# decays also take 4x the memory
CHUNK = 16
L2_EPS = 1e-6  # inside the square root, as fla's l2norm (not F.normalize's max(norm, eps))
SOFTPLUS_LINEAR_ABOVE = 20.0  # transformers' softplus is x itself past 20


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool, True where a packed document starts inside a row (position_ids == 0, past the row's first
    token: the state starts empty there anyway)."""
    starts = position_ids == 0
    starts[:, 0] = False
    return starts


def short_conv(x: torch.Tensor, weight: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal convolution then SiLU, restarting at every document start. x (B, T, C), weight (C, 1, K):
    out[t] = silu(sum_j weight[:, 0, K-1-j] * x[t-j]) over the j < K that stay in t's document."""
    k = weight.shape[-1]
    if starts is None:
        out = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight, padding=k - 1, groups=x.shape[-1])
        return F.silu(out[..., : x.shape[1]]).transpose(1, 2).to(x.dtype)
    # tokens since the document began: a tap j reaches back only that far
    since = _since_start(starts)
    w = weight[:, 0].to(x.dtype)
    out = x * w[:, k - 1]
    for j in range(1, k):
        shifted = F.pad(x, (0, 0, j, 0))[:, : x.shape[1]]
        out = out + (shifted * (since >= j).unsqueeze(-1)) * w[:, k - 1 - j]
    return F.silu(out)


def _since_start(starts: torch.Tensor) -> torch.Tensor:
    """(B, T) tokens since the current document began (0 at its first token)."""
    t = starts.shape[1]
    idx = torch.arange(t, device=starts.device).expand_as(starts)
    begin = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - begin


@functools.cache
def _fla_chunk_kda() -> Any:
    """fla's `chunk_kda`, None where flash-linear-attention is not installed (or does not import)."""
    if importlib.util.find_spec("fla") is None:
        return None
    try:
        from fla.ops.kda import chunk_kda
    except Exception:  # noqa: BLE001 - an fla that does not import here (its Triton, its torch) is not used
        return None
    return chunk_kda


def fla_kernels(device: torch.device) -> bool:
    """Whether the delta rule runs fla's Triton kernels on `device`: a CUDA device with fla installed."""
    return device.type == "cuda" and _fla_chunk_kda() is not None


def kernel_path(device: torch.device) -> str:
    """What runs KDA's delta rule on `device` (`dstrain env`, a run's kernel line)."""
    if fla_kernels(device):
        return "flash-linear-attention's chunk_kda (Triton; packed rows as its varlen sequences)"
    why = "" if device.type == "cuda" else "; fla's kernels need a GPU"
    if device.type == "cuda" and _fla_chunk_kda() is None:
        why = "; pip install flash-linear-attention for its Triton kernels"
    return f"dstrain's chunked delta rule in torch ({CHUNK}-token chunks, fp32 state{why})"


def fla_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    starts: torch.Tensor | None,
    chunk_kda: Any = None,
) -> torch.Tensor:
    """`kda_chunked`'s result from fla's `chunk_kda` (or `chunk_kda` given: the tests' stand-in), the arguments
    as kda_chunked takes them (q normalised and scaled). Packed rows: the batch flattened into one sequence cut
    at every row's and document's start (fla's `cu_seqlens`), so that each document's state starts empty."""
    chunk_kda = chunk_kda or _fla_chunk_kda()
    b, t, h, _ = q.shape
    if starts is None:
        return chunk_kda(q, k, v, g, beta, scale=1.0)[0]
    cuts = starts.clone()
    cuts[:, 0] = True  # every row starts a sequence
    bounds = torch.cat([cuts.flatten().nonzero().flatten(), cuts.new_tensor([b * t], dtype=torch.long)])
    flat = (z.reshape(1, b * t, *z.shape[2:]) for z in (q, k, v, g, beta))
    return chunk_kda(*flat, scale=1.0, cu_seqlens=bounds)[0].view(b, t, h, -1)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference: token by token. q, k, g (B, T, H, Dk), v (B, T, H, Dv), beta (B, T, H), fp32, q and k
    normalised and q scaled; `starts` (B, T) document starts (the state restarts there) -> o (B, T, H, Dv)."""
    b, t, h, dk = k.shape
    state = q.new_zeros(b, h, dk, v.shape[-1])
    out = []
    for i in range(t):
        if starts is not None:
            state = state * (~starts[:, i]).to(state.dtype)[:, None, None, None]
        state = state * g[:, i].exp().unsqueeze(-1)
        delta = (v[:, i] - (state * k[:, i].unsqueeze(-1)).sum(-2)) * beta[:, i, :, None]
        state = state + k[:, i].unsqueeze(-1) * delta.unsqueeze(-2)
        out.append((state * q[:, i].unsqueeze(-1)).sum(-2))
    return torch.stack(out, dim=1)


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    starts: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """`kda_recurrent`'s result, computed in chunks of `chunk` tokens (same arguments, fp32)."""
    b, t, h, dk = k.shape
    pad = -t % chunk
    n = (t + pad) // chunk

    def chunks(x: torch.Tensor) -> torch.Tensor:  # (B, T, H, ...) -> (B, H, n, C, ...)
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) if pad else x
        return x.reshape(b, n, chunk, h, *x.shape[3:]).transpose(1, 3).transpose(2, 3)

    q, k, v, g = chunks(q), chunks(k), chunks(v), chunks(g)
    beta = chunks(beta.unsqueeze(-1)).squeeze(-1)
    doc = None if starts is None else F.pad(starts.long().cumsum(1), (0, pad)).view(b, n, chunk)
    cum = g.cumsum(dim=-2)  # (B, H, n, C, Dk): log-decay from the chunk's start through each token
    scores, u, w = _within_chunks(q, k, v, cum, beta, _same_document(doc, chunk, q.device))
    carry, last = _state_masks(doc, starts, chunk, n)
    to_end = (cum[..., -1:, :] - cum).exp()  # decay from each token through the chunk's end
    state = q.new_zeros(b, h, dk, v.shape[-1])
    out = []
    for c in range(n):  # the only sequential part: the state from chunk to chunk
        keep = carry[..., c, :, None] if carry is not None else 1.0
        fresh = u[:, :, c] - keep * (w[:, :, c] @ state)
        out.append(keep * ((q[:, :, c] * cum[:, :, c].exp()) @ state) + scores[:, :, c] @ fresh)
        written = k[:, :, c] * to_end[:, :, c]
        decay = cum[:, :, c, -1].exp().unsqueeze(-1)
        if carry is not None:
            written = written * last[..., c, :, None]
            decay = decay * carry[..., c, -1, None, None]
        state = state * decay + written.transpose(-1, -2) @ fresh
    o = torch.stack(out, dim=2)  # (B, H, n, C, Dv)
    return o.permute(0, 2, 3, 1, 4).reshape(b, n * chunk, h, -1)[:, :t]


def _within_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cum: torch.Tensor,
    beta: torch.Tensor,
    same: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Everything inside the chunks at once (B, H, n, C, ...): the decayed q_i . k_j scores (j <= i, one
    document), and the WY form of the delta rule's writes, (I + L) [u | w] = beta [v | k exp(cum)] with
    L_ij = beta_i k_i . k_j decayed (j < i): u the values each token writes given an empty state entering the
    chunk, w what it subtracts per unit of that state."""
    chunk, dk = q.shape[-2], q.shape[-1]
    # exp of masked differences: a difference of cumulative log-decays is <= 0 where kept, no overflow
    pair = (cum.unsqueeze(-2) - cum.unsqueeze(-3)).masked_fill(~same.unsqueeze(-1), float("-inf")).exp()
    scores = torch.einsum("...id,...jd,...ijd->...ij", q, k, pair)
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
    writes = torch.einsum("...id,...jd,...ijd->...ij", k, k, pair) * beta.unsqueeze(-1) * strict
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    rhs = torch.cat([v, k * cum.exp()], dim=-1) * beta.unsqueeze(-1)
    solved = torch.linalg.solve_triangular(eye + writes, rhs, upper=False, unitriangular=True)
    u, w = solved.split([v.shape[-1], dk], dim=-1)
    return scores, u, w


def _same_document(doc: torch.Tensor | None, chunk: int, device: torch.device) -> torch.Tensor:
    """(…, C, C) bool: key j at or before query i, in i's document."""
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()
    if doc is None:
        return causal
    return causal & (doc.unsqueeze(-1) == doc.unsqueeze(-2)).unsqueeze(1)


def _state_masks(
    doc: torch.Tensor | None, starts: torch.Tensor | None, chunk: int, n: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per chunk and token (B, 1, n, C) float: `carry`, the token reads the state that enters its chunk (it is
    in the chunk's first document, and that document began before the chunk); `last`, the token is in the
    chunk's last document (only those write the state that leaves it)."""
    if doc is None:
        return None, None
    first = F.pad(starts, (0, -starts.shape[1] % chunk)).view(starts.shape[0], n, chunk)[:, :, 0]
    carry = (doc == doc[..., :1]) & ~first.unsqueeze(-1)
    last = doc == doc[..., -1:]
    return carry.unsqueeze(1).float(), last.unsqueeze(1).float()


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's channels in fp32, times sigmoid(gate): KDA's output norm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.sigmoid(gate.float())).to(x.dtype)


class KDA(nn.Module):
    """One KDA layer, module names as the published checkpoints' (`self_attn.` of a KDA layer): q/k/v
    projections, their short convolutions (`q_conv1d` ... , (C, 1, K) each), the forget gate (`f_a_proj`,
    `f_b_proj`, `A_log`, `dt_bias`), beta (`b_proj`), the output gate (`g_a_proj`, `g_b_proj`), the gated norm
    (`o_norm`) and `o_proj`.

    Forget gate, per channel: with x = f_b(f_a(h)) + dt_bias, g = -exp(A_log) * softplus(x) (Kimi), or with a
    `lower_bound` L, g = L * sigmoid(exp(A_log) * x) (GLM-5.3-Flash: g within (L, 0)). `a_log_shape`: A_log as
    the checkpoint holds it ((1, 1, H, 1) in Kimi's, (H,) in GLM's)."""

    seq_parallel: Any = None  # sequence parallelism (dstrain.parallel.sp): heads over whole rows

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        conv_size: int,
        eps: float,
        lower_bound: float | None = None,
        a_log_shape: tuple[int, ...] | None = None,
        chunk: int = CHUNK,
    ) -> None:
        super().__init__()
        inner = num_heads * head_dim
        self.num_heads, self.head_dim, self.lower_bound, self.chunk = num_heads, head_dim, lower_bound, chunk
        self.q_proj = Linear(hidden_size, inner, bias=False)
        self.k_proj = Linear(hidden_size, inner, bias=False)
        self.v_proj = Linear(hidden_size, inner, bias=False)
        self.q_conv1d = ShortConv(inner, conv_size)
        self.k_conv1d = ShortConv(inner, conv_size)
        self.v_conv1d = ShortConv(inner, conv_size)
        self.f_a_proj = Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = Linear(head_dim, inner, bias=False)
        self.A_log = nn.Parameter(torch.zeros(a_log_shape or (num_heads,)))
        self.dt_bias = nn.Parameter(torch.zeros(inner))
        self.b_proj = Linear(hidden_size, num_heads, bias=False)
        self.g_a_proj = Linear(hidden_size, head_dim, bias=False)
        self.g_b_proj = Linear(head_dim, inner, bias=False)
        self.o_norm = GatedRMSNorm(head_dim, eps)
        self.o_proj = Linear(inner, hidden_size, bias=False)

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, D) -> the per-channel log-decay g (B, T, H, Dk), fp32, <= 0."""
        heads = (*x.shape[:2], self.num_heads, self.head_dim)
        pre = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(heads)
        rate = self.A_log.float().reshape(1, 1, self.num_heads, 1).exp()
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * pre)
        # fla's and transformers' softplus, log(1 + exp(x)) below the threshold (F.softplus's log1p rounds
        # differently, and the decay's rounding compounds over a document)
        soft = torch.where(pre > SOFTPLUS_LINEAR_ABOVE, pre, torch.log(1.0 + torch.exp(pre)))
        return -rate * soft

    def forward(
        self, x: torch.Tensor, starts: torch.Tensor | None = None, recurrent: bool = False
    ) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D); `starts` (B, T) bool: where a packed document starts (`document_starts`;
        the whole rows' under sequence parallelism); `recurrent`: the token-by-token reference instead of the
        chunked form."""
        b, t, _ = x.shape
        heads = (b, t, self.num_heads, self.head_dim)
        sp = self.seq_parallel
        qkv = [proj(x).view(heads) for proj in (self.q_proj, self.k_proj, self.v_proj)]
        g, beta = self.forget_gate(x), torch.sigmoid(self.b_proj(x)).float()
        convs = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        if sp is not None:  # the convolutions and the state run along whole rows: a slice of the heads each
            qkv, g = [sp.to_heads(z) for z in qkv], sp.to_heads(g)
            beta = sp.to_heads(beta.unsqueeze(-1)).squeeze(-1)
            convs = tuple(w.chunk(sp.size)[sp.rank] for w in convs)  # the channels of this rank's heads
        q, k, v = (short_conv(z.flatten(2), w, starts).view(z.shape).float() for z, w in zip(qkv, convs))
        q, k = l2norm(q) * self.head_dim**-0.5, l2norm(k)
        if recurrent:
            o = kda_recurrent(q, k, v, g, beta, starts)
        elif fla_kernels(q.device):
            o = fla_kda(q, k, v, g, beta, starts).float()
        else:
            o = kda_chunked(q, k, v, g, beta, starts, self.chunk)
        o = o.to(x.dtype) if sp is None else sp.to_tokens(o.to(x.dtype))
        gate = self.g_b_proj(self.g_a_proj(x)).view(heads)
        return self.o_proj(self.o_norm(o, gate).reshape(b, t, -1))


class ShortConv(nn.Module):
    """A depthwise causal convolution of `kernel` taps with SiLU (`short_conv`); weight (C, 1, K), no bias."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))

    def forward(self, x: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
        return short_conv(x, self.weight, starts)


def kda_params(cfg: Any) -> int:
    """Parameters of `KDA(cfg)`: q, k, v, o projections, three short convolutions, the forget gate (two low-rank
    factors, A_log, dt_bias), beta, the output gate's two factors and the gated norm."""
    d, h, dk = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim
    inner = h * dk
    return (
        4 * d * inner
        + 3 * inner * cfg.linear_conv_kernel_dim
        + 2 * (d * dk + dk * inner)
        + h
        + inner
        + d * h
        + dk
    )


def kda_flops_per_token(cfg: Any, seq_len: int) -> float:
    """Training FLOPs per token of one KDA layer beyond its projections: per head, the state's read, decay and
    write (about 3 d_k d_v multiply-adds) and within its chunk of C the pairwise q.k and k.k decayed scores
    (2 C/2 d_k) and their products with values (C/2 d_v), times 6 for forward and backward."""
    dk, c = cfg.linear_head_dim, min(CHUNK, seq_len)
    return 6 * cfg.linear_num_heads * (3 * dk * dk + c * dk + (c / 2) * dk)
