"""Predicted peak memory per rank of a training run, from its resolved plan alone (nothing is allocated).

The layers are the DeepSeek-V3 family's (`_Shapes`) or, where a family registers its own in `SHAPES`, its own
(DeepSeek-V4: v4.py; Kimi Linear: kimi_linear.py; GLM-5.3-Flash: glm5_next.py); everything below them (ZeRO,
the pipeline, the phases) is shared.

What is predicted is the peak of live tensor bytes on one rank's device — `torch.cuda.max_memory_allocated`
on a GPU, `measure.AllocationTracker`'s peak on a CPU — plus, on CUDA, a fixed allowance for the CUDA
context, NCCL and allocator fragmentation (`CUDA_RESERVE`). Each term comes from what the code holds:

- Parameters: the rank's pipeline stage (DeepSpeed's own partitioning of [embedding, blocks..., head +
  MTP]), its tensor-parallel slices (`parallel/tp.py`) and expert-parallel share of the routed experts;
  ZeRO-3 divides them by the data-parallel size, except parameters under its persistence threshold.
- Optimizer states: DeepSpeed's ZeRO optimizers keep an fp32 master copy of their partition (even in fp32)
  and AdamW's two fp32 moments; routed experts are partitioned over the expert-data-parallel group.
  Offloaded states (and ZeRO-3 offloaded parameters) are host memory, reported apart.
- Gradients: ZeRO-2 (and ZeRO-1 with `overlap_comm`) copy them into `reduce_bucket_size`-element buckets
  (two with `overlap_comm`) and keep this rank's partition once the first bucket is reduced; ZeRO-0/1
  without `overlap_comm` and pipeline stages keep every gradient to the end of backward; ZeRO-3 keeps a flat
  partition and one bucket all along. A layer's own gradients exist whole while its backward runs.
- Activations, from what each op saves for backward (`dstrain/model`; tested against autograd's saved
  tensors): RMSNorm its input in fp32 and x·rsqrt(...); MLA the normed inputs and latents, the attention
  kernel's q, k, v, output and log-sum-exp; the router fp32 scores and routing indices; the routed experts'
  Function only the (tokens·k, 2I) pre-activation and permutation (`experts.py`), under expert parallelism
  also the rows received and the fp32 combine input (`parallel/ep.py`); SwiGLU MLPs four (tokens, I)
  tensors; each cross-entropy through the head (main and MTP) d input and a head-sized d weight
  (`loss.py`). Activation checkpointing keeps a block's (or sublayer's) input and recomputes the rest
  during its backward.
- A stored base (LoRA on a quantized release, `--base_precision stored`, `stored.py`): the frozen weights the
  release quantizes are held as its codes and scales instead of parameters (sliced and ZeRO-3-partitioned
  like them), and the running layer's dequantized copy adds to its forward and backward temporaries: a
  linear's fp32 temporaries, and a group of this rank's routed experts of the layer (at most 1 GiB of them in
  fp32, `stored.EXPERT_CHUNK_BYTES`: gate_up and down in the compute dtype while they run, down's fp32
  temporaries while it is dequantized); ZeRO-3 gathers one stored
  weight at a time.
- Working memory: the running layer's temporaries — one chunk of logits and its fp32 log-softmax, the
  experts' gathered rows and intermediates, all-to-all copies, recomputed activations in backward.
- Peak: the static part plus the largest of the forward (activations so far and the running layer's
  temporaries), a walk backward over the layers (activations not yet freed, gradients held, the running
  layer's temporaries and gradients) and the optimizer step (gradient partition, its flat and fp32 copies;
  on gloo the all-gather staging). Pipeline stages hold min(GA, stages - stage) micro batches (1F1B); a
  stage other than the last runs backward once per tensor it sent, with retain_graph, so its activations
  stay until the last of them.

Approximated or not modelled: routing is balanced (uneven expert loads change the rows per rank), plain
causal rows (packed documents add a (B, 1, T, T) mask where SDPA runs them: CUDA without a varlen kernel),
sequence parallelism only divides the tokens, a CPU computing bf16 in fp32 (no bf16 units,
`kernels.CPU_NATIVE_BF16` false: its linears and attention save fp32 copies, 1.6x the bf16 activations of a
tiny model) as the native bf16 path, LoRA's trained share as spread over the layers like the
parameters, torch.compile as eager, and the rope tables, biases and routing counts (well under 1%) are left out.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dstrain.config.ds_config import offloaded
from dstrain.model import ModelConfig
from dstrain.model.common.dsa import SCORE_ELEMENTS
from dstrain.model.common.experts import CPU_GROUP_ROWS
from dstrain.model.common.kernels import CPU_NATIVE_BF16
from dstrain.model.common.loss import chunk_rows
from dstrain.parallel import ParallelDims

from .stored import StoredBase, planned_base

if TYPE_CHECKING:
    from dstrain.config.plan import RunPlan

log = logging.getLogger(__name__)
GIB = 2**30
CUDA_RESERVE = 2 * GIB
"""Per GPU beyond live tensors: the CUDA context and kernels (~0.5-1 GiB), NCCL's buffers, fragmentation."""
CHECKPOINTING = ("none", "mhc", "mlp", "attention", "full")
"""Every family's --activation_checkpointing modes (Family.checkpointing), least recomputation first."""

