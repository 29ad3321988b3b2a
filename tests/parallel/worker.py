"""Multi-rank scenarios for tests/parallel/ (run in the test session's pool of ranks, tests/helpers/pool.py):
`run_layout` trains a layout 8 steps on the same global batches (4 rows/step), saves at steps 3 and 6, resumes
from 3 in the same layout and evaluates at the end of both runs; `reshard_run` continues a layout's checkpoint
on another; `finetune_run` and `finetune_bf16` start from a Hugging Face folder.

adam_eps 1e-6: with the default 1e-8, a weight whose gradient is ~1e-9 (a nearly dead MLP neuron of this tiny
model) gets an Adam step of ~lr * g / (|g| + eps) that turns fp32 summation-order noise into a visible
difference; the larger eps keeps the comparison about the layouts, not about that amplification."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.helpers.tiny import ROOT
from tests.helpers.trainer import eval_rows, make_options, make_trainer

GLOBAL_ROWS = 4
# LoRA on every kind of target: attention (under TP: split and replicated linears), shared experts, every
# routed expert, the routers.
# The expert bias moving (tiny_config's speed; LoRA keeps it unless asked): its update is part of the parity.
LORA = (
    "--lora_r 4 --lora_alpha 8 --lora_targets "
    "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,shared_experts,experts,gate --moe_bias_update_speed 0.01"
)
# DeepSeek-V4's LoRA: its default targets (the grouped output projection's used as a weight), every routed expert
V4_LORA = (
    "--lora_r 4 --lora_alpha 8 --lora_targets q_b_proj,kv_proj,o_a_proj,o_b_proj,shared_experts,experts "
    "--moe_bias_update_speed 0.01"
)
# Kimi Linear's LoRA: its default targets (KDA's q/k/v, MLA's kv_b_proj, both outputs, the shared experts) and
# KDA's gates' projections, every routed expert
KIMI_LORA = (
    "--lora_r 4 --lora_alpha 8 --lora_targets "
    "q_proj,k_proj,v_proj,kv_b_proj,o_proj,f_a_proj,f_b_proj,b_proj,g_b_proj,shared_experts,experts "
    "--moe_bias_update_speed 0.01"
)
STEPS = 8  # saved at 3: resumed runs (same or another layout) take 5 steps
DSA = "--dsa_stage sparse --indexer_loss_coef 0.5"  # a coefficient that makes the indexers' share visible
# The warm-up trains the indexers alone: a coefficient that puts their gradient norm past the clip (0.5)
DSA_DENSE = "--dsa_stage dense --indexer_loss_coef 5000"
MUON = "--optimizer muon"
LAYOUTS = {  # name -> flags
    "pp2": "--config zero1 --pp 2",
    "tp2": "--config zero1 --tp 2",
    "tp2_z2": "--config zero2 --tp 2",
    "ep2_z1": "--config zero1 --ep 2",
    "ep2_z2": "--config zero2 --ep 2",
    "dp2_z1": "--config zero1",
    "dp2_z2": "--config zero2",
    "dp2_z3": "--config zero3",
    "dp2_z0": "--config {out}/zero0.json",  # no ZeRO: dstrain's float64 norm, and clipping with it
    "pp2dp2": "--config zero1 --pp 2",
    "tp2dp2": "--config zero2 --tp 2",
    "ep2dp2": "--config zero2 --ep 2",
    "pp2tp2": "--config zero1 --pp 2 --tp 2",
    "dp4_z1": "--config zero1",
    "sp2_z1": "--config zero1 --sp 2",
    "sp2_z2": "--config zero2 --sp 2",
    "sp2_z3": "--config zero3 --sp 2",
    "sp2_ep2": "--config zero2 --sp 2 --ep 2",
    # targets of resumes on another layout (test_layouts.py::test_resume_on_another_layout)
    "dp1_z1": "--config zero1",
    "dp1_z2": "--config zero2",
    "dp1_z3": "--config zero3",
    "dp1_z0": "--config {out}/zero0.json",  # no ZeRO: torch's AdamW holds the moments itself
    "dp4_z2": "--config zero2",
    "dp4_z3": "--config zero3",
    # LoRA (test_layouts.py::test_lora_layouts_match_one_process, and resumed on other layouts)
    "ep2_lora": f"--config zero2 --ep 2 {LORA}",
    "dp1_lora": f"--config zero1 {LORA}",
    "tp2_lora": f"--config zero1 --tp 2 {LORA}",
    # DeepSeek Sparse Attention (test_layouts.py::test_sparse_attention_layouts_match_one_process): the
    # sparse stage, rows of 32 tokens against a top-k of 8; GLM-5's shared layer starts the second stage
    "dsa_z3": f"--config zero3 {DSA}",
    "dsa_pp2": f"--config zero1 --pp 2 {DSA}",
    "glm_pp2": f"--config zero1 --pp 2 {DSA}",
    "dsa_tp2": f"--config zero1 --tp 2 {DSA}",
    "dsa_ep2": f"--config zero2 --ep 2 {DSA}",
    "dsa_sp2": f"--config zero1 --sp 2 {DSA}",
    "dsa_dp1": f"--config zero1 {DSA}",
    # ... and its dense warm-up (test_layouts.py::test_dense_stage_layouts_match_one_process): the KL over every
    # key, its target's heads summed over tensor-parallel ranks, and over sequence-parallel ranks' heads
    "dsa_dense_tp2": f"--config zero1 --tp 2 {DSA_DENSE}",
    "dsa_dense_sp2": f"--config zero1 --sp 2 {DSA_DENSE}",
    # Kimi Linear (KDA + NoPE MLA + V3's MoE): its routed experts over 2 ranks
    "kimi_ep2": "--config zero2 --ep 2",
    "kimi_tp2": "--config zero1 --tp 2",
    "kimi_pp2": "--config zero1 --pp 2",
    "kimi_sp2": "--config zero2 --sp 2",
    "kimi_tp2_lora": f"--config zero1 --tp 2 {KIMI_LORA}",
    # GLM-5.3-Flash (KDA + k-pool DSA + mHC + MoE + MTP), the indexer in its sparse stage
    "glm5n_ep2": f"--config zero2 --ep 2 {DSA}",
    "glm5n_tp2": f"--config zero1 --tp 2 {DSA}",
    "glm5n_pp2": f"--config zero1 --pp 2 {DSA}",
    "glm5n_sp2": f"--config zero2 --sp 2 {DSA}",
    # Muon (test_layouts.py::test_muon_layouts_match_one_process): whole parameters (ZeRO-0), flat ZeRO
    # slices gathered per matrix, experts per EP rank, pipeline stages, sequence-parallel ranks; LoRA factors
    "muon_z0": f"--config {{out}}/zero0.json {MUON}",
    "muon_z1": f"--config zero1 {MUON}",
    "muon_z2": f"--config zero2 {MUON}",
    "muon_z3": f"--config zero3 {MUON}",
    "muon_ep2": f"--config zero2 --ep 2 {MUON}",
    "muon_pp2": f"--config zero1 --pp 2 {MUON}",
    "muon_sp2": f"--config zero2 --sp 2 {MUON}",
    "muon_ep2_lora": f"--config zero2 --ep 2 {MUON} {LORA}",
    "muon_dp1": f"--config zero1 {MUON}",
    # DeepSeek-V4 (test_layouts.py::test_v4_layouts_match_one_process): the CSA indexer in its sparse stage
    "v4_z3": f"--config zero3 {DSA}",
    "v4_ep2": f"--config zero2 --ep 2 {DSA}",
    "v4_pp2": f"--config zero1 --pp 2 {DSA}",
    "v4_sp2": f"--config zero2 --sp 2 {DSA}",
    "v4_tp2": f"--config zero1 --tp 2 {DSA}",
    "v4_tp2_lora": f"--config zero1 --tp 2 {DSA} {V4_LORA}",
    # The GPU configuration on gloo (test_layouts.py::test_bf16_layouts_with_overlapped_reductions): bf16,
    # ZeRO's reductions overlapped with backward (overlap_comm, on by default with CUDA)
    "dp2_bf16": "--config {out}/zero1_overlap.json --precision bf16",
    "pp2_bf16": "--config {out}/zero1_overlap.json --precision bf16 --pp 2",
    "tp2_bf16": "--config {out}/zero1_overlap.json --precision bf16 --tp 2",
    "ep2_bf16": "--config {out}/zero2_overlap.json --precision bf16 --ep 2",
    "muon_ep2_bf16": f"--config {{out}}/zero2_overlap.json --precision bf16 --ep 2 {MUON}",
}
# Layouts whose run is not resumed in the same layout (the suite's time: every V3 layout checks that exact
# resume, which is the layout's, not the model's; DeepSeek-V4 resumes on another layout in RESHARD_DSA; DSA's
# dense stage is its sparse stage's model)
NO_SAME_LAYOUT_RESUME = (
    "glm5n_ep2",
    "glm5n_tp2",
    "glm5n_pp2",
    "glm5n_sp2",
    "v4_z3",
    "v4_ep2",
    "v4_pp2",
    "v4_sp2",
    "v4_tp2",
    "v4_tp2_lora",
    "dsa_dense_tp2",
    "dsa_dense_sp2",
)
# ranks -> (target layout, source layout whose step-3 checkpoint it continues)
RESHARD = {
    1: [("dp1_z1", "dp2_z1"), ("dp1_z2", "dp2_z2"), ("dp1_z3", "dp2_z3"), ("dp1_z1", "ep2_z1")]
    + [("dp1_z1", "pp2"), ("dp1_z1", "tp2"), ("dp1_z0", "dp2_z3"), ("dp1_lora", "ep2_lora")]
    + [("muon_dp1", "muon_ep2")],
    2: [("ep2_z2", "dp2_z2"), ("dp2_z1", "pp2"), ("pp2", "dp2_z1"), ("tp2", "dp2_z1"), ("sp2_z1", "dp2_z1")]
    + [("tp2_lora", "ep2_lora"), ("muon_z3", "muon_pp2")],
    4: [("dp4_z1", "dp2_z1"), ("dp4_z2", "dp2_z2"), ("dp4_z3", "dp2_z3")],
}
# Sparse attention: ranks -> (target, source) as RESHARD
RESHARD_DSA = {
    1: [("dsa_dp1", "dsa_tp2")],
    2: [("dsa_ep2", "dsa_pp2"), ("v4_z3", "v4_pp2")],
}
# Real data (the data package's loader, not GlobalRows): ranks -> runs; 1 rank with GA 4 and 2 ranks with GA 2
# from the start, and 1 rank continuing the 2-rank run's step-3 checkpoint.
DATA = {1: ["data_dp1", "data_dp1@data_dp2"], 2: ["data_dp2"]}


def common(dp: int) -> str:
    micro = 1 if dp > 1 else 2
    ga = GLOBAL_ROWS // (micro * dp)
    return (
        f"--micro_batch_size {micro} --gradient_accumulation_steps {ga} --max_steps {STEPS} --clip_grad 0.5 "
        "--save_every 3 --keep_last 0 --precision fp32 --adam_eps 1e-6 --peak_tflops 1"
    )


# Fine-tuning from a Hugging Face folder (tests/parallel/test_finetune.py): `... OUT --hf FOLDER LAYOUT...`
FINETUNE = {
    "ft_z3": "--config zero3",
    "ft_pp2": "--config zero1 --pp 2",
    "ft_tp2": "--config zero1 --tp 2",
    "ft_ep2": "--config zero2 --ep 2",
    "ft_z3_lora": f"--config zero3 {LORA}",
    "ft_pp2_lora": f"--config zero1 --pp 2 {LORA}",
    "ft_tp2_lora": f"--config zero1 --tp 2 {LORA}",
    "ft_ep2_lora": f"--config zero2 --ep 2 {LORA}",
    "ft_z3_hpz": "--config {out}/zero3_hpz.json",  # ZeRO++ secondary partitions: filled through one rank
}
FT_STEPS = 3


def model_for(layout: str):  # noqa: ANN201 - a dstrain ModelConfig
    """The tiny test model a layout trains: with sparse attention for dsa_* (V3.2) and glm_* (GLM-5),
    DeepSeek-V4 for v4_*."""
    from tests.helpers.tiny import tiny_config, tiny_dsa_config, tiny_v4_config

    if layout.startswith("v4_"):
        return tiny_v4_config()
    if layout.startswith("glm5n_"):
        from tests.helpers.tiny import tiny_glm5_next_config

        return tiny_glm5_next_config()
    if layout.startswith("kimi_"):
        from tests.helpers.tiny import tiny_kimi_linear_config

        return tiny_kimi_linear_config()
    if layout.startswith(("dsa_", "glm_")):
        return tiny_dsa_config(glm=layout.startswith("glm_"))
    return tiny_config()


def trainer(
    flags: str,
    out_dir: str,
    info,  # noqa: ANN001
    resume: str | None = None,
    extra: str = "",
    hf: str | None = None,
    evaluate: bool = False,
    cfg=None,  # noqa: ANN001
):  # noqa: ANN201
    """Train `flags` (a layout) with the common settings for its data-parallel size, on the tiny test model
    (or `cfg`) or the HF folder `hf`."""
    if hf is not None:
        extra = f"{extra} --model {hf}"
    from dstrain.config.plan import prepare
    from tests.helpers.tiny import tiny_config

    cfg = cfg or tiny_config()
    dp = prepare(make_options(flags.split()), info.world_size, model=cfg).dims.data
    opts = make_options(f"{common(dp)} {flags} {extra}".split())  # the layout's flags win (--precision)
    return make_trainer(
        opts, out_dir, info, cfg=cfg, resume=resume, eval_rows=eval_rows() if evaluate else None
    )


def state_bytes(engine) -> int:  # noqa: ANN001
    """Bytes of what the optimizer keeps for this rank: the fp32 master copy of each trained tensor (or ZeRO
    partition) and its state tensors (AdamW's two moments, Muon's momentum; not the step counters)."""
    import torch

    from dstrain.checkpoint.reshard import base_optimizer

    total = 0
    for p, state in base_optimizer(engine).state.items():
        total += p.numel() * 4 if p.dtype == torch.float32 else 0
        total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim())
    return total


def write_configs(info, out: str) -> None:  # noqa: ANN001
    """The DeepSpeed files the layouts name ({out}/zero0.json ...), written by rank 0 for every rank."""
    from dstrain import dist

    if info.rank == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "zero0.json").write_text(json.dumps({"zero_optimization": {"stage": 0}}))
        for stage in (1, 2):
            zero = {"stage": stage, "overlap_comm": True}
            Path(out, f"zero{stage}_overlap.json").write_text(json.dumps({"zero_optimization": zero}))
    dist.barrier()


def run_layout(info, out: str, name: str) -> dict | None:  # noqa: ANN001
    """A pool scenario (tests/helpers/pool.py): train layout `name` STEPS steps into OUT/NAME/straight (saving at
    3 and 6), resume it from step 3 into OUT/NAME/resumed, evaluate at the end of both -> rank 0's figures."""
    write_configs(info, out)
    base = f"{out}/{name}"
    flags = LAYOUTS[name].format(out=out)
    t0 = time.perf_counter()
    tr = trainer(flags, f"{base}/straight", info, evaluate=True, cfg=model_for(name))
    drawn, held = tr.load_stats["bytes_drawn"], held_bytes(tr.model)
    tr.run()
    states = state_bytes(tr.engine)
    wall = time.perf_counter() - t0
    hist = [
        {k: r.get(k) for k in ("loss", "grad_norm", "step_time_s", "tokens_per_s", "mfu", "indexer_loss")}
        for r in tr.history
    ]
    evals = tr.eval_history
    resumed, evals_resumed = None, None
    if name not in NO_SAME_LAYOUT_RESUME:
        tr = trainer(
            flags,
            f"{base}/resumed",
            info,
            resume=f"{base}/straight/checkpoints/step_00000003",
            evaluate=True,
            cfg=model_for(name),
        )
        tr.run()
        resumed, evals_resumed = [r["loss"] for r in tr.history], tr.eval_history
    if info.rank != 0:
        return None
    return {
        "history": hist,
        "resumed": resumed,
        "wall_s": wall,
        "eval": evals,
        "eval_resumed": evals_resumed,
        "fresh": {"drawn": drawn, "held": held},  # rank 0's, fp32 bytes
        "state_bytes": states,  # rank 0's optimizer: fp32 master and state tensors
    }


