"""Predicted peak memory per rank of a training run, from its resolved plan alone (nothing is allocated).

The layers' sizes are the model family's (`SHAPES`: shapes.py for the DeepSeek-V3 family, v4.py, kimi_linear.py,
glm5_next.py); everything below them (ZeRO, the pipeline, the phases) is shared.

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
- Activations and the running layer's temporaries, layer by layer: shapes.py (the DeepSeek-V3 family's;
  v4.py, kimi_linear.py and glm5_next.py the other families').
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

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dstrain.config.ds_config import offloaded

from .glm5_next import Glm5NextShapes
from .kimi_linear import KimiLinearShapes
from .shapes import Layer, Shapes
from .v4 import V4Shapes
from .workload import Workload

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


SHAPES: dict[str, type[Shapes]] = {
    "deepseek_v4": V4Shapes,
    "kimi_linear": KimiLinearShapes,
    "glm5_next": Glm5NextShapes,
}
"""Family name -> the sizes of its layers where they are not the DeepSeek-V3 family's (`Shapes`); a family the
estimate does not model refuses `memory_estimate` in its Family record."""


def shapes_of(w: Workload) -> Shapes:
    """The sizes of the workload's model, by its family."""
    from dstrain.model import family_of

    return SHAPES.get(family_of(w.model).name, Shapes)(w)


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
