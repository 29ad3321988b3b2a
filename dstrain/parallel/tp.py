"""Megatron-style tensor parallelism, applied to a built single-device model by swapping its linears.

Attention: q_b_proj (or q_proj) and kv_b_proj keep the rows of this rank's heads (the model reads heads off
the projections by reshape, so fewer rows mean fewer local heads); o_proj keeps the matching input columns and
its output is all-reduced. q_a_proj, kv_a_proj_with_mqa and the norms stay replicated. The gradient reaching
them must be the sum over every head, so it is all-reduced where replicated tensors enter head-local work: the
inputs of q_b/kv_b, and the shared rotary key k_rope, which leaves kv_a_proj_with_mqa beside the latent and is
used by every head (DeepSpeed's AutoTP misses this one and trains with wrong gradients).
DeepSeek-V4's attention (`_split_v4_attention`) and Kimi Delta Attention (`_split_kda`) keep a rank's heads the
same way. Under QAT each split weight's quantizer keeps its slice's block scales (`_weight`).
MLPs (dense layers and shared experts): gate/up keep rows, down keeps columns, output all-reduced. Routed
experts and the router stay replicated (shard them with expert parallelism). Sparse attention's indexer stays
replicated (its inputs are); the KL's target sums the attention probabilities over every rank's heads.

LoRA adapters follow their base weight's split. A column-split linear keeps the rows of B for its output rows
and the whole A: x A^T enters the split B through `copy_to_group`, so A's gradient (and x's through it) sums
every rank's rows. A row-split linear keeps A's columns for its input slice; the partial x A^T is summed
over the ranks (r wide) before the whole B. A replicated linear keeps whole adapters.

Sharded parameters carry `tp_shard = (dim, rank, size)`: how checkpoints reassemble them and how the global
grad norm counts them (replicated parameters are counted once, sharded ones on every rank).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from dstrain.model.common.kda import KDA, GatedRMSNorm, gated_rms_norm
from dstrain.model.common.kernels import Linear, linear
from dstrain.model.common.layers import MLP
from dstrain.model.common.lora import LoRALinear, merged_weight
from dstrain.model.common.mla import LatentProjections
from dstrain.model.common.stored import StoredWeight, dense_weight
from dstrain.model.deepseek_v4.attention import V4Attention

from .comm import copy_to_group, reduce_from_group, reduce_sum, sync_grad_tail
from .dims import Groups


class ColumnParallelLinear(Linear):
    """Output features split across ranks; the replicated input's gradient is summed over them."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(copy_to_group(x, self.tp_group), _weight(self, x.dtype), self.bias)


class RowParallelLinear(Linear):
    """Input features split across ranks; partial outputs summed (bias added once, after the sum)."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_from_group(linear(x, _weight(self, x.dtype)), self.tp_group)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class RopeKeySyncLinear(Linear):
    """kv_a_proj_with_mqa: replicated, but the gradient of its last `rope_dim` outputs (k_rope) is summed over
    the tensor-parallel ranks, each of which used it for its own heads only."""

    tp_group = None
    rope_dim = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sync_grad_tail(linear(x, _weight(self, x.dtype), self.bias), self.rope_dim, self.tp_group)


class ColumnParallelLoRA(LoRALinear):
    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "qat" in self._modules:  # A is whole on every rank: its gradient sums their rows'
            return linear(copy_to_group(x, self.tp_group), _weight(self, x.dtype, whole="A"), self.bias)
        base = linear(copy_to_group(x, self.tp_group), self.weight, self.bias)
        return base + linear(copy_to_group(linear(x, self.lora_A), self.tp_group), self.lora_B) * self.scale

    def effective_weight(self) -> torch.Tensor:
        """This rank's rows of W + (alpha / r) B A: the whole A serves every rank's rows, so its gradient (a
        weight used as such: V4's grouped output projection) is summed over them."""
        a = copy_to_group(self.lora_A, self.tp_group)
        return dense_weight(self.weight, a.dtype) + (self.lora_B @ a) * self.scale


class SharedGatedNorm(GatedRMSNorm):
    """KDA's output norm under tensor parallelism: one weight over every head's channels, so its gradient sums
    every rank's heads."""

    tp_group = None

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, copy_to_group(self.weight, self.tp_group), self.eps)


class RowParallelLoRA(LoRALinear):
    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "qat" in self._modules:  # B is whole on every rank: its gradient sums their columns'
            out = reduce_from_group(linear(x, _weight(self, x.dtype, whole="B")), self.tp_group)
        else:
            out = reduce_from_group(linear(x, self.weight), self.tp_group)
            xa = reduce_from_group(linear(x, self.lora_A), self.tp_group)
            out = out + linear(xa, self.lora_B) * self.scale
        return out if self.bias is None else out + self.bias.to(out.dtype)


