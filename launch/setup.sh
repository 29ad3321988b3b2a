#!/usr/bin/env bash
# Create or reuse .venv and install dstrain into it. Safe to run repeatedly: it reinstalls only when
# pyproject.toml changed since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  # without pip: ensurepip's copy took 5 of a fresh setup's ~40 s; uv installs pip below (ensurepip where uv
  # is not to be had)
  "$PY" -m venv --without-pip .venv
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
  if "$PY" -m pip --python .venv/bin/python install -q --no-compile uv >/dev/null 2>&1 &&
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
  # torch first and pinned: this resolves to the CPU build on machines without CUDA and keeps
  # deepspeed's own dependency resolution from pulling a CUDA build. pip with it: the venv has none yet.
  add "torch==2.13.0" "pip>=21.3"
  warm "torch._dynamo, torch._inductor.compile_fx" & # on the core an install leaves idle
  add -e ".[dev]"
  wait
  warm "deepspeed, peft, dstrain.training.trainer, dstrain.cli" & # two at a time: one a core
  warm "datasets, transformers.tokenization_utils_tokenizers, torch.utils.tensorboard, matplotlib.pyplot"
  wait
  echo "$want" > "$stamp"
fi
