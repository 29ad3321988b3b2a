"""One rank's layers as the memory estimate (estimate.py) sums them: each layer's parameter tensors (and those
held stored), its saved activations and its forward and backward temporaries, for the DeepSeek-V3 family
(`Shapes`: V2, V3, V3.2, GLM-5, Kimi-K2); the other families subclass it (v4.py, kimi_linear.py, glm5_next.py).

Activations, from what each op saves for backward (`dstrain/model`; tested against autograd's saved
tensors): RMSNorm its input in fp32 and x·rsqrt(...); MLA the normed inputs and latents, the attention
kernel's q, k, v, output and log-sum-exp; the router fp32 scores and routing indices; the routed experts'
Function only the (tokens·k, 2I) pre-activation and permutation (`experts.py`), under expert parallelism
also the rows received and the fp32 combine input (`parallel/ep.py`); SwiGLU MLPs four (tokens, I)
tensors; each cross-entropy through the head (main and MTP) d input and a head-sized d weight
(`loss.py`). Activation checkpointing keeps a block's (or sublayer's) input and recomputes the rest
during its backward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dstrain.model.common.dsa import SCORE_ELEMENTS
from dstrain.model.common.experts import CPU_GROUP_ROWS
from dstrain.model.common.kernels import CPU_NATIVE_BF16
from dstrain.model.common.loss import chunk_rows

if TYPE_CHECKING:
    from .workload import Workload


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


class Shapes:
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