def reshard_run(info, out: str, src: str, run: str) -> list[dict] | None:  # noqa: ANN001
    """A pool scenario: `TARGET@SOURCE` resumes SOURCE's step-3 checkpoint (under `src`) in layout TARGET to the
    end. `data_*` runs train on text through the data package's loader (GlobalRows elsewhere), GA 4 / ranks;
    with `@SOURCE`, resuming that run's step 3 (under `out`). -> rank 0's (step, loss, grad norm) per step."""
    from tests.helpers.tiny import byte_tokenizer, tiny_config

    write_configs(info, out)
    target, _, source = run.partition("@")
    if target.startswith("data_"):
        flags = (
            f"--config zero1 --data shakespeare --num_workers 0 --micro_batch_size 1 "
            f"--gradient_accumulation_steps {4 // info.world_size} --max_steps 6 --save_every 3 "
            "--keep_last 0 --precision fp32 --adam_eps 1e-6 --clip_grad 0.5 --seed 5"
        )
        resume = f"{out}/{source}/checkpoints/step_00000003" if source else None
        tr = make_trainer(
            make_options(flags.split()),
            f"{out}/{run}",
            info,
            cfg=tiny_config(vocab_size=272),  # the byte tokenizer's specials too
            resume=resume,
            tokenizer=byte_tokenizer(),
        )
    else:
        resume = f"{src}/{source}/straight/checkpoints/step_00000003"
        tr = trainer(
            LAYOUTS[target].format(out=out), f"{out}/{run}", info, resume=resume, cfg=model_for(target)
        )
    tr.run()
    if info.rank != 0:
        return None
    return [{k: r[k] for k in ("step", "loss", "grad_norm")} for r in tr.history]