class RopeKeySyncLoRA(LoRALinear):
    tp_group = None
    rope_dim = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "qat" in self._modules:
            out = linear(x, _weight(self, x.dtype), self.bias)
        else:
            out = linear(x, self.weight, self.bias) + self.delta(x)
        return sync_grad_tail(out, self.rope_dim, self.tp_group)


def _weight(m: nn.Module, dtype: torch.dtype, whole: str = "") -> torch.Tensor:
    """The weight a split linear computes with: its own, or under QAT (`qat`, model/quantized.py) this rank's
    slice as the export writes it, with LoRA merged first in fp32 (the adapter factor `whole` on every rank
    passed through copy_to_group, so that its gradient sums every rank's use)."""
    qat = m._modules.get("qat")
    if qat is None:
        return m.weight
    w = dense_weight(m.weight, torch.float32)
    if isinstance(m, LoRALinear):
        a = copy_to_group(m.lora_A, m.tp_group) if whole == "A" else m.lora_A
        b = copy_to_group(m.lora_B, m.tp_group) if whole == "B" else m.lora_B
        w = merged_weight(w, a, b, m.scale)
    return qat(w).to(dtype)


LORA_KIND = {
    ColumnParallelLinear: ColumnParallelLoRA,
    RowParallelLinear: RowParallelLoRA,
    RopeKeySyncLinear: RopeKeySyncLoRA,
}


def _mark(p: nn.Parameter, dim: int, rank: int, size: int) -> None:
    p.tp_shard = (dim, rank, size)
    p.tensor_model_parallel = True  # DeepSpeed's marker, for its own bookkeeping