PARAMS, STATES, GRADS = "parameters", "optimizer states (fp32 master + moments)", "gradients"
ACTS, WORK, BUCKETS = "activations", "working memory", "communication buckets"
GATHERED, RESERVE = "gathered ZeRO-3 parameters", "CUDA context, NCCL, fragmentation"
STORED, DEQUANT = "frozen base, stored (codes + scales)", "dequantized base weights (one layer)"


@dataclass(frozen=True)
class Workload:
    """What the estimate depends on: the model, the layout, the ZeRO settings and the batch shape."""

    model: ModelConfig
    dims: ParallelDims
    stage: int
    precision: str
    """'fp32' or 'bf16'."""
    micro_batch: int
    seq_len: int
    grad_accum: int = 1
    checkpointing: str = "none"
    zero: dict[str, Any] = field(default_factory=dict)
    """The DeepSpeed config's zero_optimization section (DeepSpeed's defaults fill what it leaves out)."""
    device: str = "cuda"
    pp_partition: str = "parameters"
    dsa_stage: str = "sparse"
    """Sparse attention's stage (dense, sparse or frozen): what the indexers and the attention keep."""
    optimizer: str = "adamw"
    """adamw: two fp32 moments per parameter; muon: one momentum buffer for the hidden matrices (AdamW's two
    for the embedding, the head and the vectors), and each matrix gathered whole in fp32 while it steps."""
    trainable: float = 1.0
    """The share of the model's elements that train (LoRA: its adapters, and the routers / MTP if they train):
    gradients, optimizer states and the step scale with it; the frozen base weights are held (and ZeRO-3
    partitions them) but get neither. Taken as spread over the layers like the parameters."""
    stored: StoredBase | None = None
    """A stored base (--base_precision stored): the frozen weights of these kinds are held as their release
    stores them (codes + scales, no parameter) and dequantized one layer at a time."""

    @classmethod
    def of(cls, plan: RunPlan) -> Workload:
        o = plan.opts
        return cls(
            model=plan.model,
            dims=plan.dims,
            stage=plan.stage,
            precision=plan.precision,
            micro_batch=o.layout.micro_batch_size,
            seq_len=o.data.seq_len,
            grad_accum=o.layout.gradient_accumulation_steps,
            checkpointing=o.model.activation_checkpointing,
            zero=dict(plan.ds.get("zero_optimization") or {}),
            device=plan.device_type,
            pp_partition=o.layout.pp_partition,
            dsa_stage=o.model.dsa_stage,
            optimizer=o.optimizer.optimizer,
            trainable=plan.trains[0] / plan.trains[1] if o.lora.lora_r > 0 else 1.0,
            stored=planned_base(plan) if plan.stored_base else None,
        )

    def replace(self, **changes: Any) -> Workload:
        return dataclasses.replace(self, **changes)


@dataclass
class Estimate:
    """Bytes per rank; `terms` sum to `peak`, for the rank that needs the most."""

    peak: int
    terms: dict[str, int]
    phase: str
    """When that rank's peak happens: forward, backward, optimizer step or parameter all-gather."""
    host: int = 0
    """Host memory per rank for offloaded optimizer states and parameters."""
    per_rank: list[int] = field(default_factory=list)


