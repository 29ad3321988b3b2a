#!/usr/bin/env bash
# README command (2): set up and run the whole test suite (lint included). CI runs exactly this.
# Then the GPU-side logic on the CPU: the model, attention and expert tests and the bf16 2-rank layouts again with every
# kernel decision taking its CUDA branch (DSTRAIN_KERNEL_POLICY=cuda; docs/training.md#on-a-gpu-machine).
# Arguments (a test path, -k ...) run just those, once.
set -euo pipefail
cd "$(dirname "$0")/.."
# Bytecode caches on, where the environment turned them off (PYTHONDONTWRITEBYTECODE): without them each of the
# ~120 processes a run starts compiles dstrain from source and each pytest session rewrites every test module
# again (~20 CPU-s a run). __pycache__/ is ignored by git.
unset PYTHONDONTWRITEBYTECODE
bash launch/setup.sh
.venv/bin/ruff check dstrain tests launch
.venv/bin/ruff format --check dstrain tests launch
pytest=(.venv/bin/python -m pytest -q -ra)
# The oldest tested torch, triton and transformers (.venv-oldest, launch/setup_oldest.sh; dstrain/versions.py): every
# run takes the version-sensitive code there too, in `oldest`: the versions' own checks, the autograd Functions under
# Dynamo (torch 2.11's gave them no gradient), the whole model's capture, transformers parity, the loss, the DSA
# kernels under triton 3.6's interpreter and DeepSpeed's engine in one layout (~60 CPU-s). DSTRAIN_OLDEST=1 runs
# there instead the fuller set `oldest_full` (Inductor's compiles, 20 compiled steps, host syncs: ~140 s more than
# the suite's 10 minutes leave), or the tests the arguments name.
oldest=(tests/test_versions.py tests/test_compiled_functions.py
  tests/test_install.py::test_installing_keeps_an_in_range_torch_that_is_there
  tests/model/deepseek_v3/test_parity.py tests/model/common/test_loss.py tests/model/common/test_dsa_kernels.py
  "tests/model/common/test_experts.py::test_whole_model_compiles_fullgraph_no_host_sync[False]"
  "tests/training/test_multirank.py::test_zero_matches_single_process_reference[2]")
oldest_full=("${oldest[@]}" tests/model/common/test_experts.py::test_whole_model_compiles_fullgraph_no_host_sync
  tests/training/test_compile.py::test_compiled_matches_eager_over_20_steps tests/training/test_syncs.py)
on_oldest=(.venv-oldest/bin/python -m pytest -q -ra)
if [ "${DSTRAIN_OLDEST:-0}" = 1 ]; then
  bash launch/setup_oldest.sh
  [ "$#" -gt 0 ] && oldest_full=("$@")
  OMP_NUM_THREADS=1 exec "${on_oldest[@]}" --durations=30 "${oldest_full[@]}"
fi
if [ "$#" -gt 0 ]; then
  exec "${pytest[@]}" "$@"
fi
# Two sessions side by side, each process on one thread (two OpenMP threads spin when the other session has the other
# core: a 1.4 s test took 47 s): the multi-rank tests (their scenarios in pools of ranks kept for the session,
# tests/helpers/pool.py), and the oldest versions' set, the CUDA-policy pass, the rest, then some multi-rank tests
# (balancing the two; ranks last, so that the session that ends second keeps both cores busy: the one-process policy
# pass last left a core idle for ~40 s). Ranks leave the cores idle while they start and wait, which the other session
# fills. The tests bounded in time (a hang, preemption) come last in the first session. Each session has its own
# temporary folder; the second one's report follows the first's; every session lists its 30 slowest tests.
export OMP_NUM_THREADS=1
tmp=$(mktemp -d)
# The second session's share, sized for a fresh machine, whose empty Inductor cache makes its compile tests the
# slower (~90 s more than with a warm one, against ~10 s for the first): the busiest last. The compiled PP and EP
# layouts (EP2 finds PP2's graphs in the cache) and the memory measurement run in the first, which otherwise ended
# 35-114 s before the second; the DeepSpeed templates' runs and a launcher's config error in the second, which
# ended 15-25 s before the first, and the installed wheel's runs (the second ended 45 s before the first once
# Inductor's C++ went without SIMD).
compiled=tests/training/test_compile.py
moved=("tests/config/test_ds_file.py::test_other_projects_templates_run_or_are_refused_in_one_line"
  "tests/training/test_cli.py::test_config_error_under_launcher_is_one_line"
  "tests/test_install.py::test_wheel_runs_train_export_and_plot_outside_the_checkout"
  "$compiled::test_compiled_matches_eager_over_20_steps"
  "$compiled::test_compiled_layouts_match_one_process[compiled_z3-4]"
  "$compiled::test_compiled_layouts_match_one_process[compiled_tp2-2]")
# The policy pass leaves out the float64 gradient checks, which take no CUDA branch (float64 stays on torch's path
# under either policy: kernels.triton_kernels) and cost ~5 s there for nothing the rest does not check.
f64=tests/model/common/test_dsa.py::test_indexer_gradient_is_the_kl_gradient_in_float64
(
  bash launch/setup_oldest.sh && "${on_oldest[@]}" --durations=10 --basetemp "$tmp/oldest" "${oldest[@]}" &&
    DSTRAIN_KERNEL_POLICY=cuda "${pytest[@]}" --durations=30 --basetemp "$tmp/policy" tests/model/common/test_attention.py \
    tests/model/common/test_experts.py tests/model/deepseek_v3/test_parity.py tests/model/common/test_dsa.py \
    tests/model/common/test_kernels.py tests/parallel/test_layouts.py::test_bf16_layouts_with_overlapped_reductions \
    --deselect "$f64" &&
    "${pytest[@]}" -m "not multirank" --durations=30 --basetemp "$tmp/rest" &&
    "${pytest[@]}" --durations=30 --basetemp "$tmp/moved" "${moved[@]}"
) >"$tmp/rest.log" 2>&1 &
rest=$!
status=0
"${pytest[@]}" -m multirank --durations=30 --basetemp "$tmp/ranks" "${moved[@]/#/--deselect=}" || status=$?
wait "$rest" || status=$?
echo "--- the other session: the oldest tested versions' set, DSTRAIN_KERNEL_POLICY=cuda, the tests not marked multirank," \
  "then ${moved[*]}"
cat "$tmp/rest.log"
rm -rf "$tmp"
exit "$status"