def _swap(old: nn.Linear, cls: type, dim: int | None, g: Groups) -> Linear:
    """A `cls` holding this rank's slice of `old` along weight dim `dim` (None: the whole weight); the LoRA
    version of `cls` with adapters sliced to match when `old` has adapters."""
    size, rank = g.dims.tp, g.tp_rank
    stored = isinstance(old.weight, StoredWeight)  # a stored base: its slice of whole blocks (stored.py)
    w = old.weight if stored else old.weight.detach()
    bias = old.bias.detach() if old.bias is not None else None
    if dim is not None:
        w = w.tp_slice(dim, rank, size) if stored else w.chunk(size, dim=dim)[rank]
        if bias is not None and dim == 0:
            bias = bias.chunk(size)[rank]
    new = cls(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
    if stored:
        del new.weight
        new.weight = w
    else:
        new.weight = nn.Parameter(w.clone(), requires_grad=old.weight.requires_grad)
    if bias is not None:
        new.bias = nn.Parameter(bias.clone(), requires_grad=old.bias.requires_grad)
    new.tp_group = g.tp
    qat = old._modules.get("qat")  # QAT: the quantizer of this rank's slice (its blocks' scales)
    if qat is not None:
        what = f"{type(old).__name__} {tuple(old.weight.shape)}"
        new.qat = qat if dim is None else qat.tp_slice(dim, rank, size, old.weight.shape[dim], what)
    if dim is not None and not stored:
        _mark(new.weight, dim, rank, size)
        if bias is not None and dim == 0:
            _mark(new.bias, 0, rank, size)
    return _with_adapters(new, old, dim, g) if isinstance(old, LoRALinear) else new


def _with_adapters(new: Linear, old: LoRALinear, dim: int | None, g: Groups) -> LoRALinear:
    """`new` (a swapped base) as its LoRA kind, holding the slices of `old`'s adapters its split needs:
    B's rows under a column split (dim 0), A's columns under a row split (dim 1)."""
    size, rank = g.dims.tp, g.tp_rank
    out = LORA_KIND[type(new)].__new__(LORA_KIND[type(new)])
    nn.Module.__init__(out)
    out.in_features, out.out_features = new.in_features, new.out_features
    out.weight = new.weight
    out.register_parameter("bias", new.bias)
    out.r, out.alpha, out.scale = old.r, old.alpha, old.scale
    out.tp_group = new.tp_group
    if "qat" in new._modules:
        out.qat = new.qat
    for name, split in (("lora_A", dim == 1), ("lora_B", dim == 0)):
        t, t_grad = getattr(old, name).detach(), getattr(old, name).requires_grad
        p = nn.Parameter((t.chunk(size, dim=dim)[rank] if split else t).clone(), requires_grad=t_grad)
        if split:
            _mark(p, dim, rank, size)
        setattr(out, name, p)
    return out


def apply_tensor_parallel(model: nn.Module, g: Groups) -> None:
    if g.dims.tp == 1:
        return
    for module in list(model.modules()):
        if isinstance(module, LatentProjections):  # MLA: DeepSeek's and Kimi Linear's (NoPE)
            cfg = module.cfg
            if cfg.q_lora_rank is None:
                module.q_proj = _swap(module.q_proj, ColumnParallelLinear, 0, g)
            else:
                module.q_b_proj = _swap(module.q_b_proj, ColumnParallelLinear, 0, g)
            module.kv_b_proj = _swap(module.kv_b_proj, ColumnParallelLinear, 0, g)
            module.o_proj = _swap(module.o_proj, RowParallelLinear, 1, g)
            kv_a = _swap(module.kv_a_proj_with_mqa, RopeKeySyncLinear, None, g)
            kv_a.rope_dim = cfg.qk_rope_head_dim
            module.kv_a_proj_with_mqa = kv_a
            if getattr(module, "sparse", None) is not None:
                module.head_sum = functools.partial(reduce_sum, group=g.tp)
        elif isinstance(module, KDA):
            _split_kda(module, g)
        elif isinstance(module, V4Attention):
            _split_v4_attention(module, g)
        elif isinstance(module, MLP):
            module.gate_proj = _swap(module.gate_proj, ColumnParallelLinear, 0, g)
            module.up_proj = _swap(module.up_proj, ColumnParallelLinear, 0, g)
            module.down_proj = _swap(module.down_proj, RowParallelLinear, 1, g)


def _split_v4_attention(module: V4Attention, g: Groups) -> None:
    """DeepSeek-V4: a rank keeps its heads (their query rows and sinks) and the output groups that read them
    (o_a_proj's rows, used as a weight, and o_b_proj's matching columns, output all-reduced); the query's
    low-rank path, the one key=value head and the compressors stay replicated, their gradient summed where every
    head's use meets (`all_heads`). The CSA indexer stays replicated; its target sums every rank's heads."""
    size = g.dims.tp
    module.q_b_proj = _swap(module.q_b_proj, ColumnParallelLinear, 0, g)
    module.o_a_proj = _swap(module.o_a_proj, ColumnParallelLinear, 0, g)
    module.o_b_proj = _swap(module.o_b_proj, RowParallelLinear, 1, g)
    module.sinks = _param_slice(module.sinks, 0, g)
    module.heads //= size
    module.groups //= size
    module.all_heads = functools.partial(copy_to_group, group=g.tp)
    module.head_sum = functools.partial(reduce_sum, group=g.tp)


def _split_kda(module: KDA, g: Groups) -> None:
    """Kimi Delta Attention: a rank keeps its heads: their q/k/v rows and short convolutions' channels (depthwise,
    so channels split freely), the forget gate's and output gate's second projections with dt_bias, A_log and
    b_proj's heads; o_proj's matching columns, its output all-reduced. The gates' first (low-rank) projections
    stay replicated, their gradient summed at the split projections' inputs; the output norm's weight, shared by
    every head, sums its gradient too (`SharedGatedNorm`)."""
    for name in ("q_proj", "k_proj", "v_proj", "f_b_proj", "b_proj", "g_b_proj"):
        setattr(module, name, _swap(getattr(module, name), ColumnParallelLinear, 0, g))
    module.o_proj = _swap(module.o_proj, RowParallelLinear, 1, g)
    for conv in (module.q_conv1d, module.k_conv1d, module.v_conv1d):
        conv.weight = _param_slice(conv.weight, 0, g)
    module.dt_bias = _param_slice(module.dt_bias, 0, g)
    # A_log as the checkpoint holds it: (H,) or (1, 1, H, 1)
    module.A_log = _param_slice(module.A_log, list(module.A_log.shape).index(module.num_heads), g)
    norm = SharedGatedNorm.__new__(SharedGatedNorm)
    norm.__dict__.update(module.o_norm.__dict__)
    norm.tp_group = g.tp
    module.o_norm = norm
    module.num_heads //= g.dims.tp


def _param_slice(p: nn.Parameter, dim: int, g: Groups) -> nn.Parameter:
    """This rank's slice of a parameter along `dim`, marked as a shard."""
    size, rank = g.dims.tp, g.tp_rank
    out = nn.Parameter(p.detach().chunk(size, dim=dim)[rank].clone(), requires_grad=p.requires_grad)
    _mark(out, dim, rank, size)
    return out
