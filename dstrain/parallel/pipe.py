"""Pipeline parallelism: a DeepSpeed PipelineModule made of the model's own modules.

Layers: [Embed, block 0, ..., block L-1, Tail]. What travels between stages (a tuple, as DeepSpeed requires):
hidden states; position ids (packed-document boundaries; int, no gradient); the running sum of the MoE
sequence-balance losses (a scalar with gradient, so each router gets its share back through the pipe); with
MoE layers, the expert loads counted so far (int64, one row per main MoE layer: each stage adds its own rows);
and, with MTP, the embeddings of the inputs extended by the MTP depth (the last stage's MTP modules need the
embeddings of the tokens ahead; padding token 0 exactly as the single-device model pads); and, where GLM-5's
shared sparse-attention layers reuse an earlier layer's key selection, the latest selection (int64: a shared
layer may start a stage). Labels travel as
(labels, global target counts of the step[, what else the objective reads: DPO's target documents]). The
Tail holds the final norm, head and MTP modules; DeepSpeed
calls its `loss`, which runs the model's own `finish` (so losses and loads are the single-device model's, MTP
and aux included) and the objective the pipeline was built with. DeepSeek-V4 travels the same way: its streams (B, T, n, D) as
the hidden states, its token ids for the hash layers, its HC head with the Tail. The pipeline module hands the trainer each
step's detached outputs (`take_outputs`) and each stage's sparse-attention indexer figures
(`take_indexer_stats`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dstrain.model import DeepSeekLM, ModelOutput
from dstrain.model.build import materialize

# (output, global target counts, what else travelled with the labels) -> loss
Objective = Callable[..., torch.Tensor]


class _Context:
    """What the blocks of the current micro batch read besides the hidden states (the model's
    `pipeline_context`: rope and attention layout; DeepSeek-V4's inputs), made once per stage (every layer of a
    stage receives the same position-id tensor)."""

    def __init__(self, lm: DeepSeekLM) -> None:
        self.lm = lm
        self.key: torch.Tensor | None = None
        self.value: tuple = ()

    def __call__(self, pos: torch.Tensor, ids: torch.Tensor | None) -> tuple:
        if self.key is not pos:
            self.key = pos
            self.value = self.lm.pipeline_context(pos, ids)
        return self.value


def _main_moe_rows(lm: DeepSeekLM) -> list[int]:
    """Block index -> row of the load tensor, for the main model's MoE layers (MTP layers come after)."""
    return [i for i in lm.moe_layer_ids if i < len(lm.layers)]


