"""Pipeline parallelism: a DeepSpeed PipelineModule made of the model's own modules.

Layers: [Embed, block 0, ..., block L-1, Tail]. What travels between stages (a tuple, as DeepSpeed requires):
hidden states, position ids (packed-document boundaries; int, no gradient), the running sum of the MoE
sequence-balance losses (a scalar with gradient, so each router gets its share back through the pipe) and,
with MTP, the embeddings of the inputs extended by the MTP depth (the last stage's MTP modules need the
embeddings of the tokens ahead; padding token 0 exactly as the single-device model pads). The Tail holds the
final norm, head and MTP modules; DeepSpeed calls its `loss` with the labels, which runs the model's own
`finish` (so losses are the single-device model's, MTP and aux included) and then the trainer's objective.
Expert loads are counted on the stage that owns each MoE layer and read by the trainer after the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dstrain.model.loading import materialize
from dstrain.model.model import DeepSeekLM, ModelOutput, MoE


class _Context:
    """rope and attention layout of the current micro batch, made once per stage (every layer of a stage
    receives the same position-id tensor)."""

    def __init__(self, lm: DeepSeekLM) -> None:
        self.lm = lm
        self.key: torch.Tensor | None = None
        self.value: Any = None

    def __call__(self, pos: torch.Tensor) -> Any:
        if self.key is not pos:
            self.key = pos
            self.value = self.lm.rope_and_layout(pos, pos.shape[0], pos.shape[1], pos.device)
        return self.value


class Embed(nn.Module):
    def __init__(self, lm: DeepSeekLM) -> None:
        super().__init__()
        self.embed_tokens = lm.embed_tokens
        self.depth = len(lm.mtp)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        input_ids, pos = inputs
        t = input_ids.shape[1]
        # A leaf with a gradient: the pipeline sends back a gradient for every floating tensor it sends.
        aux = torch.zeros((), device=input_ids.device, requires_grad=True)
        if not self.depth:
            return _grad_carrying(self.embed_tokens(input_ids)), pos, aux
        ext = _grad_carrying(self.embed_tokens(F.pad(input_ids, (0, self.depth))))
        return ext[:, :t].contiguous(), pos, aux, ext


def _grad_carrying(t: torch.Tensor) -> torch.Tensor:
    """DeepSpeed runs backward from every floating tensor a stage sends: with frozen weights upstream (LoRA,
    a frozen embedding) it would have no graph, so make it a leaf that takes the gradient and drops it."""
    return t if t.requires_grad else t.detach().requires_grad_()


class BlockLayer(nn.Module):
    def __init__(self, lm: DeepSeekLM, index: int, ctx: _Context) -> None:
        super().__init__()
        self.block = lm.layers[index]
        self.index = index
        self.is_moe = isinstance(self.block.mlp, MoE)
        self.load: torch.Tensor | None = None  # summed over the micro batches since the last reset
        object.__setattr__(self, "_lm", lm)  # not a submodule: only this block's weights live here
        object.__setattr__(self, "_ctx", ctx)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        h, pos, aux, *rest = inputs
        rope, layout = self._ctx(pos)
        aux_terms: list[torch.Tensor] = []
        loads: list[torch.Tensor] = []
        h = _grad_carrying(self._lm.run_block(self.block, h, rope, layout, aux_terms, loads))
        if aux_terms:
            aux = aux + aux_terms[0].to(aux.dtype)
            load = loads[0].detach().double()
            self.load = load if self.load is None else self.load + load
        return (h, pos, aux, *rest)


class Tail(nn.Module):
    def __init__(self, lm: DeepSeekLM, ctx: _Context) -> None:
        super().__init__()
        self.norm, self.lm_head, self.mtp = lm.norm, lm.lm_head, lm.mtp
        object.__setattr__(self, "_lm", lm)
        object.__setattr__(self, "_ctx", ctx)
        self.objective: Callable[[Any], torch.Tensor] | None = None  # set by the trainer each step
        self.outputs: list[Any] = []  # detached ModelOutputs of this step's micro batches

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return inputs

    def loss(self, outputs: tuple[torch.Tensor, ...], labels: torch.Tensor) -> torch.Tensor:
        h, pos, aux, *rest = outputs
        t = h.shape[1]
        rope, layout = self._ctx(pos)
        self._lm.train(self.training)

        def ahead(k: int) -> torch.Tensor:
            return rest[0][:, k : k + t]

        out = self._lm.finish(h, ahead, rope, layout, pos, labels, [aux], [], return_logits=False)
        assert self.objective is not None, "the trainer sets Tail.objective before each step"
        loss = self.objective(out) + 0.0 * aux  # aux always gets a gradient, even with alpha = 0
        self.outputs.append(
            ModelOutput({k: (v.detach() if torch.is_tensor(v) else v) for k, v in out.items()})
        )
        return loss


def pipeline_layers(lm: DeepSeekLM) -> list[nn.Module]:
    ctx = _Context(lm)
    return [Embed(lm), *(BlockLayer(lm, i, ctx) for i in range(len(lm.layers))), Tail(lm, ctx)]


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
    lm: DeepSeekLM, dims: Any, partition: str, seed: int, device: str | torch.device = "cpu"
) -> nn.Module:
    """The PipelineModule. Every rank passes the whole model, built or on the meta device: the other stages'
    layers end on meta (freed), this stage's get memory if they have none (to be filled by the caller)."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    layers = pipeline_layers(lm)
    method = parse_partition(partition, dims.pp, len(lm.layers))
    tail = layers[-1]

    class _Pipe(PipelineModule):
        def _partition_layers(self, method: str = "uniform") -> None:
            if isinstance(explicit, list):
                self.parts = explicit
                return
            super()._partition_layers(method)

        def _build(self) -> None:
            super()._build()
            materialize(self, device)  # before PipelineModule moves its layers, which meta tensors refuse

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
