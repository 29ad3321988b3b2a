"""README.md and docs/*.md kept true to the code.

- The README's file tree (the fenced block on the line after `<!-- tree -->`) names every file of the package,
  one line each, indented 2 spaces per folder level; a folder line ends with `/`, and a folder line with
  nothing under it stands for its whole contents (`builtin/`). Beside `dstrain/` it names every top-level
  entry of the repository (hidden ones apart), folders not expanded.
- The README is a short guide: at most 250 lines, the two commands first, a link to every docs/*.md.
- Runnable commands: a fenced block whose info string is `bash run` (```` ```bash run ````) in README.md or
  docs/*.md is run by `test_runnable_block` with `bash -euo pipefail -c` from the repository root, with this
  venv's bin folder first on PATH, DS_ACCELERATOR=cpu, OMP_NUM_THREADS=1, a free MASTER_PORT and `$TMP_RUN`,
  a fresh temporary folder every output of the block must go under; it must exit 0 within 300 s. Plain
  ```` ```bash ```` blocks (GPUs, clusters, a user's files) are shown, not run. Keep the runnable blocks few and
  fast (seconds to ~40 s each on 2 CPU cores); a block that starts ranks (deepspeed, torchrun, accelerate,
  srun) is marked multirank.
- Every relative link resolves, and every repository path the docs name (`dstrain/...`, `tests/...`,
  `launch/...`, `docs/...`, `ds_configs/...`) exists.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dstrain.dist import free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
TREE_MARK = "<!-- tree -->"
RUN_TIMEOUT_S = 300


def fenced_blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line number of the opening fence, info string, code) of every top-level fenced block."""
    blocks, lines = [], path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, info = i, lines[i][3:].strip()
            i += 1
            while i < len(lines) and lines[i].rstrip() != "```":
                i += 1
            assert i < len(lines), f"{path.name}:{start + 1}: fenced block never closed"
            blocks.append((start + 1, info, "\n".join(lines[start + 1 : i])))
        i += 1
    return blocks


# ---------------------------------------------------------------------------------------------- file tree


def readme_tree() -> set[str]:
    """The paths the README's tree names: files, and folders shown without their contents (ending in '/')."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert TREE_MARK in lines, f"README.md has no {TREE_MARK} line"
    at = lines.index(TREE_MARK) + 1
    assert lines[at].startswith("```"), f"README.md:{at + 1}: a fenced block must follow {TREE_MARK}"
    named: list[str] = []
    folders: list[str] = []  # the folder of each indentation level above the current line
    for n in range(at + 1, len(lines)):
        line = lines[n]
        if line.startswith("```"):
            break
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        name, _, comment = line.strip().partition(" ")
        where = f"README.md:{n + 1}: {line.strip()!r}"
        assert indent % 2 == 0, f"{where}: indent by 2 spaces per level"
        assert comment.strip().startswith("#"), f"{where}: one `# comment` after the name"
        del folders[indent // 2 :]
        assert len(folders) == indent // 2, f"{where}: indented deeper than the folder above it"
        named.append("".join(folders) + name)
        if name.endswith("/"):
            folders.append(name)
    expanded = {p for p in named if p.endswith("/") and any(q != p and q.startswith(p) for q in named)}
    duplicates = {p for p in named if named.count(p) > 1}
    assert not duplicates, f"named twice in the README tree: {sorted(duplicates)}"
    return set(named) - expanded


def repository_files() -> list[str]:
    """Files git tracks or would track (untracked, not ignored) that exist, a link to a folder as `NAME/`;
    a walk of the checkout where git is missing."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        paths = out.splitlines()
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "__pycache__"}
        paths = [
            p.relative_to(ROOT).as_posix()
            for p in ROOT.rglob("*")
            if (p.is_file() or p.is_symlink()) and not skip.intersection(p.relative_to(ROOT).parts)
        ]
    return [f + "/" if (ROOT / f).is_dir() else f for f in paths if (ROOT / f).exists()]


