"""The parallel layout: sizes, their validation (before anything is allocated), and the process groups.

Ranks are laid out as DeepSpeed's PipeModelDataParallelTopology lays them out (pipe outermost, then data,
tensor innermost): rank = stage * (dp * tp) + dp_rank * tp + tp_rank. Expert parallelism splits each data-
parallel group into blocks of `ep` consecutive members (the EP groups, all-to-all); the members at the same
position of every block form an expert-data-parallel group (edp = dp / ep), over which expert gradients are
reduced. This is DeepSpeed's own expert-group layout, so its ZeRO optimizer partitions experts over the same
ranks dstrain dispatches tokens to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dstrain.model import family_of


@dataclass(frozen=True)
class ParallelDims:
    world: int
    """Total ranks."""
    pp: int = 1
    """Pipeline stages."""
    tp: int = 1
    """Tensor-parallel ranks (attention heads, dense and shared-expert MLPs split Megatron-style)."""
    ep: int = 1
    """Expert-parallel ranks: routed experts sharded, tokens dispatched by all-to-all. Divides dp."""
    sp: int = 1
    """Sequence-parallel ranks: consecutive data-parallel ranks that share one data rank, each holding
    seq_len / sp tokens of every row (DeepSpeed's view: data parallel). Divides dp."""

    def __post_init__(self) -> None:
        for name in ("pp", "tp", "ep", "sp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name} {v}: must be a positive integer")
        if self.world % (self.pp * self.tp):
            raise ValueError(
                f"world size {self.world} is not divisible by --pp {self.pp} x --tp {self.tp} = {self.pp * self.tp}"
            )
        if self.dp % self.ep:
            raise ValueError(
                f"--ep {self.ep} must divide the data-parallel size {self.dp} (world {self.world} / (pp x tp))"
            )
        if self.dp % self.sp:
            raise ValueError(
                f"--sp {self.sp} must divide the data-parallel size {self.dp} (world {self.world} / (pp x tp))"
            )

    @property
    def dp(self) -> int:
        return self.world // (self.pp * self.tp)

    @property
    def edp(self) -> int:
        return self.dp // self.ep

    @property
    def data(self) -> int:
        """Data ranks: ranks reading different rows (sequence-parallel ranks share theirs)."""
        return self.dp // self.sp

    def data_coords(self, rank: int) -> tuple[int, int]:
        """-> (data rank, sequence-parallel rank)."""
        return divmod(self.coords(rank)[1], self.sp)

    @property
    def model_parallel(self) -> bool:
        return self.pp > 1 or self.tp > 1 or self.ep > 1

    def coords(self, rank: int) -> tuple[int, int, int]:
        """-> (stage, dp_rank, tp_rank)."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def rank_of(self, stage: int, dp_rank: int, tp_rank: int) -> int:
        return stage * self.dp * self.tp + dp_rank * self.tp + tp_rank

    def describe(self) -> str:
        parts = [f"dp {self.dp}"] + [
            f"{k} {getattr(self, k)}" for k in ("pp", "tp", "ep", "sp") if getattr(self, k) > 1
        ]
        return " x ".join(parts)

    def validate(self, cfg: Any, zero_stage: int, *, offload: bool = False) -> None:
        """One-line ValueErrors for layouts this model (a config of any family) or ZeRO stage cannot take."""
        family = family_of(cfg)
        for layout in ("tp", "pp", "ep", "sp"):  # what a family does not build is refused in its own words
            if getattr(self, layout) > 1:
                family.refuse(layout, f"--{layout} {getattr(self, layout)}")
        if self.tp > 1:
            for name, size in family.tp_sizes(cfg).items():
                if size % self.tp:
                    raise ValueError(f"--tp {self.tp} must divide {name} {size}")
        if self.ep > 1:
            if not cfg.n_routed_experts:
                raise ValueError(f"--ep {self.ep}: the model has no routed experts")
            if cfg.n_routed_experts % self.ep:
                raise ValueError(f"--ep {self.ep} must divide n_routed_experts {cfg.n_routed_experts}")
            if zero_stage == 3:
                raise ValueError(
                    f"--ep {self.ep} with ZeRO-3: expert parallelism needs ZeRO stage 1 or 2 "
                    "(under ZeRO-3 use --ep 1: ZeRO partitions the experts like every other weight)"
                )
        if self.pp > 1:
            if cfg.num_hidden_layers < self.pp:
                raise ValueError(f"--pp {self.pp} exceeds num_hidden_layers {cfg.num_hidden_layers}")
            if zero_stage >= 2:
                raise ValueError(
                    f"--pp {self.pp} with ZeRO-{zero_stage}: DeepSpeed's pipeline engine supports ZeRO stage 0-1 only"
                )
            if cfg.tie_word_embeddings:
                raise ValueError(f"--pp {self.pp}: tie_word_embeddings=true is not supported with pipelining")
        if self.sp > 1:
            if self.pp > 1 or self.tp > 1:
                raise ValueError(f"--sp {self.sp} with --pp/--tp: sequence parallelism combines with data "
                                 "and expert parallelism only")  # fmt: skip
            for name, heads in family.head_counts(cfg).items() if family.splits_heads else ():
                if heads % self.sp:
                    raise ValueError(f"--sp {self.sp} must divide {name} {heads}")
        if self.tp > 1 and zero_stage == 3:
            raise ValueError(f"--tp {self.tp} with ZeRO-3: tensor parallelism supports ZeRO stage 1-2")
        if self.model_parallel and zero_stage == 0:
            raise ValueError(
                f"{self.describe()} with ZeRO-0: pipeline/tensor/expert parallelism needs ZeRO stage 1 or 2 "
                "(dstrain computes the true global grad norm inside the ZeRO optimizer)"
            )
        if self.model_parallel and offload:
            raise ValueError(f"{self.describe()}: offload_optimizer is supported with data parallelism only")


@dataclass
class Groups:
    """This rank's process groups (None where the dimension is 1) and coordinates."""

    dims: ParallelDims
    rank: int
    stage: int
    dp_rank: int
    tp_rank: int
    ep_rank: int
    edp_rank: int
    tp: Any = None
    dp: Any = None
    ep: Any = None
    edp: Any = None
    sp: Any = None
    ranks: dict[str, list[int]] = field(default_factory=dict)


def layout_ranks(dims: ParallelDims) -> dict[str, list[list[int]]]:
    """Every group of every kind, as rank lists (the same on all ranks, as new_group requires)."""
    d = dims
    out: dict[str, list[list[int]]] = {"tp": [], "dp": [], "ep": [], "edp": [], "sp": []}
    for s in range(d.pp):
        for r in range(d.dp):
            out["tp"].append([d.rank_of(s, r, t) for t in range(d.tp)])
        for t in range(d.tp):
            dp_ranks = [d.rank_of(s, r, t) for r in range(d.dp)]
            out["dp"].append(dp_ranks)
            blocks = [dp_ranks[i : i + d.ep] for i in range(0, d.dp, d.ep)]
            out["ep"].extend(blocks)
            out["edp"].extend([list(g) for g in zip(*blocks)])
            out["sp"].extend(dp_ranks[i : i + d.sp] for i in range(0, d.dp, d.sp))
    return out


def build_groups(dims: ParallelDims, rank: int) -> Groups:
    """Collective: every rank creates every group in the same order."""
    import torch.distributed as tdist

    stage, dp_rank, tp_rank = dims.coords(rank)
    g = Groups(dims, rank, stage, dp_rank, tp_rank, ep_rank=dp_rank % dims.ep, edp_rank=dp_rank // dims.ep)
    for kind, lists in layout_ranks(dims).items():
        for ranks in lists:
            group = tdist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                setattr(g, kind, group)
                g.ranks[kind] = ranks
    return g
