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
    "checkpoint": {"base", "model", "data", "parallel", "optim"},
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


# Inside `model/`: the checkpoint format (hf/) and the shared layers (common/) know no family; a family
# (every other sub-package) builds on both and never on another family; the top (registry, build, sources,
# the public API) joins the families.
MODEL_FLOORS = {"hf": set(), "common": set(), "family": {"hf", "common"}, "top": {"hf", "common", "family"}}


def model_floor(module: str) -> tuple[str, str]:
    """(floor, sub-package): `dstrain.model.hf.reader` -> (hf, hf); `dstrain.model.deepseek_v4.model` ->
    (family, deepseek_v4); `dstrain.model.build` -> (top, "")."""
    parts = module.split(".")
    if len(parts) < 3 or not (PACKAGE / "model" / parts[2]).is_dir():
        return "top", ""
    return (parts[2] if parts[2] in MODEL_FLOORS else "family"), parts[2]


def model_violations(source: str, module: str, package: str) -> list[tuple[int, str]]:
    floor, sub = model_floor(module)
    out = []
    for line, target in imported(source, package):
        if floor_of(target) != "model":
            continue
        t_floor, t_sub = model_floor(target)
        if t_sub == sub:  # within one family, one of hf/ or common/, or the top
            continue
        if t_floor not in MODEL_FLOORS[floor]:
            out.append((line, target))
    return out


@pytest.mark.parametrize(
    "path", sorted((PACKAGE / "model").rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE / "model"))
)
def test_model_floors(path):
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    bad = [f"{name}:{line} imports {t}" for line, t in model_violations(path.read_text(), name, package)]
    assert not bad, "\n".join(bad)


def test_the_model_checker_sees_a_family_importing_another():
    source = (
        "from ..deepseek_v3.model import MoE\nfrom ..common.layers import MLP\nfrom .config import V4Config\n"
    )
    assert model_violations(source, "dstrain.model.deepseek_v4.model", "dstrain.model.deepseek_v4") == [
        (1, "dstrain.model.deepseek_v3.model")
    ]
    assert model_violations("from ..registry import x\n", "dstrain.model.hf.reader", "dstrain.model.hf") == [
        (1, "dstrain.model.registry")
    ]


def module_graph() -> dict[str, set[str]]:
    """Each dstrain module -> the dstrain modules it imports (at any depth of the file); `from a import b`
    names the module `a.b` when it is one. A package's own `__init__` is not an edge of its children:
    Python runs it first, but a child that does not name it does not depend on what it defines."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in paths]
                edges |= set(subs) or ({target} if target in paths else set())
            elif isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in paths}
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    assert cycles(module_graph()) == []


def test_the_circle_checker_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
