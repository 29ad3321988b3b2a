"""The output head's cross-entropy without (tokens x vocab) logits held for backward.

`Head` is the lm_head Linear (same parameters and state dict); called with targets it returns the summed
cross-entropy. Rows run in chunks of at most CHUNK_ELEMENTS logits; each chunk's gradient (softmax - onehot)
is applied to the head's input and weight right there, in the forward, so what backward keeps is d input
(tokens x hidden, the input's dtype) and d weight (the weight's shape and dtype), never the logits. A step's
peak then holds one chunk of logits instead of the whole (tokens x vocab) fp32 logits, their log-softmax
and their gradient. Logits are computed in the weight's dtype and softmaxed in fp32, as F.cross_entropy on
upcast logits does. Called under no_grad (evaluation), only the loss is computed.

Around it, what both families' forwards compute their losses with: summed cross-entropies of valid positions
(`ce_sum`), an MTP depth's loss (`mtp_depth_loss`) and the training objective from its parts (`combine_losses`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dstrain.batch import target_mask

from .kernels import Linear, compute_dtype, linear

CHUNK_ELEMENTS = 2**24  # logits per chunk: 64 MiB in fp32 ...
CHUNK_ROWS = 256  # ... but at least this many rows: fewer would re-read the whole weight for too little work


def ce_chunk(
    logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, want_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk: (summed cross-entropy of the valid rows, d loss / d logits in the logits' dtype or None).
    Few passes over the (rows x vocab) logits: fused log-softmax in fp32, softmax in place of it, the -1 at
    each target, the cast back, the mask."""
    logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    loss = -(logp.gather(1, targets.unsqueeze(1)).squeeze(1) * valid).sum()
    if not want_grad:
        return loss, None
    grad = logp.exp_()
    grad.scatter_add_(1, targets.unsqueeze(1), grad.new_full((targets.numel(), 1), -1.0))
    grad = grad.to(logits.dtype)  # the mask is 0 / 1: exact in any dtype, applied after the cast
    return loss, grad.mul_(valid.to(grad.dtype).unsqueeze(1))