class _Activations:
    """The stage-to-stage tuple: (h, pos, aux[, load][, ext][, sel][, ids]); which optional parts exist is fixed
    by the model (MoE layers in the main model; MTP depth; shared sparse-attention layers; DeepSeek-V4's hash
    layers, which route by the token ids). Also the stage's running sum of its indexers' figures (not sent:
    each stage reports its own)."""

    def __init__(self, lm: DeepSeekLM) -> None:
        self.has_load = bool(_main_moe_rows(lm))
        self.has_ext = len(lm.mtp) > 0
        self.has_sel = "shared" in (getattr(lm.config, "indexer_types", None) or ())
        self.has_ids = any(getattr(b.mlp, "hashed", False) for b in lm.layers)
        self.indexer_stats: torch.Tensor | None = None

    def unpack(self, t: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
        h, pos, aux, *rest = t
        load = rest.pop(0) if self.has_load else None
        ext = rest.pop(0) if self.has_ext else None
        sel = rest.pop(0) if self.has_sel else None
        ids = rest.pop(0) if self.has_ids else None
        return h, pos, aux, load, ext, sel, ids

    def pack(self, h, pos, aux, load, ext, sel=None, ids=None) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
        optional = ((load, self.has_load), (ext, self.has_ext), (sel, self.has_sel), (ids, self.has_ids))
        return (h, pos, aux) + tuple(t for t, has in optional if has)

    def count(self, stats: torch.Tensor | None) -> None:
        if stats is not None:
            stats = stats.detach().cpu()
            self.indexer_stats = stats if self.indexer_stats is None else self.indexer_stats + stats


class Embed(nn.Module):
    def __init__(self, lm: DeepSeekLM, acts: _Activations) -> None:
        super().__init__()
        self.embed_tokens = lm.embed_tokens
        self.depth = len(lm.mtp)
        self.load_shape = (len(_main_moe_rows(lm)), lm.config.n_routed_experts or 0)
        self.acts = acts
        object.__setattr__(self, "_lm", lm)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        input_ids, pos = inputs
        t = input_ids.shape[1]
        # A leaf with a gradient: the pipeline sends back a gradient for every floating tensor it sends.
        aux = torch.zeros((), device=input_ids.device, requires_grad=True)
        load = torch.zeros(self.load_shape, dtype=torch.int64, device=input_ids.device)
        ext = None
        if self.depth:
            ext = _grad_carrying(self.embed_tokens(F.pad(input_ids, (0, self.depth))))
            h = self._lm.streams_of(ext[:, :t].contiguous())
        else:
            h = _grad_carrying(self._lm.streams_of(self.embed_tokens(input_ids)))
        sel = None
        if self.acts.has_sel:  # a shared sparse-attention layer's selection, from the model's own width
            width = self._lm.selection_width(t)
            sel = torch.zeros(*input_ids.shape, width, dtype=torch.int64, device=input_ids.device)
        return self.acts.pack(h, pos, aux, load, ext, sel, input_ids)


def _grad_carrying(t: torch.Tensor) -> torch.Tensor:
    """DeepSpeed runs backward from every floating tensor a stage sends: with frozen weights upstream (LoRA,
    a frozen embedding) it would have no graph, so make it a leaf that takes the gradient and drops it."""
    return t if t.requires_grad else t.detach().requires_grad_()


class BlockLayer(nn.Module):
    def __init__(self, lm: DeepSeekLM, index: int, ctx: _Context, acts: _Activations) -> None:
        super().__init__()
        self.block = lm.layers[index]
        self.index = index
        rows = _main_moe_rows(lm)
        self.row = rows.index(index) if index in rows else None
        self.acts = acts
        object.__setattr__(self, "_lm", lm)  # not a submodule: only this block's weights live here
        object.__setattr__(self, "_ctx", ctx)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        h, pos, aux, load, ext, sel, ids = self.acts.unpack(inputs)
        ctx = self._ctx(pos, ids)
        layout = ctx[
            -1
        ]  # (rope, layout), V4's inputs, GLM-5.3-Flash's context: where the indexers' figures go
        sparse = getattr(self.block.self_attn, "sparse", None)  # linear attention (KDA) has no key selection
        shared = (
            sparse is not None and sparse.source != self.index
        )  # a shared layer: the latest full one's keys
        if sel is not None and shared:
            layout.selections.setdefault(sparse.source, sel)
        h, block_aux, block_load = self._lm.run_block(self.block, h, *ctx)
        if block_aux is not None:
            aux = aux + block_aux.to(aux.dtype)
            row = torch.tensor([self.row], device=load.device)
            load = load.index_add(0, row, block_load.detach().round().to(load.dtype).unsqueeze(0))
        if sparse is not None:
            self.acts.count(layout.stats.get(self.index))
            if sel is not None and sparse.source == self.index:
                sel = layout.selections[self.index]
        return self.acts.pack(_grad_carrying(h), pos, aux, load, ext, sel, ids)


class Tail(nn.Module):
    def __init__(self, lm: DeepSeekLM, ctx: _Context, acts: _Activations, objective: Objective) -> None:
        super().__init__()
        self.norm, self.lm_head, self.mtp = lm.norm, lm.lm_head, lm.mtp
        self.hc_head = getattr(lm, "hc_head", None)  # DeepSeek-V4's collapse of the streams
        self.acts = acts
        self.objective = objective
        self.outputs: list[ModelOutput] = []  # detached outputs of the micro batches since `take_outputs`
        object.__setattr__(self, "_lm", lm)
        object.__setattr__(self, "_ctx", ctx)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return inputs

    def loss(
        self, outputs: tuple[torch.Tensor, ...], labels: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        h, pos, aux, load, ext, _, ids = self.acts.unpack(outputs)
        labels, n_global, *extra = labels  # extra: DPO's target documents (per-position losses wanted)
        t = h.shape[1]
        ctx = self._ctx(pos, ids)
        layout = ctx[-1]
        self._lm.train(self.training)

        def ahead(k: int) -> torch.Tensor:
            return ext[:, k : k + t]

        loads = load.to(torch.float32) if load is not None else None
        more = {"token_losses": True} if extra else {}
        out = self._lm.finish(h, ahead, *ctx, pos, labels, aux, loads, return_logits=False, **more)
        # aux always gets a gradient, even with alpha = 0
        loss = self.objective(out, n_global, *extra) + 0.0 * aux
        if ext is not None:  # so do the embeddings ahead with the MTP loss off (λ = 0: DPO's default)
            loss = loss + 0.0 * ext.sum()
        main = len(self._lm.layers)
        for layer, stats in layout.stats.items():
            if layer >= main:  # the MTP blocks' (the main blocks counted themselves)
                self.acts.count(stats)
        out.pop("indexer_stats", None)
        self.outputs.append(
            ModelOutput({k: (v.detach() if torch.is_tensor(v) else v) for k, v in out.items()})
        )
        return loss


def pipeline_layers(lm: DeepSeekLM, objective: Objective) -> list[nn.Module]:
    ctx, acts = _Context(lm), _Activations(lm)
    return [
        Embed(lm, acts),
        *(BlockLayer(lm, i, ctx, acts) for i in range(len(lm.layers))),
        Tail(lm, ctx, acts, objective),
    ]


def parse_partition(spec: str, pp: int, n_layers: int) -> str | list[int]:
    """'parameters' | 'uniform' | 'B1,B2,...' (first block of stages 1..pp-1) -> DeepSpeed method or parts
    over the pipeline layer list [Embed, blocks..., Tail]."""
    if spec in ("parameters", "uniform"):
        return spec
    try:
        firsts = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(
            f"--pp_partition {spec}: use parameters, uniform or first-block indices like 4,8"
        ) from None
    if len(firsts) != pp - 1 or firsts != sorted(set(firsts)) or firsts[0] < 1 or firsts[-1] >= n_layers:
        raise ValueError(
            f"--pp_partition {spec}: give {pp - 1} increasing block indices in 1..{n_layers - 1}, "
            "the first block of each stage after the first"
        )
    return [0, *(f + 1 for f in firsts), n_layers + 2]


def build_pipeline(
    lm: DeepSeekLM,
    dims: Any,
    partition: str,
    seed: int,
    objective: Objective,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """The PipelineModule. Every rank passes the whole model, built or on the meta device: the other stages'
    layers end on meta (freed), this stage's get memory if they have none (to be filled by the caller).
    `objective` turns the last stage's model output and the step's global target counts into the loss."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    layers = pipeline_layers(lm, objective)
    method = parse_partition(partition, dims.pp, len(lm.layers))
    tail = layers[-1]
    acts = tail.acts

    class _Pipe(PipelineModule):
        def _partition_layers(self, method: str = "uniform") -> None:
            if isinstance(explicit, list):
                self.parts = explicit
                return
            super()._partition_layers(method)

        def _build(self) -> None:
            super()._build()
            materialize(self, device)  # before PipelineModule moves its layers, which meta tensors refuse

        def take_outputs(self) -> list[ModelOutput]:
            """The detached model outputs of the micro batches run since the last call (last stage only;
            empty elsewhere)."""
            if not any(m is tail for m in self.forward_funcs):
                return []
            outputs, tail.outputs = tail.outputs, []
            return outputs

        def take_indexer_stats(self) -> torch.Tensor | None:
            """This stage's sparse-attention indexer figures since the last call (see ModelOutput)."""
            stats, acts.indexer_stats = acts.indexer_stats, None
            return stats

    explicit = method
    pipe = _Pipe(
        layers=layers,
        topology=PipeModelDataParallelTopology(num_pp=dims.pp, num_mp=dims.tp, num_dp=dims.dp),
        loss_fn=tail.loss,
        partition_method=method if isinstance(method, str) else "uniform",
        base_seed=seed,
    )
    local = {id(m) for m in pipe.forward_funcs}
    for layer in layers:
        if id(layer) not in local:
            layer.to("meta")  # another stage's: keep the structure (names, shapes), free the memory
    pipe._layer_specs = []  # it held every layer
    return pipe