def held_bytes(model) -> int:  # noqa: ANN001
    """What this rank keeps of the model outside ZeRO-3, in the fp32 source's bytes."""
    from dstrain.model.sources import local_tensors

    return sum(t.numel() * 4 for _, t in local_tensors(model) if not t.is_meta)


def finetune_run(info, out: str, folder: str, name: str) -> dict:  # noqa: ANN001
    """A pool scenario: layout `name` on the HF folder, --max_steps 0 (the loaded weights, checkpointed as they
    are) and FT_STEPS steps -> this rank's histories, load statistics and held bytes."""
    from deepspeed.utils import groups as deepspeed_groups

    from dstrain import dist

    if info.rank == 0:
        hpz = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
        hpz["zero_optimization"]["zero_hpz_partition_size"] = 2
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "zero3_hpz.json").write_text(json.dumps(hpz))
    dist.barrier()
    res = {}
    for steps in (0, FT_STEPS):
        # DeepSpeed creates the ZeRO++ group once per process and asserts on a second zero.Init
        deepspeed_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
        tr = trainer(
            FINETUNE[name].format(out=out),
            f"{out}/{name}/steps{steps}",
            info,
            extra=f"--max_steps {steps}",
            hf=folder,
        )
        tr.run()
        res[steps] = {
            "history": [{k: r[k] for k in ("loss", "grad_norm")} for r in tr.history],
            "load": tr.load_stats,
            "held_bytes": held_bytes(tr.model),
        }
    return res


