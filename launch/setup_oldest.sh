#!/usr/bin/env bash
# Create or reuse .venv-oldest: the oldest torch, triton and transformers dstrain is tested on (dstrain/versions.py;
# a fresh .venv takes the newest of each), for launch/test.sh's DSTRAIN_OLDEST=1 stage. Every other package is
# .venv's (a path file puts .venv's site-packages behind its own): the two environments differ in those three and
# the packages torch requires that .venv lacks.
# torch's PyPI wheel of that version is its CUDA build: it imports on a CPU machine with its CUDA libraries
# installed (the nvidia-* wheels; what a GPU cluster's torch has too), so they come with it: 2.7 GB downloaded,
# 4.5 GB in uv's cache, ~30 s with uv on this 2-core machine. Reinstalls only when the tested versions or this
# script changed. Needs .venv (launch/setup.sh) first.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-oldest
stamp=$venv/.dstrain-installed
want="$(cat dstrain/versions.py launch/setup_oldest.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
rm -rf "$venv"
.venv/bin/python -m venv --without-pip "$venv"
own=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" >"$own/dstrain-dependencies.pth"
# dstrain itself from this checkout (.venv's editable install is a path file there, which the line above does not run)
pwd >>"$own/dstrain-dependencies.pth"
# uv under pip's settings where it can (launch/uv_args.py, as setup.sh), pip otherwise
if [ -x .venv/bin/uv ] && settings=$(.venv/bin/python launch/uv_args.py); then
  mapfile -t lines <<<"$settings"
  cert=${lines[0]:-${SSL_CERT_FILE:-}}
  install=(env ${cert:+"SSL_CERT_FILE=$cert"} .venv/bin/uv pip install -q --python "$venv/bin/python" "${lines[@]:1}")
else
  install=(.venv/bin/python -m pip --python "$venv/bin/python" install -q --no-compile)
fi
read -r -a oldest <<<"$(.venv/bin/python dstrain/versions.py --oldest)"
"${install[@]}" --no-deps "${oldest[@]}"
# Then what torch requires that .venv lacks or holds outside torch's bounds (its CUDA libraries; setuptools<82),
# so that each other package .venv has stays .venv's
find_lacking='
import importlib.metadata as m
from packaging.requirements import Requirement
for line in m.requires("torch") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        ok = req.specifier.contains(m.version(req.name), prereleases=True)
    except m.PackageNotFoundError:
        ok = False
    if not ok:
        print(line)'
mapfile -t lacking < <("$venv/bin/python" -c "$find_lacking")
[ "${#lacking[@]}" -eq 0 ] || "${install[@]}" "${lacking[@]}"
env -u PYTHONDONTWRITEBYTECODE "$venv/bin/python" -c "import torch._dynamo, torch._inductor.compile_fx, triton" >/dev/null
"$venv/bin/python" dstrain/versions.py torch
echo "$want" >"$stamp"
