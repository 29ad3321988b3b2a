#!/usr/bin/env bash
# Create or reuse .venv and install dstrain into it. Safe to run repeatedly: it reinstalls only when
# pyproject.toml changed since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  # without pip: ensurepip's copy took 5 of a fresh setup's ~40 s; uv installs pip below (ensurepip where uv
  # is not to be had). An interpreter holding a torch in the tested range (a GPU cluster's: dstrain/versions.py)
  # lends it to the venv, which keeps it.
  system=()
  if "$PY" dstrain/versions.py torch 2>/dev/null; then system=(--system-site-packages); fi
  "$PY" -m venv --without-pip ${system[@]+"${system[@]}"} .venv
fi
# Bytecode of what a run imports, written now with the writing on (PYTHONDONTWRITEBYTECODE unset): the installs
# write none (pip's --no-compile; uv never does), since byte-compiling every module of every package one at a time
# took 25 of the 67 s of this setup on 2 cores with pip (torch alone 16 s), and a run imports a third of them. Best
# effort: a failure here only leaves Python to compile on import.
warm() {
  env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -c "import $1" >/dev/null 2>&1 || true
}
stamp=.venv/.dstrain-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  pip=(.venv/bin/python -m pip install -q --no-compile)
  with_pip() { # pip in the venv (a venv made by an earlier setup has it), at least 21.3: editable installs
    # from pyproject.toml (PEP 660), which Python 3.10.0's pip predates
    .venv/bin/python -m pip --version >/dev/null 2>&1 || .venv/bin/python -m ensurepip >/dev/null
    "${pip[@]}" "pip>=21.3"
  }
  # uv installs what pip would in a fraction of the time (it downloads, builds and unpacks in parallel; a fresh
  # setup took 36-46 s against pip's 48-72 s), under pip's own package-choosing settings (launch/uv_args.py;
  # the interpreter's own pip installs uv into the venv and reads the settings, the venv having none of its
  # own); the venv's pip where uv is not to be had, a setting has no uv equivalent, or uv fails.
  uv=()
  # uv does not see the packages a venv borrows from its interpreter (--system-site-packages): pip only there
  if grep -q "^include-system-site-packages = true" .venv/pyvenv.cfg; then
    with_pip
  elif "$PY" -m pip --python .venv/bin/python install -q --no-compile uv >/dev/null 2>&1 &&
    settings=$("$PY" launch/uv_args.py); then
    mapfile -t lines <<<"$settings"
    cert=${lines[0]:-${SSL_CERT_FILE:-}}
    uv=(env ${cert:+"SSL_CERT_FILE=$cert"} .venv/bin/uv pip install -q --python .venv/bin/python "${lines[@]:1}")
  else
    with_pip
  fi
  add() {
    if [ "${#uv[@]}" -gt 0 ]; then
      "${uv[@]}" "$@" && return
      with_pip # uv failed: pip takes over, in a venv that may have none yet
    fi
    "${pip[@]}" "$@"
  }
  # torch first and pinned where the venv has none in the tested range: this resolves to the CPU build on
  # machines without CUDA and keeps deepspeed's own dependency resolution from pulling a CUDA build; one in range
  # (a cluster's, a CUDA build installed by hand) stays. pip with it: the venv has none yet.
  torch=()
  .venv/bin/python dstrain/versions.py torch || torch=("$(.venv/bin/python dstrain/versions.py --cpu-wheel)")
  add ${torch[@]+"${torch[@]}"} "pip>=21.3"
  warm "torch._dynamo, torch._inductor.compile_fx" & # on the core an install leaves idle
  add -e ".[dev]"
  wait
  warm "deepspeed, peft, dstrain.training.trainer, dstrain.cli" & # two at a time: one a core
  warm "datasets, transformers.tokenization_utils_tokenizers, torch.utils.tensorboard, matplotlib.pyplot"
  wait
  echo "$want" > "$stamp"
fi