def test_readme_tree_matches_the_package():
    named = readme_tree()
    collapsed = sorted(p for p in named if p.startswith("dstrain/") and p.endswith("/"))
    actual: set[str] = set()
    for f in repository_files():
        top, _, rest = f.partition("/")
        if top.startswith(".") or "__pycache__" in f:
            continue
        if not rest:
            actual.add(top)
        elif top != "dstrain":
            actual.add(top + "/")
        else:
            actual.add(next((c for c in collapsed if f.startswith(c)), f))
    missing, extra = sorted(actual - named), sorted(named - actual)
    assert not missing and not extra, (
        "README.md's file tree differs from the repository:\n"
        f"  missing from the tree (add a line with a # comment): {missing}\n"
        f"  in the tree but not in the repository: {extra}"
    )


# ---------------------------------------------------------------------------------------------- the guide


def test_readme_is_a_guide():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; depth belongs in docs/*.md"
    first_heading = next(n for n, line in enumerate(lines, 1) if line.startswith("## "))
    start, _, code = fenced_blocks(README)[0]
    commands = [line.split("#")[0].strip() for line in code.splitlines()]
    assert commands == ["bash launch/train.sh", "bash launch/test.sh"], code
    assert start < first_heading, "the two commands come before the first section"
    unlinked = [d.name for d in DOCS if f"](docs/{d.name}" not in text]
    assert not unlinked, f"README.md links no {unlinked}"


LINK = re.compile(r"\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"(?<![\w./$-])((?:dstrain|tests|launch|docs|ds_configs)/[\w./*-]*)")


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_links_and_named_paths_exist(doc):
    text = doc.read_text(encoding="utf-8")
    broken = []
    for target in LINK.findall(text):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        if not (doc.parent / target.split("#")[0]).exists():
            broken.append(target)
    for path in {m.rstrip(".") for m in REPO_PATH.findall(text)}:
        found = list(ROOT.glob(path)) if "*" in path else [ROOT / path] if (ROOT / path).exists() else []
        if not found:
            broken.append(path)
    assert not broken, f"{doc.name} names what does not exist: {sorted(set(broken))}"


# ------------------------------------------------------------------------------------ runnable commands

RANKS = re.compile(r"^\s*(deepspeed|torchrun|accelerate\s+launch|srun)\b", re.MULTILINE)


def runnable_blocks() -> list:
    params = []
    for doc in [README, *DOCS]:
        for line, info, code in fenced_blocks(doc):
            if info.split() == ["bash", "run"]:
                marks = [pytest.mark.multirank] if RANKS.search(code) else []
                params.append(pytest.param(code, id=f"{doc.name}:{line}", marks=marks))
    return params


RUNNABLE = runnable_blocks()


def test_the_docs_have_runnable_blocks():
    assert RUNNABLE, "no ```bash run block found in README.md or docs/*.md"


_RUN_DIRS: dict[str, Path] = {}


@pytest.mark.parametrize("code", RUNNABLE)
def test_runnable_block(code, request, tmp_path_factory):
    # One $TMP_RUN per document, its blocks run in order: a later block may use an earlier one's run, as a
    # reader following the document would.
    doc = request.node.callspec.id.split(":")[0]
    run_dir = _RUN_DIRS.setdefault(doc, tmp_path_factory.mktemp(doc.replace(".", "_")))
    env = {
        **os.environ,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        "TMP_RUN": str(run_dir),
        "DS_ACCELERATOR": "cpu",
        # ranks share the 2 cores; one process has both, unless the suite shares them (launch/test.sh)
        "OMP_NUM_THREADS": "1" if RANKS.search(code) else os.environ.get("OMP_NUM_THREADS", "2"),
        "MASTER_PORT": str(free_port()),
    }
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the block's own process group: launchers and their ranks
        out, _ = proc.communicate()
        pytest.fail(f"still running after {RUN_TIMEOUT_S} s:\n{code}\n--- output\n{out[-4000:]}")
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{code}\n--- output\n{out[-6000:]}"
