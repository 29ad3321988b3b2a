"""The output head's cross-entropy without (tokens x vocab) logits held for backward.

`Head` is the lm_head Linear (same parameters and state dict); called with targets it returns the summed
cross-entropy. Rows run in chunks of at most CHUNK_ELEMENTS logits; each chunk's gradient (softmax - onehot)
is applied to the head's input and weight right there, in the forward, so what backward keeps is d input
(tokens x hidden, the input's dtype) and d weight (the weight's shape and dtype), never the logits. A step's
peak then holds one chunk of logits instead of the whole (tokens x vocab) fp32 logits, their log-softmax
and their gradient. Logits are computed in the weight's dtype and softmaxed in fp32, as F.cross_entropy on
upcast logits does. Called under no_grad (evaluation), only the loss is computed.

Around it, what every family's forward computes its losses with: summed cross-entropies of valid positions
(`ce_sum`), the main head's loss (`lm_losses`: summed, or per position for DPO), an MTP depth's loss
(`mtp_depth_loss`) and the training objective from its parts (`combine_losses`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dstrain.batch import target_mask

from .kernels import Linear, compute_dtype, gpu_kernels, linear

CHUNK_ELEMENTS = 2**24  # logits per chunk: 64 MiB in fp32 ...
CHUNK_ROWS = 256  # ... but at least this many rows: fewer would re-read the whole weight for too little work
# On a GPU each chunk is a few launches that re-read the whole head: 256-row chunks of a 129280 vocabulary left
# its GEMMs launch- and memory-bound (64 chunks a step on an H200); 1 GiB of fp32 logits is still small there.
GPU_CHUNK_ELEMENTS = 2**28
GPU_CHUNK_ROWS = 2048


def chunk_rows(vocab: int, gpu: bool) -> int:
    """Rows of one chunk of the head's loss: GPU kernels (kernels.gpu_kernels) or the CPU's."""
    if gpu:
        return max(GPU_CHUNK_ROWS, GPU_CHUNK_ELEMENTS // vocab)
    return max(CHUNK_ROWS, CHUNK_ELEMENTS // vocab)


def ce_chunk(
    logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, want_grad: bool, mask_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk: (summed cross-entropy of the valid rows, d loss / d logits in the logits' dtype or None).
    Few passes over the (rows x vocab) logits: fused log-softmax in fp32, softmax in place of it, the -1 at
    each target, the cast back, the mask (left to the caller with `mask_grad=False`: it masks rows of the
    narrower products instead)."""
    logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    loss = -(logp.gather(1, targets.unsqueeze(1)).squeeze(1) * valid).sum()
    if not want_grad:
        return loss, None
    grad = logp.exp_()
    grad.scatter_add_(1, targets.unsqueeze(1), grad.new_full((targets.numel(), 1), -1.0))
    grad = grad.to(logits.dtype)  # the mask is 0 / 1: exact in any dtype, applied after the cast
    return loss, grad.mul_(valid.to(grad.dtype).unsqueeze(1)) if mask_grad else grad


