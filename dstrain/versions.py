"""The versions of dstrain's version-sensitive dependencies its tests run on: the one definition that
pyproject.toml's requirements (tests/test_versions.py checks them against it), `dstrain env`'s warnings and
launch/setup.sh's torch choice follow.

Each range runs from the oldest release tested to below the next untested minor: launch/test.sh runs the suite
on the newest (`.venv`) and, with DSTRAIN_OLDEST=1, the version-sensitive tests on the oldest (`.venv-oldest`,
launch/setup_oldest.sh). Standard library only: launch/setup.sh runs it before dstrain is installed.
`python dstrain/versions.py torch` exits 0 when the installed torch is in range; `--cpu-wheel` prints the torch
requirement setup.sh installs first where none is (the newest tested: its CPU wheel on a machine without CUDA),
`--oldest` the oldest tested torch, triton and transformers.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys

# package: (oldest tested, first version not tested), release numbers
TESTED: dict[str, tuple[str, str]] = {
    "torch": ("2.11", "2.14"),  # 2.11.0 (+cu130, a GPU cluster's) and 2.13.0 (+cpu)
    "triton": ("3.6", "3.10"),  # 3.6.0 (torch 2.11's) and 3.9.0; DSA's kernels under its interpreter
    "deepspeed": ("0.19.8", "0.20"),
    "transformers": ("5.23", "5.25"),  # 5.23.0 and 5.24.0 (a fresh .venv's)
    "peft": ("0.21", "0.22"),
    "datasets": ("5.2", "5.3"),
}
CPU_WHEEL_TORCH = "2.13.0"  # the newest tested: setup.sh's CPU wheel


def release(version: str) -> tuple[int, ...]:
    """'2.11.0+cu130' -> (2, 11, 0): the release numbers, local label and pre-release tags dropped."""
    match = re.match(r"\d+(\.\d+)*", version.strip())
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def in_range(package: str, version: str) -> bool:
    low, high = TESTED[package]
    return release(low) <= release(version) < release(high)


def requirement(package: str) -> str:
    """The requirement pyproject.toml states for `package`: 'torch>=2.11,<2.14'."""
    low, high = TESTED[package]
    return f"{package}>={low},<{high}"


def installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def outside_tested() -> list[str]:
    """One line per installed package outside its tested range (a missing one is not named: triton is optional)."""
    lines = []
    for package, (low, high) in TESTED.items():
        version = installed(package)
        if version is not None and not in_range(package, version):
            lines.append(f"{package} {version} is outside the tested range >={low},<{high}")
    return lines


def main(argv: list[str]) -> int:
    if argv == ["--cpu-wheel"]:
        print(f"torch=={CPU_WHEEL_TORCH}")
        return 0
    if argv == [
        "--oldest"
    ]:  # launch/setup_oldest.sh's: the oldest of each that a fresh .venv takes the newest of
        print(*(f"{p}=={TESTED[p][0]}.*" for p in ("torch", "triton", "transformers")))
        return 0
    if len(argv) != 1 or argv[0] not in TESTED:
        print(
            f"usage: python dstrain/versions.py {{{','.join(TESTED)}}} | --cpu-wheel | --oldest",
            file=sys.stderr,
        )
        return 2
    version = installed(argv[0])
    return 0 if version is not None and in_range(argv[0], version) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