def finetune_bf16(info, out: str, folder: str) -> dict:  # noqa: ANN001
    """A pool scenario: ZeRO-3 in bf16 on the HF folder: the expert bias must load and stay fp32 (zero.Init casts
    buffers to the training dtype) -> this rank's biases (dtype, values) as loaded and after 2 steps."""
    tr = trainer("--config zero3", f"{out}/z3_bf16", info, extra="--max_steps 2 --precision bf16", hf=folder)
    loaded = [
        (str(r.e_score_correction_bias.dtype), r.e_score_correction_bias.tolist()) for r in tr.model.routers()
    ]
    tr.run()
    trained = [
        (str(r.e_score_correction_bias.dtype), r.e_score_correction_bias.tolist()) for r in tr.model.routers()
    ]
    return {"loaded": loaded, "trained": trained}


# LoRA on a stored FP8 base (tests/parallel/test_stored_base.py): `--base_precision stored` in every layout
STORED_LORA = "--lora_r 8 --lora_alpha 16 --lora_targets q_b_proj,kv_b_proj,o_proj,shared_experts,experts"
STORED = {
    "st_z0": "--config {out}/zero0.json",
    "st_z1": "--config zero1",
    "st_z2": "--config zero2",
    "st_z3": "--config zero3",
    "st_ep2": "--config zero2 --ep 2",
    "st_pp2": "--config zero1 --pp 2",
    "st_tp2": "--config zero1 --tp 2",
    "st_sp2": "--config zero3 --sp 2",
    # the other stored forms: DeepSeek-V4's FP8 (e8m0) and FP4 experts under EP, Kimi-K2.5's INT4 under ZeRO-3
    "v4_st_ep2": "--config zero2 --ep 2 --lora_targets q_b_proj,kv_proj,o_a_proj,o_b_proj,shared_experts,experts",
    "int4_st_z3": "--config zero3",
}