def _weight_grad(grad: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """grad^T h in the compute dtype of `kernels.linear` (the CPU path)."""
    return linear(grad.t(), h.t())


_NO_ADDMM_IN_PLACE: set[str] = set()  # device types whose addmm refused an fp32 `self` with out_dtype


def _accumulate_weight_grad(dw: torch.Tensor, grad: torch.Tensor, h: torch.Tensor) -> None:
    """dw += grad^T h, dw fp32: one GEMM with fp32 accumulation writing into dw, no (vocab x hidden)
    temporary. Older torch (2.8's Blas.cpp) refuses an fp32 `self` for a bf16 addmm with out_dtype: there the
    fp32 product is a temporary, added once per chunk (2048-row chunks make that a few adds a step)."""
    if grad.dtype == dw.dtype:
        dw.addmm_(grad.t(), h)
        return
    if h.device.type != "cuda":  # a CPU has no out_dtype GEMM: the same math on upcast (rows x ...) inputs
        dw.addmm_(grad.t().to(dw.dtype), h.to(dw.dtype))
        return
    if h.device.type not in _NO_ADDMM_IN_PLACE:
        try:
            torch.addmm(dw, grad.t(), h, out_dtype=dw.dtype, out=dw)
            return
        except RuntimeError as exc:  # argument checks only, before any kernel: dw is untouched
            if isinstance(exc, torch.OutOfMemoryError):
                raise
            _NO_ADDMM_IN_PLACE.add(h.device.type)
    dw.add_(torch.mm(grad.t(), h, out_dtype=dw.dtype))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, valid, chunk_fn):  # noqa: ANN001, ANN205
        want_h, want_w = ctx.needs_input_grad[:2]
        gpu = gpu_kernels(h.device)
        rows = chunk_rows(weight.shape[0], gpu)
        total = h.new_zeros((), dtype=torch.float32)
        dh = torch.empty_like(h) if want_h else None
        # The weight's gradient sums every chunk's: in fp32 where there are several, as autograd's one GEMM
        # would accumulate (a bf16 sum would round once per chunk: 16-64 times per micro batch); on GPUs always
        # one fp32 buffer the GEMMs accumulate into.
        chunks = -(-h.shape[0] // rows)
        acc = torch.float32 if chunks > 1 or gpu else weight.dtype
        dw = torch.zeros_like(weight, dtype=acc) if want_w else None
        for s in range(0, h.shape[0], rows):
            hc, vc = h[s : s + rows], valid[s : s + rows]
            loss, grad = chunk_fn(linear(hc, weight), targets[s : s + rows], vc, want_h or want_w, not gpu)
            # Out of place: torch 2.11's Dynamo loses the gradient of a Function's output that its forward
            # created and then mutated (every gradient of the loss compiled 0, eager's not)
            total = total + loss
            if gpu:  # the mask on the chunk's rows of h and dh, not on its (rows x vocab) gradient
                row_mask = vc.to(h.dtype).unsqueeze(1)
                if want_h:
                    torch.mul(linear(grad, weight.t()), row_mask, out=dh[s : s + rows])
                if want_w:
                    _accumulate_weight_grad(dw, grad, hc * row_mask)
                continue
            if want_h:
                dh[s : s + rows] = linear(grad, weight.t())
            if want_w and dw.dtype == hc.dtype and compute_dtype(hc) == hc.dtype:
                dw.addmm_(grad.t(), hc)
            elif want_w:  # the chunk's product in the compute dtype, summed in dw's
                dw.add_(_weight_grad(grad, hc))
        ctx.save_for_backward(dh, dw.to(weight.dtype) if dw is not None else None)
        return total

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        dh, dw = ctx.saved_tensors
        # The saved gradients are this call's alone and backward runs once: scale them in place.
        dh = dh.mul_(grad) if dh is not None else None
        return dh, (dw.mul_(grad) if dw is not None else None), None, None, None


class _LinearTokenCrossEntropy(torch.autograd.Function):
    """Each row's cross-entropy (0 where not valid), for losses that weigh rows unequally (DPO's sequence
    log-probabilities). The upstream gradient differs per row, so it cannot be applied in the forward as
    `_LinearCrossEntropy` does: backward recomputes each chunk's logits instead (one more head GEMM), and
    neither pass keeps more than one chunk of logits."""

    @staticmethod
    def forward(ctx, h, weight, targets, valid):  # noqa: ANN001, ANN205
        rows = chunk_rows(weight.shape[0], gpu_kernels(h.device))
        out = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], rows):
            logp = torch.log_softmax(linear(h[s : s + rows], weight), dim=-1, dtype=torch.float32)
            picked = logp.gather(1, targets[s : s + rows].unsqueeze(1)).squeeze(1)
            out[s : s + rows] = -picked * valid[s : s + rows]
        ctx.save_for_backward(h, weight, targets, valid)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        h, weight, targets, valid = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[:2]
        rows = chunk_rows(weight.shape[0], gpu_kernels(h.device))
        dh = torch.empty_like(h) if want_h else None
        dw = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        g = grad.float() * valid
        for s in range(0, h.shape[0], rows):
            hc = h[s : s + rows]
            logits = linear(hc, weight)
            d = torch.softmax(logits, dim=-1, dtype=torch.float32)
            d.scatter_add_(1, targets[s : s + rows].unsqueeze(1), d.new_full((hc.shape[0], 1), -1.0))
            d = d.mul_(g[s : s + rows].unsqueeze(1)).to(logits.dtype)
            if want_h:
                dh[s : s + rows] = linear(d, weight.t())
            if want_w:
                _accumulate_weight_grad(dw, d, hc)
        return dh, (dw.to(weight.dtype) if dw is not None else None), None, None


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
        per_row: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`hits` (evaluation): also count the valid rows whose top-1 token is the target; `per_row`: each
        row's cross-entropy (fp32, 0 where not valid) instead of their sum."""
        if targets is None:
            return linear(x, self.weight, self.bias)
        assert self.bias is None, "the LM head has no bias"
        if per_row:
            return _LinearTokenCrossEntropy.apply(x, self.weight, targets, valid.to(torch.float32))
        if hits:
            return self._loss_and_hits(x, targets, valid)
        return _LinearCrossEntropy.apply(x, self.weight, targets, valid.to(torch.float32), self.chunk_fn)

    chunk_fn = staticmethod(ce_chunk)

    @torch.no_grad()
    def _loss_and_hits(
        self, x: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the summed cross-entropy, as the training path computes it, chunk by chunk; the hits)."""
        rows = chunk_rows(self.weight.shape[0], gpu_kernels(x.device))
        total = x.new_zeros((), dtype=torch.float32)
        hits = torch.zeros((), dtype=torch.int64, device=x.device)
        for s in range(0, x.shape[0], rows):
            logits = linear(x[s : s + rows], self.weight)
            t, v = targets[s : s + rows], valid[s : s + rows]
            total += ce_chunk(logits, t, v.to(torch.float32), False)[0]
            hits += ((logits.argmax(-1) == t) & v).sum()
        return total, hits

    def compile_loss(self, **options) -> None:  # noqa: ANN003 - torch.compile's
        """Fuse each chunk's elementwise work (log-softmax, softmax, target, mask, cast) into few kernels. A chunk's
        rows differ between calls (the main head's, each MTP depth's, a last partial chunk): compiled for any count
        from the first call, not once for the first count and again, dynamic, when the next one differs."""
        compiled = torch.compile(ce_chunk, **options)

        def chunk_fn(logits, targets, valid, want_grad, mask_grad=True):  # noqa: ANN001, ANN202 - ce_chunk's
            for t in (logits, targets, valid):
                torch._dynamo.maybe_mark_dynamic(t, 0)
            return compiled(logits, targets, valid, want_grad, mask_grad)

        self.chunk_fn = chunk_fn


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


def ce_rows(head: nn.Module, h: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, T) fp32 cross-entropy of each position (0 where not valid), logits never kept (loss.Head); a head
    replaced by a LoRA adapter computes plain logits."""
    shape = valid.shape
    h, valid = h.flatten(0, -2), valid.flatten()
    targets = torch.where(valid, targets.flatten(), 0)
    if isinstance(head, Head):
        return head(h, targets, valid, per_row=True).view(shape)
    ce = F.cross_entropy(head(h).float(), targets, reduction="none")
    return (ce * valid).view(shape)


def target_rows(t: int, labels: torch.Tensor, shift: int) -> int:
    """Positions predicting labels[i + shift]: all t when labels run on past them (a sequence-parallel
    slice's halo), else the first t - shift."""
    return min(t, labels.shape[1] - shift)


def lm_losses(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None,
    token_losses: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The main head's losses of the final hidden states `hidden` (B, T, D, normed; position i predicts
    labels[i + 1]) -> (summed cross-entropy, target count, with `token_losses` each position's cross-entropy
    (B, n) fp32, 0 where not counted, else None). Every family's forward computes its LM loss here, so
    DPO's per-position losses are the same function of the same positions as the summed loss."""
    n = target_rows(hidden.shape[1], labels, 1)
    h, targets, valid = hidden[:, :n], labels[:, 1 : 1 + n], target_mask(labels, position_ids, 1)[:, :n]
    if token_losses:
        rows = ce_rows(head, h, targets, valid)
        return rows.sum(), valid.sum(), rows
    return *ce_sum(head, h, targets, valid), None


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
