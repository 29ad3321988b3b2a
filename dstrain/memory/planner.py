"""`dstrain plan`: predicted memory per GPU of a training run before it starts, a verdict, and the layouts
that would fit (`estimate.py` holds the model of what is predicted).

  dstrain plan --model deepseek-v3 --config zero1 --ep 8 --num_gpus 8 --gpu_memory_gb 80 \\
      --seq_len 4096 --micro_batch_size 1 --activation_checkpointing

Every `dstrain train` option is accepted and resolved exactly as `dstrain train` resolves it (the DeepSpeed
config's "auto" values included) for GPUs (`prepare(..., device_type="cuda")`): bf16 unless the config or
--precision says otherwise, `overlap_comm: "auto"` on. A --model folder needs only its config.json. The last
line is the verdict: `fits: ...` or `does not fit: predicted peak X GiB per rank of G GiB`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator

from dstrain.cmdline import ArgumentParser
from dstrain.config.ds_config import OFFLOADS, muon_refusal, offloaded
from dstrain.config.options import Options, parse_options
from dstrain.config.plan import RunPlan, prepare
from dstrain.errors import ConfigError
from dstrain.model import family_of, get_config, param_counts
from dstrain.parallel import ParallelDims

from .estimate import CHECKPOINTING, GIB, Estimate, Workload, estimate
from .stored import planned_base

LARGER_WORLDS = 7  # when no layout of N GPUs fits, try 2N, 4N, ... up to 128N


@dataclasses.dataclass(frozen=True)
class PlanArgs:
    opts: Options
    num_gpus: int
    gpu_memory_gb: float
    top: int

    @property
    def debug(self) -> bool:
        return self.opts.debug


def parse(argv: list[str]) -> PlanArgs:
    parser = ArgumentParser(
        prog="dstrain plan",
        description="Predicted peak memory per GPU of a training run, a verdict, and the layouts that fit.",
        epilog="Every `dstrain train` option is accepted too (--precision, --gradient_accumulation_steps, "
        "--pp_partition, --recipe, ...), with the same meaning.",
    )
    parser.add_argument("--num_gpus", type=int, required=True, help="GPUs in the run (the world size)")
    parser.add_argument("--gpu_memory_gb", type=float, required=True, help="memory of one GPU, GiB (80 for A100/H100 80GB)")  # fmt: skip
    parser.add_argument("--top", type=int, default=5, help="how many layouts that fit to list (default 5)")
    known, rest = parser.parse_known_args(argv)
    if known.num_gpus < 1 or known.gpu_memory_gb <= 0:
        raise ConfigError(
            f"--num_gpus {known.num_gpus} --gpu_memory_gb {known.gpu_memory_gb}: must be positive"
        )
    return PlanArgs(parse_options(rest), known.num_gpus, known.gpu_memory_gb, known.top)


def gpu_plan(opts: Options, world: int) -> tuple[RunPlan, Workload]:
    """The run as `dstrain train` would resolve it on `world` GPUs, and its workload."""
    base = None
    if os.path.isdir(opts.model.model):  # config.json is all the estimate needs: weights are not required
        try:
            base = get_config(opts.model.model)
        except ValueError as exc:
            raise ConfigError(f"--model {opts.model.model}: {exc}") from None
    try:
        # before the run's checks: a family the estimate does not model is the first thing to say
        cfg = base if base is not None else get_config(opts.model.model)
    except ValueError:
        cfg = None  # not a preset: prepare says so
    try:
        if cfg is not None:
            family_of(cfg).refuse("memory_estimate", f"dstrain plan --model {opts.model.model}")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    release = family_of(cfg).release_quantization.get(opts.model.model) if base is None and cfg else None
    if release and opts.lora.lora_r > 0 and opts.lora.base_precision == "stored":  # no folder to check
        opts = dataclasses.replace(opts, lora=dataclasses.replace(opts.lora, base_precision="auto"))
    plan = prepare(opts, world, device_type="cuda", model=base)
    w = Workload.of(plan)
    if release and opts.lora.lora_r > 0 and opts.lora.base_precision != "bf16":
        # a preset of a quantized release: planned as a LoRA run on the release's folder would hold it
        w = w.replace(stored=planned_base(plan, dict(release)))
    return plan, w


# ------------------------------------------------------------------------------------------ the search
@dataclasses.dataclass(frozen=True)
class Option:
    workload: Workload
    estimate: Estimate

    @property
    def offload(self) -> bool:
        return _offloads(self.workload.zero)

    def cost(self) -> tuple:
        """What a layout costs in speed, lowest first: offloading, recomputation, pipeline/tensor-parallel
        degree, ZeRO stage, smaller micro batches, expert-parallel degree."""
        w = self.workload
        return (self.offload, CHECKPOINTING.index(w.checkpointing), w.dims.pp * w.dims.tp, w.stage,
                -w.micro_batch, w.dims.ep)  # fmt: skip


def _offloads(zero: dict) -> bool:
    return any(offloaded(zero, k) for k in OFFLOADS)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layouts(w: Workload, world: int, offload: bool) -> Iterator[tuple[int, ParallelDims, dict]]:
    """(ZeRO stage, layout, ZeRO section) of every valid layout of `world` GPUs for this model: ZeRO 1-3,
    pipeline, tensor and expert parallel sizes (the sequence-parallel size kept); with `offload`, the
    optimizer (and under ZeRO-3 the parameters) in host memory."""
    cfg = w.model
    zero = {k: v for k, v in w.zero.items() if k not in OFFLOADS}
    for stage, pp, tp in itertools.product((1, 2, 3), _divisors(world), _divisors(world)):
        if world % (pp * tp) or pp > cfg.num_hidden_layers:
            continue
        for ep in _divisors(world // (pp * tp)):
            try:
                dims = ParallelDims(world, pp=pp, tp=tp, ep=ep, sp=w.dims.sp)
                dims.validate(cfg, stage, offload=offload)
            except ValueError:
                continue
            if w.optimizer == "muon" and muon_refusal(dims, offload) is not None:
                continue
            z = dict(zero, stage=stage)
            if offload:
                z["offload_optimizer"] = {"device": "cpu"}
                if stage == 3:
                    z["offload_param"] = {"device": "cpu"}
            yield stage, dims, z


def layouts_that_fit(w: Workload, world: int, capacity: int, offload: bool = False) -> list[Option]:
    """The layouts of `world` GPUs that fit, the cheapest first, each with the least recomputation and then
    the largest micro batch that fits (accumulation keeping the rows per optimizer step)."""
    rows = w.micro_batch * w.grad_accum * w.dims.data
    micros = [m for m in range(w.micro_batch, 0, -1) if w.micro_batch % m == 0]
    found = []
    modes = [m for m in CHECKPOINTING if m in family_of(w.model).checkpointing]
    for stage, dims, zero in layouts(w, world, offload):
        for mode, micro in itertools.product(modes, micros):
            if rows % (micro * dims.data):
                continue
            cand = w.replace(dims=dims, stage=stage, zero=zero, checkpointing=mode, micro_batch=micro,
                             grad_accum=rows // (micro * dims.data))  # fmt: skip
            est = estimate(cand)
            if est.peak <= capacity:
                found.append(Option(cand, est))
                break
    return sorted(found, key=Option.cost)


# ------------------------------------------------------------------------------------------ the report
def describe(w: Workload) -> str:
    parts = [w.dims.describe(), f"ZeRO-{w.stage}"]
    where = [k.removeprefix("offload_") for k in OFFLOADS if offloaded(w.zero, k)]
    if where:
        parts.append("offload " + "+".join(where))
    mode = w.checkpointing if w.checkpointing != "none" else "no"
    return ", ".join(
        [*parts, f"micro batch {w.micro_batch} x GA {w.grad_accum}", f"{mode} activation checkpointing"]
    )


def gib(n: float) -> str:
    return f"{n / GIB:.1f}" if n >= 0.095 * GIB else f"{n / GIB:.2f}"


def report(plan: RunPlan, w: Workload, capacity_gib: float, top: int) -> list[str]:
    capacity = int(capacity_gib * GIB)
    world = w.dims.world
    est = estimate(w)
    counts = param_counts(w.model)
    mtp = " with MTP" if w.model.num_nextn_predict_layers else ""
    lines = [
        f"dstrain plan: {os.path.basename(os.path.normpath(plan.opts.model.model))} ({counts['total'] / 1e9:.1f}B parameters{mtp}, "
        f"{counts['active'] / 1e9:.1f}B active) on {world} x {capacity_gib:g} GiB, {w.precision}, "
        f"{w.micro_batch} x {w.seq_len} tokens per micro batch",
        f"layout: {describe(w)}",
    ]
    if plan.opts.lora.lora_r:
        lines.append(f"LoRA r {plan.opts.lora.lora_r}: {w.trainable:.3%} of the parameters train (gradients and "
                     "optimizer states for those only; the frozen weights are held)")  # fmt: skip
    if w.stored is not None:
        lines.append(f"frozen base held as the release stores it: {w.stored.describe()}; dequantized one layer "
                     "at a time (--base_precision stored, the default under LoRA; bf16 plans it dense)")  # fmt: skip
    lines += [
        "",
        f"{'per rank (the largest; peak in ' + est.phase + ')':<48}{'GiB':>8}",
    ]
    lines += [f"  {name:<46}{gib(value):>8}" for name, value in est.terms.items()]
    lines.append(f"  {'total':<46}{gib(est.peak):>8}")
    if est.host:
        lines.append(f"  {'host memory (offloaded), per rank':<46}{gib(est.host):>8}")
    if len(set(est.per_rank)) > 1:
        lines.append("  per rank: " + " ".join(gib(p) for p in est.per_rank))
    lines.append("")
    lines += fitting(w, world, capacity, capacity_gib, top)
    verdict = "fits" if est.peak <= capacity else "does not fit"
    lines.append(f"{verdict}: predicted peak {gib(est.peak)} GiB per rank of {capacity_gib:g} GiB")
    return lines


def fitting(w: Workload, world: int, capacity: int, capacity_gib: float, top: int) -> list[str]:
    """The layouts of `world` GPUs that fit; failing those, the ones that fit with offloading (and the host
    memory they need) and the smallest larger number of GPUs that fits without."""
    where = f"{world} x {capacity_gib:g} GiB"
    found = layouts_that_fit(w, world, capacity)
    if found:
        return [f"layouts that fit on {where}, fastest first:", *_rows(found[:top], world)]
    lines = [f"no layout of {where} fits without offloading"]
    offloaded = layouts_that_fit(w, world, capacity, offload=True)
    if offloaded:
        lines += [
            "with optimizer states (and ZeRO-3 parameters) in host memory:",
            *_rows(offloaded[:top], world),
        ]
    for k in range(1, LARGER_WORLDS + 1):
        bigger = world << k
        found = layouts_that_fit(w.replace(dims=dataclasses.replace(w.dims, world=bigger)), bigger, capacity)
        if found:
            lines += [f"the fewest GPUs that fit without offloading: {bigger} x {capacity_gib:g} GiB, e.g.:"]
            return lines + _rows(found[:top], bigger)
    return lines + [f"nor on {world << LARGER_WORLDS} GPUs without offloading"]


def _rows(options: list[Option], world: int) -> list[str]:
    per_node = min(world, 8)
    out = []
    for opt in options:
        host = opt.estimate.host
        note = f", host memory {gib(host * per_node)} GiB per {per_node} GPUs" if host else ""
        out.append(f"  {gib(opt.estimate.peak):>6} GiB  {describe(opt.workload)}{note}")
    return out


def run(args: PlanArgs) -> int:
    import torch

    if not torch.cuda.is_available():  # planning needs no accelerator: DeepSpeed need not look for one
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    plan, w = gpu_plan(args.opts, args.num_gpus)
    print("\n".join(report(plan, w, args.gpu_memory_gb, args.top)), flush=True)
    return 0