# QAT under expert and tensor parallelism (tests/parallel/test_qat.py): LoRA with every adapted weight and expert
# fake-quantized as the export writes it, on DeepSeek-V4's FP8 + FP4 folder (EP: each rank its experts' scales;
# the base dequantized, or stored) and DeepSeek-V3's FP8 folder (TP: each rank its slice's block scales)
QAT_LORA = {
    "v4": "--lora_targets q_b_proj,kv_proj,o_b_proj,shared_experts,experts --lr 3e-2",
    "v3": "--lora_targets q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,shared_experts,experts --lr 3e-2",
}
QAT = {  # name -> (layout, base precision)
    "v4_qat_one": ("--config zero2", "bf16"),
    "v4_qat_ep2": ("--config zero2 --ep 2", "bf16"),
    "v4_qat_ep2_stored": ("--config zero2 --ep 2", "stored"),
    "v3_qat_one": ("--config zero1", "bf16"),
    "v3_qat_tp2": ("--config zero1 --tp 2", "bf16"),
}


def qat_run(info, out: str, folder: str, name: str) -> dict:  # noqa: ANN001
    """A pool scenario: layout `name` QAT-training FT_STEPS steps -> this rank's history, which of its modules
    fake-quantize, and its final checkpoint."""
    layout, base = QAT[name]
    extra = f"--max_steps {FT_STEPS} --qat on --base_precision {base}"
    flags = f"{STORED_LORA} {QAT_LORA[name[:2]]} {layout}"
    tr = trainer(flags, f"{out}/{name}", info, extra=extra, hf=folder, cfg=model_for(name))
    quantized = [n for n, m in tr.model.named_modules() if "qat" in m._modules]
    tr.run()
    return {
        "history": [{k: r[k] for k in ("loss", "grad_norm")} for r in tr.history],
        "quantized": quantized,
        "checkpoint": f"{out}/{name}/checkpoints/step_{FT_STEPS:08d}",
    }