@dataclass
class Layer:
    """One unit of the pipeline layer list, as one rank holds it; bytes are per micro batch."""

    name: str
    tensors: list[int] = field(default_factory=list)
    """Elements of each parameter tensor this rank holds, routed experts apart."""
    experts: int = 0
    """Routed-expert elements this rank holds (partitioned over the expert-data-parallel group)."""
    vectors: int = 0
    """Elements of 1-D tensors (norm gains, biases) among `tensors`."""
    matrices: bool = True
    """Whether its matrices are hidden ones (Muon's); False for the embedding and the head (AdamW's)."""
    saved: int = 0
    """Activations saved for backward."""
    forward: int = 0
    """Temporaries while its forward runs, above what it saves."""
    backward: int = 0
    """Temporaries while its backward runs (recomputed activations included), its gradients apart."""
    stored: list[tuple[int, int]] = field(default_factory=list)
    """(elements, bytes) of each of `tensors` held stored (a stored base: codes + scales, no parameter)."""
    experts_stored: int = 0
    """Bytes of this rank's routed experts held stored (0: parameters)."""
    dequant: tuple[int, int] = (0, 0)
    """Of `forward` and `backward`: the bytes dequantized stored weights add (fp32 temporaries, the weight in
    the compute dtype; the routed experts' whole gate_up and down while they run)."""

    @property
    def dense(self) -> int:
        return sum(self.tensors)

    @property
    def stored_elements(self) -> int:
        """Elements of its weights held stored."""
        return sum(e for e, _ in self.stored) + (self.experts if self.experts_stored else 0)

    @property
    def stored_bytes(self) -> int:
        return sum(b for _, b in self.stored) + self.experts_stored

    @property
    def plain(self) -> list[int]:
        """`tensors` without the stored ones: the parameters (of the base) it holds."""
        out = list(self.tensors)
        for e, _ in self.stored:
            out.remove(e)
        return out

    @property
    def largest_gather(self) -> tuple[int, int]:
        """(elements of the largest parameter, bytes of the largest stored weight) ZeRO-3 gathers whole: a
        matrix, or this rank's experts' gate_up_proj (stored: gate, up and down are gathered one by one)."""
        plain = max([0, *self.plain, 0 if self.experts_stored else 2 * self.experts // 3])
        return plain, max([0, *(b for _, b in self.stored), self.experts_stored // 3])

    @property
    def params(self) -> int:
        return self.dense + self.experts

    @property
    def muon(self) -> int:
        """Elements Muon steps when the run uses it."""
        return self.dense - self.vectors + self.experts if self.matrices else 0


class _Shapes:
    """Parameter and activation sizes of one rank's layers."""

    def __init__(self, w: Workload) -> None:
        self.w, self.cfg = w, w.model
        self.tp, self.ep = w.dims.tp, w.dims.ep
        self.b, self.t = w.micro_batch, w.seq_len // w.dims.sp
        self.n = self.b * self.t  # tokens per micro batch on this rank
        self.a = 4 if w.precision == "fp32" else 2  # bytes of a parameter and an activation
        self.heads = self.cfg.num_attention_heads // self.tp
        self.cpu = w.device == "cpu"
        self._blocks: dict[Any, Layer] = {}

    def boundary_width(self) -> int:
        """Elements per token of the hidden state a pipeline stage sends."""
        return self.cfg.hidden_size

    # parameters ------------------------------------------------------------------------------------------
    def attention_tensors(self) -> list[int]:
        c, h = self.cfg, self.heads
        d, rq, rkv = c.hidden_size, c.q_lora_rank, c.kv_lora_rank
        q = [d * h * c.qk_head_dim] if rq is None else [d * rq, rq, rq * h * c.qk_head_dim]
        kv = [d * (rkv + c.qk_rope_head_dim), rkv, rkv * h * (c.qk_nope_head_dim + c.v_head_dim)]
        bias = [rkv + c.qk_rope_head_dim, d] + ([rq] if rq else []) if c.attention_bias else []
        return q + kv + [h * c.v_head_dim * d] + bias

    def attention_vectors(self) -> int:
        """Elements of the 1-D tensors among `attention_tensors` (the latent norms, the biases)."""
        c = self.cfg
        d, rq, rkv = c.hidden_size, c.q_lora_rank or 0, c.kv_lora_rank
        return rq + rkv + ((rkv + c.qk_rope_head_dim + d + rq) if c.attention_bias else 0)

    def indexer_tensors(self) -> list[int]:
        """The lightning indexer (sparse attention): replicated under tensor parallelism."""
        c = self.cfg
        heads, dim = c.index_n_heads, c.index_head_dim
        return [c.q_lora_rank * heads * dim, c.hidden_size * dim, dim, dim, c.hidden_size * heads]

    def block(self, index: int) -> Layer:
        key = (self.cfg.is_moe_layer(index), self.cfg.has_indexer(index))
        if key not in self._blocks:  # blocks of one kind have the same sizes
            self._blocks[key] = self._block(*key)
        block = self._blocks[key]
        return dataclasses.replace(
            block, name=f"block {index}", tensors=list(block.tensors), stored=list(block.stored)
        )

    def _block(self, moe: bool, indexer: bool = False) -> Layer:
        c, d = self.cfg, self.cfg.hidden_size
        layer = Layer(
            "block", tensors=[d, d, *self.attention_tensors()], vectors=2 * d + self.attention_vectors()
        )
        if indexer:
            layer.tensors += self.indexer_tensors()
            layer.vectors += 2 * c.index_head_dim  # its key LayerNorm
        self.add_ffn(layer, moe)
        self.store(layer, moe, indexer)
        self.block_activations(layer, moe, indexer)
        return layer

    def add_ffn(self, layer: Layer, moe: bool) -> None:
        """A block's MLP tensors: the router, the shared experts (split by tensor parallelism) and this rank's
        routed experts, or the dense MLP."""
        c, d = self.cfg, self.cfg.hidden_size
        if moe:
            shared = c.moe_intermediate_size * c.n_shared_experts // self.tp
            layer.tensors += [c.n_routed_experts * d] + ([d * shared] * 3 if shared else [])
            layer.experts = 3 * (c.n_routed_experts // self.ep) * d * c.moe_intermediate_size
        else:
            layer.tensors += [d * c.intermediate_size // self.tp] * 3

    # a stored base: its sizes are stored.py's (StoredBase) ------------------------------------------------------
    def store(self, layer: Layer, moe: bool, indexer: bool) -> None:
        """The block's weights a stored base holds in their stored form (Workload.stored)."""
        if self.w.stored is not None:
            layer.stored, layer.experts_stored = self.w.stored.block(self.cfg, self.tp, self.ep, moe, indexer)

    def dequantized(self, layer: Layer, moe: bool) -> tuple[int, int, int]:
        """StoredBase.dequantized of this block; zeros without a stored base."""
        if self.w.stored is None:
            return 0, 0, 0
        each = self.cfg.hidden_size * self.cfg.moe_intermediate_size
        local = layer.experts // (3 * each) if moe and layer.experts_stored else 0
        return self.w.stored.dequantized(layer.stored, local, each, self.a)

    def embedding(self) -> Layer:
        c = self.cfg
        # with MTP the embedding runs twice: its second gradient exists until it is added to the first
        again = c.vocab_size * c.hidden_size * self.a if c.num_nextn_predict_layers else 0
        return Layer("embedding", tensors=[c.vocab_size * c.hidden_size], backward=again, matrices=False)

    def head(self) -> Layer:
        """The final norm and the output head (its cross-entropy is `loss`)."""
        c = self.cfg
        d = c.hidden_size
        own = [] if c.tie_word_embeddings else [c.vocab_size * d]
        return Layer(
            "head",
            tensors=[d, *own],
            saved=self.norm(d),
            backward=3 * self.n * d * self.a,
            vectors=d,
            matrices=False,
        )

    def loss(self, name: str) -> Layer:
        """A cross-entropy through the head (loss.py): keeps d input and a head-sized d weight; while it runs,
        one chunk's logits and their fp32 log-softmax (from an fp32 copy of bf16 logits) and the flat input."""
        c, n, a = self.cfg, self.n, self.a
        d, v = c.hidden_size, c.vocab_size
        rows = min(n, chunk_rows(v, not self.cpu))
        chunk = rows * v * (a + 4 + (4 if a == 2 else 0)) + n * d * a
        return Layer(name, saved=n * d * a + v * d * a, forward=chunk, backward=3 * n * d * a)

    def mtp(self, depth: int) -> Layer:
        """MTP depth k: enorm, hnorm, their concatenation (eh_proj's input), a block, shared_head_norm."""
        c = self.cfg
        d = c.hidden_size
        layer = self.block(c.num_hidden_layers + depth - 1)
        layer.name = f"MTP {depth}"
        layer.tensors += [d, d, 2 * d * d, d]
        layer.vectors += 3 * d
        stored = self.w.stored
        if stored is not None and not stored.mtp:  # the MTP modules train: parameters, dense
            layer.forward, layer.backward = (
                layer.forward - layer.dequant[0],
                layer.backward - layer.dequant[1],
            )
            layer.stored, layer.experts_stored, layer.dequant = [], 0, (0, 0)
        elif stored is not None and stored.of("mtp") is not None:
            layer.stored.append((2 * d * d, stored.of("mtp").nbytes(d, 2 * d)))
        layer.saved += self.mtp_saved()
        return layer

    def mtp_saved(self) -> int:
        """What an MTP depth keeps besides its block: enorm, hnorm, their concatenation, shared_head_norm."""
        d = self.cfg.hidden_size
        return 3 * self.norm(d) + self.n * 2 * d * self.a

    # activations -----------------------------------------------------------------------------------------
    def norm(self, width: int) -> int:
        """RMSNorm: its input in fp32 (itself, or an fp32 copy of a bf16 input), x·rsqrt in the activation
        dtype and rsqrt. Its output is counted by whatever saves it."""
        return self.n * width * (4 + self.a) + 4 * self.n

    def attention_saved(self) -> int:
        c, n, a, h = self.cfg, self.n, self.a, self.heads
        d, rq, rkv = c.hidden_size, c.q_lora_rank, c.kv_lora_rank
        out = self.norm(d) + n * d * a  # input_layernorm, and its output (the q and kv projections' input)
        if rq is not None:
            out += self.norm(rq) + n * rq * a
        # fp32: the kv norm's saved input is a view of the whole (latent | rotary key) projection
        out += self.norm(rkv) + (n * c.qk_rope_head_dim * 4 if a == 4 else 0) + n * rkv * a
        qk = n * h * c.qk_head_dim * a
        if self.cpu:  # the CPU kernel's (B * H, T, d) copies of q, k and v, and its output
            core = 2 * qk + 2 * n * h * c.v_head_dim * a
        else:  # SDPA's saved v is a view of kv_b's output, which stays whole
            core = 2 * qk + n * h * (c.qk_nope_head_dim + 2 * c.v_head_dim) * a
        return out + core + 4 * n * h + n * h * c.v_head_dim * a  # + log-sum-exp, o_proj's input

    def sparse_saved(self, indexer: bool) -> int:
        """Sparse attention: the keys chosen (int64, kept for a layer that shares them; on a GPU the Triton
        kernel keeps its int32 usable keys too) and, where the layer has an indexer that learns, its k_norm's
        fp32 input and statistics and the KL's gradient with respect to the indexer's q, k and weights (kept
        for backward, dsa.py)."""
        c, n, a, w = self.cfg, self.n, self.a, self.w
        if not c.sparse_attention:
            return 0
        sparse = w.dsa_stage != "dense" and self.t > c.index_topk
        out = n * min(c.index_topk, self.t) * (8 if self.cpu else 12) if sparse else 0
        if indexer and w.dsa_stage != "frozen":
            heads, dim = c.index_n_heads, c.index_head_dim
            out += n * dim * 4 + 8 * n + (8 * dim if a == 2 else 0)  # k_norm: fp32 input, mean, rstd
            out += n * heads * dim * a + n * dim * a + n * heads * 4  # d q, d k, d w
        return out

    def sparse_work(self) -> int:
        """The indexer's walk over blocks of query rows (dsa.index_pass) on whole rows (sequence parallelism
        gathers them). The torch path: fp32 scores of every head, their ReLU and gradient, the target's
        per-head probabilities, the KL's fp32 blocks. A GPU's Triton path (dsa_kernels, index_kernels: Triton
        comes with torch's CUDA builds): no per-head scores, a block of fp32 scores with their int64 ordered
        keys and masks; learning densely, the target's head-summed block and the KL's fp32 blocks; learning
        sparsely, the chosen keys' scores and the attention's target (B, T, k) fp32 until the KL (fp32 blocks)
        and its gradient's fp32 block. Both grow with T, not T^2: the blocks hold SCORE_ELEMENTS scores at most."""
        c, w = self.cfg, self.w
        if not c.sparse_attention:
            return 0
        t = w.seq_len
        if not self.cpu and (w.dsa_stage == "dense" or t > c.index_topk):
            block = w.micro_batch * max(1, SCORE_ELEMENTS // (w.micro_batch * t)) * t
            out = block * (4 + 8 + 2)
            if w.dsa_stage == "dense":  # target, log q, r, q expm1(r), the gradient's block
                out += 5 * block * 4
            elif w.dsa_stage == "sparse":
                nk, rows = w.micro_batch * t * c.index_topk, block // t
                out += nk * 8 + rows * c.index_topk * 4 * 4 + block * 4
            return out
        heads = max(c.index_n_heads, self.heads)
        rows = max(1, SCORE_ELEMENTS // (w.micro_batch * heads * t))
        block = w.micro_batch * min(rows, t) * t
        return 3 * block * heads * 4 + 4 * block * 4

    def swiglu(self, width: int) -> int:
        """gate, silu(gate), up and their product (the down projection's input)."""
        return 4 * self.n * width * self.a

    def routed_rows(self) -> int:
        """Rows through this rank's experts: tokens x top-k (balanced routing), each expert's group padded
        to CPU_GROUP_ROWS where oneDNN runs bf16 GEMMs (experts.py)."""
        c = self.cfg
        rows = self.n * c.num_experts_per_tok
        if self.cpu and self.a == 2 and CPU_NATIVE_BF16:
            rows += (c.n_routed_experts // self.ep) * (CPU_GROUP_ROWS - 1)
        return rows

    def moe_saved(self) -> int:
        c, n, a = self.cfg, self.n, self.a
        d, e, k, inter = c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size
        # router: fp32 scores, indices, the weights before and after normalisation, the balance loss's sums;
        # in bf16 also the fp32 copies of its input and weight
        out = 4 * n * e + 16 * n * k + 8 * n + (4 * n * d + 4 * e * d if a == 2 else 0)
        rows = self.routed_rows()
        out += 8 * n * k + rows * 2 * inter * a  # permutation, pre-activation
        if self.ep > 1:  # the rows received (and the copy index_copy keeps), their order, the fp32 combine
            out += 2 * rows * d * a + 8 * rows + n * k * d * 4 + 8 * n * k  # input and its index
        if c.n_shared_experts:
            out += self.swiglu(inter * c.n_shared_experts // self.tp)
        return out

    def mlp_work(self, moe: bool) -> tuple[int, int]:
        """-> (the MLP's forward temporaries, its backward's)."""
        c, n, a, d = self.cfg, self.n, self.a, self.cfg.hidden_size
        if moe:
            rows, inter = self.routed_rows(), c.moe_intermediate_size
            # forward: rows gathered and their outputs, silu * up, the fp32 per-token sum; backward: d out
            # and x regathered, silu, products, d h, weighted h, d pre-activation (experts.py)
            fwd = rows * (2 * d + 3 * inter) * a + n * d * 4
            work = rows * (2 * d + 6 * inter) * a
            if self.ep > 1:  # all-to-all send and receive copies of the rows, both ways
                fwd += 2 * rows * d * a
                work += 2 * rows * d * a
            return fwd, work
        inter = c.intermediate_size // self.tp
        return n * inter * a, 3 * n * inter * a

    def block_activations(
        self, layer: Layer, moe: bool, indexer: bool = False, attention: tuple[int, int, int] | None = None
    ) -> None:
        """`attention`: (saved, forward and backward temporaries) of a family's own attention sublayer (Kimi
        Linear's KDA, kimi_linear.py); None: MLA's. (GLM-5.3-Flash's blocks, under mHC: glm5_next.py.)"""
        c, n, a = self.cfg, self.n, self.a
        d = c.hidden_size
        attn = self.attention_saved() + self.sparse_saved(indexer) if attention is None else attention[0]
        ffn = self.moe_saved() if moe else self.swiglu(c.intermediate_size // self.tp)
        mlp = self.norm(d) + n * d * a + ffn  # post_attention_layernorm and its output
        kept = {"none": attn + mlp, "attention": n * d * a + mlp, "mlp": attn + n * d * a, "full": n * d * a}
        recomputed = {"none": 0, "attention": attn, "mlp": mlp, "full": attn + mlp}
        mode = self.w.checkpointing
        layer.saved = kept[mode]
        fwd, work = self.mlp_work(moe)
        heads = n * self.heads * c.qk_head_dim * a  # attention's q/k/v-sized temporaries
        if attention is None:
            attention = (0, 3 * heads + (self.sparse_work() if indexer else 0), 5 * heads)
        linear, held, peak = self.dequantized(layer, moe)
        layer.forward = max(fwd + held, peak, attention[1], linear)
        # + d output, d input and one (tokens, hidden) intermediate
        layer.backward = recomputed[mode] + 3 * n * d * a + max(work + held, peak, attention[2], linear)
        plain = (max(fwd, attention[1]), recomputed[mode] + 3 * n * d * a + max(work, attention[2]))
        layer.dequant = (layer.forward - plain[0], layer.backward - plain[1])


SHAPES: dict[str, type[_Shapes]] = {}
"""Family name -> the sizes of its layers where they are not the DeepSeek-V3 family's (`_Shapes`): v4.py
registers DeepSeek-V4's, kimi_linear.py Kimi Linear's, glm5_next.py GLM-5.3-Flash's, imported with the package
(a family the estimate does not model refuses `memory_estimate` in its Family record)."""


def shapes_of(w: Workload) -> _Shapes:
    """The sizes of the workload's model, by its family."""
    from dstrain.model import family_of

    return SHAPES.get(family_of(w.model).name, _Shapes)(w)


def rank_layers(w: Workload) -> list[list[Layer]]:
    """The layers of each pipeline stage, as DeepSpeed partitions [embedding, blocks..., head + MTP]."""
    shapes, cfg = shapes_of(w), w.model
    tail = [shapes.head(), shapes.loss("loss")]
    for k in range(1, cfg.num_nextn_predict_layers + 1):
        tail += [shapes.mtp(k), shapes.loss(f"MTP {k} loss")]
    items = [[shapes.embedding()], *([shapes.block(i)] for i in range(cfg.num_hidden_layers)), tail]
    pp = w.dims.pp
    if pp == 1:
        return [[layer for item in items for layer in item]]
    parts = _partition(w.pp_partition, pp, tuple(sum(x.params for x in item) for item in items))
    return [[layer for item in items[parts[s] : parts[s + 1]] for layer in item] for s in range(pp)]


@functools.lru_cache(maxsize=1024)
def _partition(spec: str, pp: int, weights: tuple[int, ...]) -> list[int]:
    """DeepSpeed's own stage boundaries over the pipeline layers (cached: its balanced partition is a
    quadratic dynamic program, and the layout search asks for the same ones many times)."""
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    from dstrain.parallel.pipe import parse_partition

    method = parse_partition(spec, pp, len(weights) - 2)
    if method == "parameters":
        return partition_balanced(list(weights), pp)
    return partition_uniform(len(weights), pp) if method == "uniform" else method


@dataclass(frozen=True)
class _Zero:
    """The ZeRO settings that size memory, DeepSpeed's defaults filling what the config leaves out."""

    bucket: int
    overlap: bool
    offload_optimizer: bool
    offload_param: bool
    prefetch: int
    persistence: int
    reuse: int
    sub_group: int

    @classmethod
    def of(cls, w: Workload) -> _Zero:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        z = DeepSpeedZeroConfig(**{**w.zero, "stage": w.stage})
        return cls(
            bucket=int(z.reduce_bucket_size),
            overlap=bool(z.overlap_comm),
            offload_optimizer=offloaded(w.zero, "offload_optimizer"),
            offload_param=offloaded(w.zero, "offload_param"),
            prefetch=int(z.prefetch_bucket_size),
            persistence=int(z.param_persistence_threshold),
            reuse=int(z.max_reuse_distance),
            sub_group=int(z.sub_group_size),
        )


@dataclass
class _Stage:
    """One rank of a pipeline stage: its layers and the sizes every phase shares."""

    w: Workload
    z: _Zero
    layers: list[Layer]
    index: int

    def __post_init__(self) -> None:
        d, layers = self.w.dims, self.layers
        self.a = 4 if self.w.precision == "fp32" else 2
        self.params = sum(x.params for x in layers)
        self.dense, self.experts = sum(x.dense for x in layers) / d.dp, sum(x.experts for x in layers) / d.edp
        self.part = self.dense + self.experts  # this rank's ZeRO partition (elements)
        # a stored base: elements held as codes + scales rather than parameters, and those bytes (ZeRO-3
        # partitions them over the data-parallel group, as it does the parameters)
        self.stored = sum(x.stored_elements for x in layers) / (d.dp if self.w.stage == 3 else 1)
        self.stored_bytes = sum(x.stored_bytes for x in layers) / (d.dp if self.w.stage == 3 else 1)
        self.f = self.w.trainable  # the share with gradients and optimizer states
        muon = self.w.optimizer == "muon"
        self.muon_held = sum(x.muon for x in layers) if muon else 0  # the Muon elements this stage holds
        self.muon = sum(x.muon - x.experts for x in layers) / d.dp + self.experts if muon else 0.0  # its part
        # the largest tensor Muon gathers whole: a matrix, or this rank's experts' gate_up_proj
        self.largest = (
            max((max([*x.tensors, 2 * x.experts // 3]) for x in layers if x.muon), default=0) if muon else 0
        )

    def static(self) -> tuple[dict[str, float], float]:
        """-> (what the whole run holds, host bytes for offloaded states)."""
        w, z, a, part = self.w, self.z, self.a, self.part
        out: dict[str, float] = {}
        host = 0.0
        if w.stage == 3:
            whole = sum(t for x in self.layers for t in x.plain if t <= z.persistence) * a
            held = (part - self.stored) * a
            out[PARAMS] = whole + (0 if z.offload_param else held)
            host += held if z.offload_param else 0
        else:
            out[PARAMS] = (self.params - self.stored) * a
        out[STORED] = self.stored_bytes
        states = part * 12 if w.stage >= 1 else self.params * (12 if a == 2 else 8)
        states -= 4 * (self.muon if w.stage >= 1 else self.muon_held)  # Muon: one fp32 buffer, not two
        states *= self.f
        out[STATES] = 0 if z.offload_optimizer else states
        host += states if z.offload_optimizer else 0
        if w.stage == 3:  # the flat gradient partition and the reduce bucket
            out[GRADS] = 0 if z.offload_optimizer else part * a * self.f
            host += part * 4 * self.f if z.offload_optimizer else 0
            out[BUCKETS] = z.bucket * a
        return out, host

    def earlier(self) -> float:
        """Micro batches in flight on this stage before the one whose peak is taken (1F1B), and the stage's
        input and output tensors each keeps (the MTP look-ahead embeddings among them)."""
        w, d = self.w, self.w.dims
        if d.pp == 1:
            return 0.0
        inflight = min(w.grad_accum, d.pp - self.index)
        sh = shapes_of(w)
        width = sh.boundary_width() * self.a
        ext = sh.b * (sh.t + w.model.num_nextn_predict_layers) * width
        return (inflight - 1) * sum(x.saved for x in self.layers) + inflight * (2 * sh.n * width + ext)

    def gathered(self) -> float:
        """ZeRO-3 gathers each layer's parameters whole; once its trace is known, parameters reused within
        stage3_max_reuse_distance elements stay gathered; gloo stages each all-gather in a buffer of its own."""
        if self.w.stage != 3:
            return 0.0
        largest, stored = (max(sizes) for sizes in zip(*(x.largest_gather for x in self.layers)))
        staged = 2 if self.w.device == "cpu" else 1
        plain = sum(x.params - x.stored_elements for x in self.layers)
        gathered = min(plain, self.z.reuse + largest + self.z.prefetch) + (staged - 1) * largest
        # a stored weight is gathered (all its parts) where it is dequantized, and dropped after
        return gathered * self.a + stored * staged

    def forward(self) -> dict[str, float]:
        """A walk from the first layer; with accumulation, a later micro batch's, on top of the gradients
        (or partition) and the buckets the earlier ones left."""
        live, best = self.earlier(), {ACTS: 0.0, WORK: 0.0}
        for x in self.layers:
            live += x.saved
            if live + x.forward >= sum(best.values()):
                best = {ACTS: live, WORK: x.forward - x.dequant[0], DEQUANT: x.dequant[0]}
        every, holds_all, partition = self._grads()
        if self.w.grad_accum > 1:  # ZeRO-2 releases its buckets at the end of each backward, ZeRO-1 not
            best[GRADS] = every if holds_all else partition
            best[BUCKETS] = self._buckets() if self.w.stage == 1 else 0.0
        return {**best, GATHERED: self.gathered()}

    def _grads(self) -> tuple[float, bool, float]:
        """-> (all gradients' bytes, whether they are all held to the end of backward, the bytes of the
        gradient partition kept otherwise). ZeRO-0, pipeline stages and ZeRO-1 without overlap_comm (or
        accumulating: it reduces at the last micro batch only) hold them all; ZeRO-2 (and ZeRO-1 with
        overlap_comm) keep their partition."""
        w, z, a, d = self.w, self.z, self.a, self.w.dims
        holds_all = d.pp > 1 or w.stage == 0 or (w.stage == 1 and (w.grad_accum > 1 or not z.overlap))
        keeps = (w.stage == 2 or (w.stage == 1 and z.overlap)) and not z.offload_optimizer
        every, partition = self.params * a * self.f, self.part * a * self.f
        return every, holds_all, partition if keeps and not holds_all else 0.0

    def _buckets(self) -> float:
        """ZeRO-1/2's reduce buckets: allocated at the first gradient, freed after the optimizer step."""
        z = self.z
        return z.bucket * self.a * (2 if z.overlap else 1) if self.w.stage in (1, 2) else 0.0

    def backward(self) -> dict[str, float]:
        """A walk from the last layer, gradients as `_grads` says; the partition exists once the first
        bucket is reduced, and with accumulation the earlier micro batches' gradients from the start. A
        stage other than the last keeps its activations (see the top) and has every gradient after the
        first pass, to which the second adds the running layer's."""
        w, z, a, d = self.w, self.z, self.a, self.w.dims
        accumulates = w.grad_accum > 1
        every, holds_all, partition = self._grads()
        retains = d.pp > 1 and self.index < d.pp - 1
        remaining = self.earlier() + sum(x.saved for x in self.layers)
        held = every if holds_all and accumulates else 0.0
        reduced = float(z.bucket) if accumulates else 0.0
        worst: dict[str, float] = {}
        f = self.f
        for x in reversed(self.layers):
            grads = held + x.params * a * f + (partition if reduced >= z.bucket else 0)
            now = {ACTS: remaining, WORK: x.backward - x.dequant[1], DEQUANT: x.dequant[1], GRADS: grads}
            worst = now if sum(now.values()) >= sum(worst.values()) else worst
            remaining -= 0 if retains else x.saved
            held += x.params * a * f if holds_all and not accumulates else 0
            reduced += x.params * f
        if retains:
            x = max(self.layers, key=lambda x: x.backward + x.params * a * f)
            now = {
                ACTS: remaining,
                WORK: x.backward - x.dequant[1],
                DEQUANT: x.dequant[1],
                GRADS: held + x.params * a * f,
            }
            worst = now if sum(now.values()) > sum(worst.values()) else worst
        return {**worst, BUCKETS: self._buckets(), GATHERED: self.gathered()}

    def step(self) -> dict[str, dict[str, float]]:
        """The optimizer step, one parameter group (ZeRO-3: sub-group) at a time: a flattened copy of its
        gradient partition and, in bf16, that copy in fp32 (on the host when the optimizer is offloaded);
        the routed experts are groups of their own under expert parallelism. Then gloo stages the
        all-gather of the updated parameters in a buffer of the whole flat group (NCCL gathers in place)."""
        w, z, a = self.w, self.z, self.a
        out = {}
        if w.stage >= 1 and not z.offload_optimizer:
            group = (max(self.dense, self.experts) if w.dims.ep > 1 else self.part) * self.f
            group = min(group, z.sub_group) if w.stage == 3 else group
            grads = self.part * a * self.f if w.stage < 3 else 0  # ZeRO-3's partition is static
            # Muon: the gathered matrix, its update and Newton-Schulz's temporaries, fp32
            out["optimizer step"] = {
                GRADS: grads,
                WORK: group * (a + (4 if a == 2 else 0)) + 12 * self.largest,
            }
        if w.stage in (1, 2) and w.device == "cpu":
            out["parameter all-gather"] = {BUCKETS: self.params * a * self.f}
        return out

    def peak(self) -> tuple[dict[str, float], str, float]:
        """-> (terms of the peak, its phase, host bytes)."""
        static, host = self.static()
        phases = {"forward": self.forward(), "backward": self.backward(), **self.step()}
        phase = max(phases, key=lambda p: sum(phases[p].values()))
        terms = dict(static)
        for k, v in phases[phase].items():
            terms[k] = terms.get(k, 0) + v
        if self.w.device == "cuda":
            terms[RESERVE] = CUDA_RESERVE
        return terms, phase, host


def estimate(w: Workload) -> Estimate:
    """The predicted peak per rank; `terms` are those of the rank that needs the most."""
    z = _Zero.of(w)
    results = [_Stage(w, z, layers, s).peak() for s, layers in enumerate(rank_layers(w))]
    peaks = [int(sum(terms.values())) for terms, _, _ in results]
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    terms, phase, host = results[worst]
    per_rank = [peaks[w.dims.coords(r)[0]] for r in range(w.dims.world)]
    shown = {k: int(v) for k, v in terms.items() if v}
    return Estimate(peaks[worst], shown, phase, int(host), per_rank)


def device_warning(plan: RunPlan, device: Any, local_ranks: int) -> str | None:
    """One line when the predicted peak per rank exceeds what a rank has: a GPU's total memory, or on a CPU
    this machine's physical memory divided among its local ranks. None when it fits (or cannot be told)."""
    try:
        w = Workload.of(plan)
        peak = max(estimate(w).per_rank)
    except Exception as exc:  # the estimate advises; it never stops a run that may well fit
        log.debug("memory estimate failed: %s", exc)
        return None
    if device.type == "cuda":
        import torch

        have, where = torch.cuda.get_device_properties(device).total_memory, f"the {device} GPU"
    else:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // max(1, local_ranks)
        where = f"this machine's memory per local rank ({local_ranks})"
    if peak <= have:
        return None
    return (
        f"dstrain: warning: predicted peak memory {peak / GIB:.1f} GiB per rank exceeds the {have / GIB:.1f} GiB "
        f"of {where}; `dstrain plan` with these options lists layouts that fit"
    )