def _weight_grad(grad: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """grad^T h, fp32 out on a GPU (its bf16 GEMM accumulates in fp32: no rounding of the result); elsewhere
    in the compute dtype of `kernels.linear`."""
    if h.device.type == "cuda" and h.dtype != torch.float32:
        return torch.mm(grad.t(), h, out_dtype=torch.float32)
    return linear(grad.t(), h.t())


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, valid, chunk_fn):  # noqa: ANN001, ANN205
        want_h, want_w = ctx.needs_input_grad[:2]
        rows = max(CHUNK_ROWS, CHUNK_ELEMENTS // weight.shape[0])
        total = h.new_zeros((), dtype=torch.float32)
        dh = torch.empty_like(h) if want_h else None
        # The weight's gradient sums every chunk's: in fp32 where there are several, as autograd's one GEMM
        # would accumulate (a bf16 sum would round once per chunk: 16-64 times per micro batch)
        chunks = -(-h.shape[0] // rows)
        dw = torch.zeros_like(weight, dtype=torch.float32 if chunks > 1 else weight.dtype) if want_w else None
        for s in range(0, h.shape[0], rows):
            hc = h[s : s + rows]
            loss, grad = chunk_fn(
                linear(hc, weight), targets[s : s + rows], valid[s : s + rows], want_h or want_w
            )
            total += loss
            if want_h:
                dh[s : s + rows] = linear(grad, weight.t())
            if want_w and dw.dtype == hc.dtype and compute_dtype(hc) == hc.dtype:
                dw.addmm_(grad.t(), hc)
            elif want_w:  # the chunk's product in the compute dtype (fp32 out on GPUs), summed in dw's
                dw.add_(_weight_grad(grad, hc))
        ctx.save_for_backward(dh, dw.to(weight.dtype) if dw is not None else None)
        return total

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        dh, dw = ctx.saved_tensors
        # The saved gradients are this call's alone and backward runs once: scale them in place.
        dh = dh.mul_(grad) if dh is not None else None
        return dh, (dw.mul_(grad) if dw is not None else None), None, None, None


class Head(Linear):
    """The output head: logits for `x`, or with `targets` the cross-entropy summed over the rows where
    `valid` (see the top; other rows' targets must still be valid ids). Module call, so DeepSpeed's ZeRO-3
    hooks gather the weight for either. Every row is computed: no data-dependent shape, no host sync."""

    def forward(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
        hits: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`hits` (evaluation): also count the valid rows whose top-1 token is the target."""
        if targets is None:
            return linear(x, self.weight, self.bias)
        assert self.bias is None, "the LM head has no bias"
        if hits:
            return self._loss_and_hits(x, targets, valid)
        return _LinearCrossEntropy.apply(x, self.weight, targets, valid.to(torch.float32), self.chunk_fn)

    chunk_fn = staticmethod(ce_chunk)

    @torch.no_grad()
    def _loss_and_hits(
        self, x: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the summed cross-entropy, as the training path computes it, chunk by chunk; the hits)."""
        rows = max(CHUNK_ROWS, CHUNK_ELEMENTS // self.weight.shape[0])
        total = x.new_zeros((), dtype=torch.float32)
        hits = torch.zeros((), dtype=torch.int64, device=x.device)
        for s in range(0, x.shape[0], rows):
            logits = linear(x[s : s + rows], self.weight)
            t, v = targets[s : s + rows], valid[s : s + rows]
            total += ce_chunk(logits, t, v.to(torch.float32), False)[0]
            hits += ((logits.argmax(-1) == t) & v).sum()
        return total, hits

    def compile_loss(self, **options) -> None:  # noqa: ANN003 - torch.compile's
        """Fuse each chunk's elementwise work (log-softmax, softmax, target, mask, cast) into few kernels."""
        self.chunk_fn = torch.compile(ce_chunk, **options)


def ce_sum(
    head: nn.Module, h: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, hits: bool = False
) -> tuple[torch.Tensor, ...]:
    """(sum of token cross-entropies over valid positions[, with `hits` the valid positions whose top-1
    token is the target], their count); the (tokens x vocab) logits are never kept (loss.Head). A head
    replaced by a LoRA adapter computes plain logits."""
    h, valid = h.flatten(0, -2), valid.flatten()
    targets = torch.where(valid, targets.flatten(), 0)
    if isinstance(head, Head):
        if hits:
            return *head(h, targets, valid, hits=True), valid.sum()
        return head(h, targets, valid), valid.sum()
    logits = head(h).float()
    ce = (F.cross_entropy(logits, targets, reduction="none") * valid).sum()
    if hits:
        return ce, ((logits.argmax(-1) == targets) & valid).sum(), valid.sum()
    return ce, valid.sum()


def target_rows(t: int, labels: torch.Tensor, shift: int) -> int:
    """Positions predicting labels[i + shift]: all t when labels run on past them (a sequence-parallel
    slice's halo), else the first t - shift."""
    return min(t, labels.shape[1] - shift)


def mtp_depth_loss(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None,
    k: int,
    training: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """MTP depth k's summed cross-entropy of `hidden` (B, T, D, normed: position i predicts labels[i + k + 1])
    -> (sum, target count, depth 1's top-1 hits in evaluation (its draft acceptance) or None)."""
    shift = k + 1
    n = target_rows(hidden.shape[1], labels, shift)
    if n <= 0:
        return hidden.new_zeros((), dtype=torch.float32), labels.new_zeros(()), None
    hits = k == 1 and not training
    s, *rest, c = ce_sum(
        head,
        hidden[:, :n],
        labels[:, shift : shift + n],
        target_mask(labels, position_ids, shift)[:, :n],
        hits,
    )
    return s, c, rest[0] if hits else None


def combine_losses(lm, mtp, aux, alpha: float, lam: float):  # noqa: ANN001, ANN201 - tensors or floats
    """The training objective from its parts: `lm` the token-mean LM loss, `mtp` the mean over depths of the
    token-mean MTP losses (or None), `aux` the sequence-balance loss (or None): lm + λ·mtp + α·aux."""
    loss = lm
    if lam and mtp is not None:
        loss = loss + lam * mtp
    if alpha and aux is not None:
        loss = loss + alpha * aux
    return loss
