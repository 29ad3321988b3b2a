"""LoRA as a module transform of dstrain's own model (no peft at training time): adapters, their init, merging.

Three kinds of module can be adapted, each keeping its base weights under their own names (checkpoints and
the HF key table are unchanged) and gaining adapter tensors beside them:
- an `nn.Linear` -> LoRALinear: `lora_A` (r, in), `lora_B` (out, r);
- the routed experts (fused 3-D weights) -> LoRAExperts: per expert its own A and B for gate, up and down,
  `{gate,up,down}_lora_{A,B}` (E, r, in) / (E, out, r), run as grouped GEMMs beside the experts' own
  (experts.Adapters), never as a loop over experts;
- the router -> LoRARouter: `lora_A` (r, D), `lora_B` (E, r), applied in fp32 like the router itself.
Freezing the rest and the fine-tuning options live in `dstrain.training.finetune`; `lora.json` and PEFT
adapter folders in `dstrain.checkpoint.lora`.
"""

from __future__ import annotations

import difflib
import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from .experts import Adapters, routed_experts
from .kernels import Linear, linear
from .layers import ROUTER_BUFFERS, Experts, Router
from .qat import qat_experts
from .stored import StoredExperts, dense_weight

EXPERT_PROJ = ("gate", "up", "down")
EXPERT_ADAPTERS = tuple(f"{p}_lora_{ab}" for p in EXPERT_PROJ for ab in "AB")  # experts.Adapters' order


def is_lora_key(name: str) -> bool:
    """Whether a parameter / state-dict key is a LoRA adapter tensor (of any kind above)."""
    return name.endswith(("lora_A", "lora_B"))


