"""The import graph points only downward: `python -m pytest tests/test_imports.py` checks every import
statement in the package (top level or inside a function) against the floors below.

    entry points   cli.py, train.py, __main__.py, env.py
    training       the run: the trainer, metrics, plots, preemption
    memory         `dstrain plan`: estimate, layout search, measurement
    config         options, the DeepSpeed file, the resolved run plan
    checkpoint     the store, layout-free weights, LoRA files, export
    parallel       layouts applied to the built model   optim (Muon, parameter groups)   data (self-contained)
    model          single-device model, HF format
    base           errors, atomic, batch, fields, cmdline, dist
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.tiny import ROOT

PACKAGE = ROOT / "dstrain"
FLOORS = {
    "base": set(),
    "model": {"base"},
    "data": {"base"},
    "parallel": {"base", "model"},
    "optim": {"base", "model"},
    "checkpoint": {"base", "model", "parallel", "optim"},
    "config": {"base", "model", "data", "parallel", "checkpoint"},
    "memory": {"base", "model", "parallel", "config"},
    "training": {"base", "model", "data", "parallel", "optim", "checkpoint", "config", "memory"},
    "entry": {"base", "model", "data", "parallel", "optim", "checkpoint", "config", "memory", "training"},
}
ENTRY_POINTS = {"cli", "train", "__main__", "env"}


def floor_of(module: str) -> str:
    """`dstrain.model.hf` -> model; `dstrain.errors` -> base; `dstrain.cli` -> entry."""
    parts = module.split(".")
    if len(parts) == 1:
        return "base"
    if parts[1] in FLOORS:
        return parts[1]
    return "entry" if parts[1] in ENTRY_POINTS else "base"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every dstrain import in `source`, a module of `package`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "dstrain"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "dstrain":
                out.append((node.lineno, target))
    return out


def test_floor_table_covers_every_subpackage():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages <= set(FLOORS), packages - set(FLOORS)


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_import_points_upward(path):
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    upward = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
        for line, target in upward_imports(path.read_text(), name, package)
    ]
    assert not upward, "\n".join(upward)


def upward_imports(source: str, module: str, package: str) -> list[tuple[int, str]]:
    here = floor_of(module)
    return [
        (line, target)
        for line, target in imported(source, package)
        if floor_of(target) != here and floor_of(target) not in FLOORS[here]
    ]


def test_the_checker_sees_upward_imports():
    """The rule is not vacuous: absolute, relative and function-level imports that point up are caught."""
    source = "from dstrain.errors import ConfigError\nfrom ..training import plan\n\ndef f():\n    import dstrain.data\n"
    found = upward_imports(source, "dstrain.model.lora", "dstrain.model")
    assert found == [(2, "dstrain.training"), (5, "dstrain.data")]
    assert upward_imports("from .model import x\n", "dstrain.model.hf", "dstrain.model") == []