def stored_run(info, out: str, folder: str, name: str) -> dict:  # noqa: ANN001
    """A pool scenario: layout `name` LoRA-training FT_STEPS steps on the FP8 folder with its base stored (saved
    at step 2; ZeRO-2's also resumed from there) -> this rank's history, the stored weights it holds (part
    dtypes, bytes, its shares of ZeRO-3 partitions) and the resumed losses."""
    from dstrain.model.common.stored import stored_weights

    write_configs(info, out)
    flags = f"{STORED_LORA} {STORED[name].format(out=out)}"  # a layout's own targets win
    # QAT off: the stored base against one process on the dequantized one (QAT trains another function)
    extra = f"--max_steps {FT_STEPS} --base_precision stored --save_every 2 --qat off"
    base = f"{out}/{name}"
    tr = trainer(flags, f"{base}/straight", info, extra=extra, hf=folder, cfg=model_for(name))
    held = {
        n: {"dtypes": {p: str(d) for p, d in w.dtypes.items()}, "bytes": w.nbytes, "source": list(w.source)}
        for n, w in stored_weights(tr.model)
        if not w.is_meta
    }
    params = sorted(n for n, p in tr.model.named_parameters() if not p.is_meta)
    tr.run()
    res = {
        "history": [{k: r[k] for k in ("loss", "grad_norm")} for r in tr.history],
        "held": held,
        "params": params,
    }
    if name == "st_z2":
        tr = trainer(flags, f"{base}/resumed", info, resume=f"{base}/straight/checkpoints/step_00000002",
                     extra=extra, hf=folder)  # fmt: skip
        tr.run()
        res["resumed"] = [r["loss"] for r in tr.history]
    return res