def _shape(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape, also when ZeRO-3 has partitioned it (then its data is empty)."""
    return tuple(getattr(p, "ds_shape", None) or p.shape)


def _init_A(a: torch.Tensor, generator: torch.Generator | None) -> None:
    """nn.Linear's init (kaiming_uniform with a=sqrt(5): bound 1/sqrt(fan_in)) for every (r, in) matrix of
    `a`. A tensor- or expert-parallel slice (`tp_shard`/`ep_shard`) gets its part of the whole tensor's
    values, so every layout starts from the adapters one process starts from."""
    shard = getattr(a, "tp_shard", None) or getattr(a, "ep_shard", None)
    shape = list(a.shape)
    if shard:
        shape[shard[0]] *= shard[2]
    full = torch.empty(shape, device=a.device, dtype=a.dtype)
    bound = 1.0 / math.sqrt(shape[-1])
    full.uniform_(-bound, bound, generator=generator)
    a.copy_(full.chunk(shard[2], dim=shard[0])[shard[1]] if shard else full)


class LoRALinear(Linear):
    """A Linear plus a trainable low-rank update: y = W x + b + (alpha / r) · B A x."""

    def __init__(
        self, base: nn.Linear, r: int, alpha: float, generator: torch.Generator | None = None
    ) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        # The same Parameter objects: names, ties and any references elsewhere stay valid.
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.r, self.alpha, self.scale = r, alpha, alpha / r
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, r, device=w.device, dtype=w.dtype))
        if not w.is_meta:
            self.reset_adapter(generator)

    @torch.no_grad()
    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        """A as nn.Linear initialises a weight, B zero: the adapted layer starts equal to the base."""
        _init_A(self.lora_A, generator)
        self.lora_B.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qat = self._modules.get("qat")
        if qat is not None:  # QAT: the merged weight, as the export merges it (fp32) and quantizes it
            merged = merged_weight(
                dense_weight(self.weight, torch.float32), self.lora_A, self.lora_B, self.scale
            )
            return linear(x, qat(merged).to(x.dtype), self.bias)
        return linear(x, self.weight, self.bias) + self.delta(x)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        return linear(linear(x, self.lora_A), self.lora_B) * self.scale

    @torch.no_grad()
    def merge(self) -> None:
        self.weight.copy_(merged_weight(self.weight, self.lora_A, self.lora_B, self.scale))

    def effective_weight(self) -> torch.Tensor:
        """W + (alpha / r) · B A, differentiable: for a caller that uses the weight itself rather than the
        layer (DeepSeek-V4's block-diagonal output projection)."""
        return dense_weight(self.weight, self.lora_A.dtype) + (self.lora_B @ self.lora_A) * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, alpha={self.alpha}"


def qat_expert_weights(
    experts: nn.Module, qat: nn.ModuleDict, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A routed experts module's fused weights as the export writes them (QAT): with LoRA (`scale` not None) each
    expert's base merged with its adapters in fp32 (the export's merge), then fake-quantized. A stored base is
    dequantized whole (every expert of the module at once: QAT's merge needs them all)."""
    base = experts.gate_up_proj
    if isinstance(base, StoredExperts):
        gate_up, down = base.weights(torch.float32)(0, base.shape[0])
    else:
        gate_up, down = base, experts.down_proj
    if scale is not None:
        parts = {"gate_up_proj": gate_up.float(), "down_proj": down.float()}
        merged = merge_expert_tensors(parts | {n: getattr(experts, n) for n in EXPERT_ADAPTERS}, scale)
        gate_up, down = merged["gate_up_proj"], merged["down_proj"]
    return qat_experts(qat, gate_up, down)


class LoRAExperts(Experts):
    """Routed experts plus per-expert adapters on gate, up and down (see experts.Adapters for the math)."""

    def __init__(self, base: Experts, r: int, alpha: float, generator: torch.Generator | None = None) -> None:
        nn.Module.__init__(self)
        self.gate_up_proj, self.down_proj = base.gate_up_proj, base.down_proj
        self.limit = base.limit
        self.r, self.alpha, self.scale = r, alpha, alpha / r
        e, two_i, d = _shape(base.gate_up_proj)
        i = two_i // 2
        shapes = {"gate": (i, d), "up": (i, d), "down": (d, i)}  # (out, in) of each projection
        like = base.gate_up_proj
        for proj, (out, inp) in shapes.items():
            for name, shape in ((f"{proj}_lora_A", (e, r, inp)), (f"{proj}_lora_B", (e, out, r))):
                setattr(self, name, nn.Parameter(torch.empty(shape, device=like.device, dtype=like.dtype)))
        if not like.is_meta:
            self.reset_adapter(generator)

    def adapters(self) -> Adapters:
        return Adapters(*(getattr(self, n) for n in EXPERT_ADAPTERS))

    @torch.no_grad()
    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        for proj in EXPERT_PROJ:
            _init_A(getattr(self, f"{proj}_lora_A"), generator)
            getattr(self, f"{proj}_lora_B").zero_()

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        qat = self._modules.get("qat")
        if qat is not None:  # QAT: each expert's merged weights (as the export merges them), fake-quantized
            gate_up, down = qat_expert_weights(self, qat, self.scale)
            return routed_experts(x, idx, weights, gate_up.to(x.dtype), down.to(x.dtype), limit=self.limit)
        return routed_experts(
            x, idx, weights, self.gate_up_proj, self.down_proj, self.adapters(), self.scale, self.limit
        )

    @torch.no_grad()
    def merge(self) -> None:
        merged = merge_expert_tensors(
            {"gate_up_proj": self.gate_up_proj, "down_proj": self.down_proj}
            | {n: getattr(self, n) for n in EXPERT_ADAPTERS},
            self.scale,
        )
        self.gate_up_proj.copy_(merged["gate_up_proj"])
        self.down_proj.copy_(merged["down_proj"])

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}"


class LoRARouter(Router):
    """The router plus a low-rank update of its weight, in fp32 like the routing itself."""

    def __init__(self, base: Router, r: int, alpha: float, generator: torch.Generator | None = None) -> None:
        nn.Module.__init__(self)
        self.cfg = base.cfg
        self.weight = base.weight
        _share_buffers(base, self)
        self.r, self.alpha, self.scale = r, alpha, alpha / r
        w = base.weight
        e, d = _shape(w)
        self.lora_A = nn.Parameter(torch.empty(r, d, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.empty(e, r, device=w.device, dtype=w.dtype))
        if not w.is_meta:
            self.reset_adapter(generator)

    reset_adapter = LoRALinear.reset_adapter
    merge = LoRALinear.merge

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        delta = F.linear(F.linear(x, self.lora_A.float()), self.lora_B.float()) * self.scale
        return F.linear(x, self.weight.float()) + delta


def _share_buffers(base: Router, out: Router) -> None:
    """`out` holds `base`'s routing buffers (the same tensors), or None where `base` has none."""
    for name in ROUTER_BUFFERS:
        buf = getattr(base, name, None)
        if buf is not None:
            out.register_buffer(name, buf)
        elif hasattr(base, name):
            setattr(out, name, None)


_ROUTER_KINDS: dict[type, type] = {Router: LoRARouter}


def adapted_router(cls: type[Router]) -> type[LoRARouter]:
    """The adapted kind of a router class: its own routing (DeepSeek-V4's scores, hash tables) with
    LoRARouter's logits."""
    if cls not in _ROUTER_KINDS:
        _ROUTER_KINDS[cls] = type(f"LoRA{cls.__name__}", (LoRARouter, cls), {})
    return _ROUTER_KINDS[cls]


def _router_base(m: LoRARouter) -> type[Router]:
    return next(c for c in type(m).__mro__ if issubclass(c, Router) and not issubclass(c, LoRARouter))

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}"


ADAPTED = (LoRALinear, LoRAExperts, LoRARouter)


def _unadapted(m: nn.Module) -> nn.Module:
    """The plain module an adapted one came from, sharing its base tensors."""
    if isinstance(m, LoRAExperts):
        out = Experts.__new__(Experts)
        nn.Module.__init__(out)
        out.gate_up_proj, out.down_proj, out.limit = m.gate_up_proj, m.down_proj, m.limit
        return out
    if isinstance(m, LoRARouter):
        cls = _router_base(m)
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.cfg, out.weight = m.cfg, m.weight
        _share_buffers(m, out)
        return out
    out = Linear.__new__(Linear)
    nn.Module.__init__(out)
    out.in_features, out.out_features = m.in_features, m.out_features
    out.weight = m.weight
    out.register_parameter("bias", m.bias)
    return out


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def target_names(model: nn.Module) -> list[str]:
    """The names a LoRA target can be in this model: its linears' own names, `experts`, `gate`."""
    names = {
        n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear | Experts | Router)
    }
    return sorted(names - {""})


def match_targets(model: nn.Module, targets: list[str]) -> list[str]:
    """Names of the modules `targets` select: a target matches an nn.Linear whose dotted name has it as a
    component (the module itself, or anything inside a module of that name), or the routed experts
    (`experts`) and the routers (`gate`) by their own names."""
    if not targets:
        raise ValueError("no LoRA targets given")
    modules = dict(model.named_modules())
    chosen: set[str] = set()
    for t in targets:
        named = {
            n for n, m in modules.items() if n.rpartition(".")[2] == t and isinstance(m, Experts | Router)
        }
        hits = named | {n for n, m in modules.items() if isinstance(m, nn.Linear) and t in n.split(".")}
        if not hits:
            kinds = sorted({type(m).__name__ for n, m in modules.items() if n.rpartition(".")[2] == t})
            if kinds:
                raise ValueError(
                    f"{t!r} ({'/'.join(kinds)}) cannot take LoRA: linears, the routed experts and the router can"
                )
            names = target_names(model)
            near = difflib.get_close_matches(t, names, n=1, cutoff=0.6)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ValueError(f"{t!r} matches no module of this model ({hint}its targets: {', '.join(names)})")
        chosen |= hits
    return sorted(chosen, key=list(modules).index)


def apply_lora(model: nn.Module, r: int, alpha: float, targets: list[str], seed: int = 0) -> list[str]:
    """Replace the targeted modules by their adapted kinds (base weights kept, same names); returns their
    module names. Only the adapters require grad afterwards; A is initialised from `seed` and the module name
    alone, identically on every rank and in every layout."""
    if r <= 0:
        raise ValueError(f"LoRA rank r={r}: must be > 0")
    if alpha <= 0:
        raise ValueError(f"LoRA alpha={alpha}: must be > 0")
    names = match_targets(model, targets)
    for name in names:
        if isinstance(model.get_submodule(name), ADAPTED):
            raise ValueError(f"{name} already has a LoRA adapter")
        if name == "lm_head" and model.config.tie_word_embeddings:
            raise ValueError(
                "lm_head is tied to embed_tokens: a LoRA on it would untie them; drop the target"
            )
    for p in model.parameters():
        p.requires_grad = False
    for name in names:
        base = model.get_submodule(name)
        kind = (
            LoRAExperts
            if isinstance(base, Experts)
            else adapted_router(type(base))
            if isinstance(base, Router)
            else LoRALinear
        )
        like = next(base.parameters(), None)
        like = next(base.buffers()) if like is None else like  # a stored base has buffers only
        _replace(model, name, kind(base, r, alpha, _adapter_generator(name, seed, like)))
    model.lora_settings = {"r": r, "alpha": alpha, "targets": list(targets), "modules": names}
    return names


def _adapter_generator(name: str, seed: int, like: torch.Tensor) -> torch.Generator | None:
    """One generator per adapted module, seeded by its name: the same A on every rank and in every layout."""
    if like.is_meta:
        return None
    return torch.Generator(device=like.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def init_adapters(model: nn.Module, seed: int) -> None:
    """(Re)initialise the adapters of a model whose LoRA modules were made on the meta device, then given
    memory (the parallel loading path); other pipeline stages' adapters stay on meta. Parallel layouts keep
    the whole adapters' values: a rank's slices are cut from them (`full_adapters`)."""
    for name, m in lora_modules(model).items():
        first = next(p for n, p in m.named_parameters() if is_lora_key(n))
        if not first.is_meta:
            m.reset_adapter(_adapter_generator(name, seed, first))


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The adapted modules (any kind above, and the parallel layouts' versions of them), by name."""
    return {
        n: m
        for n, m in model.named_modules()
        if any(is_lora_key(p) for p, _ in m.named_parameters(recurse=False))
    }


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model for a while, with no second copy of it (DPO's reference): every adapter's scale is 0,
    so each adapted layer adds B A x times 0, exactly nothing, to its base output."""
    mods = [m for m in lora_modules(model).values() if isinstance(getattr(m, "scale", None), float)]
    saved = [m.scale for m in mods]
    try:
        for m in mods:
            m.scale = 0.0
        yield
    finally:
        for m, scale in zip(mods, saved, strict=True):
            m.scale = scale


def set_trainable(
    model: nn.Module, train_router: bool, train_mtp: bool, dsa_stage: str | None = None
) -> None:
    """After apply_lora (or without it): the MTP modules' own weights and every router's weight trainable or
    frozen (a LoRA base weight stays frozen whatever train_mtp says), then the sparse-attention stage's
    freezing: the dense warm-up trains the lightning indexers alone, the frozen stage everything but them."""
    adapted = {
        id(p) for m in lora_modules(model).values() for n, p in m.named_parameters() if not is_lora_key(n)
    }
    for p in model.mtp.parameters():
        if id(p) not in adapted:
            p.requires_grad = train_mtp
    for router in model.modules():  # every gate: V4's hash layers' too (routers() lists the biased ones)
        if isinstance(router, Router) and not isinstance(router, LoRARouter):
            router.weight.requires_grad = train_router
    indexers = {id(p) for indexer in model.indexers() for p in indexer.parameters()}
    if dsa_stage == "dense":
        for p in model.parameters():
            p.requires_grad = p.requires_grad and id(p) in indexers
    elif dsa_stage == "frozen":
        for p in model.parameters():
            p.requires_grad = p.requires_grad and id(p) not in indexers


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors, by state-dict key (`<module>.lora_A`, `<experts>.gate_lora_A`, ...), detached."""
    return {k: v.detach() for k, v in model.state_dict().items() if is_lora_key(k)}


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale · B A (batched over leading expert dims), computed in fp32 and returned in W's dtype."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)


def merge_expert_tensors(parts: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """Routed experts' `gate_up_proj`, `down_proj` and six adapters -> the merged `gate_up_proj` and
    `down_proj`: per expert e, W_e + scale · B_e A_e for gate, up and down."""
    gate_up, down = parts["gate_up_proj"], parts["down_proj"]
    i = gate_up.shape[1] // 2
    gate = merged_weight(gate_up[:, :i], parts["gate_lora_A"], parts["gate_lora_B"], scale)
    up = merged_weight(gate_up[:, i:], parts["up_lora_A"], parts["up_lora_B"], scale)
    return {
        "gate_up_proj": torch.cat([gate, up], dim=1),
        "down_proj": merged_weight(down, parts["down_lora_A"], parts["down_lora_B"], scale),
    }


def adapted_parts(module: str) -> tuple[str, ...]:
    """The state-dict leaves (base weights first, then adapters) an adapted module of this name holds."""
    if module.rpartition(".")[2] == "experts":
        return ("gate_up_proj", "down_proj", *EXPERT_ADAPTERS)
    return ("weight", "lora_A", "lora_B")


def merge_parts(module: str, parts: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """One adapted module's tensors (leaf -> tensor, as `adapted_parts`) -> its merged base weights."""
    if module.rpartition(".")[2] == "experts":
        return merge_expert_tensors(parts, scale)
    return {"weight": merged_weight(parts["weight"], parts["lora_A"], parts["lora_B"], scale)}


@torch.no_grad()
def merge_lora(model: nn.Module) -> list[str]:
    """Fold every adapter into its base weights in place and restore plain modules; returns the merged names."""
    merged = lora_modules(model)
    for name, m in merged.items():
        m.merge()
        _replace(model, name, _unadapted(m))
    if hasattr(model, "lora_settings"):
        del model.lora_settings
    return list(merged)
