"""The import rules that keep the four places code runs apart (see docs/architecture.md):
the contracts in pyproject.toml, no import cycle between modules, and a driver that
never loads MindSpore."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE_FOLDERS = ("launcher", "node", "workers", "aggregator", "views")


def _assemble(tree: Path) -> Path:
    """The installed package layout (code folders mapped under `mindpulse`), as files."""
    pkg = tree / "mindpulse"
    pkg.mkdir(parents=True)
    for f in (ROOT / "mindpulse").rglob("*.py"):
        dest = pkg / f.relative_to(ROOT / "mindpulse")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(f.read_bytes())
    for folder in CODE_FOLDERS:
        for f in (ROOT / folder).rglob("*.py"):
            dest = pkg / folder / f.relative_to(ROOT / folder)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(f.read_bytes())
    return tree


def test_importing_the_cli_does_not_load_mindspore():
    code = ("import sys, mindpulse.launcher.cli, mindpulse.launcher.launch; "
            "bad = sorted(m for m in ('mindspore', 'mindformers') if m in sys.modules); "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"the driver loaded {proc.stdout.strip()} at import:\n{proc.stderr[-2000:]}"


def test_import_contracts_hold():
    proc = subprocess.run(["bash", str(ROOT / "tools" / "lint_imports.sh")], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, "import contracts broken:\n" + (proc.stdout + proc.stderr)[-4000:]


def test_no_import_cycle_between_modules(tmp_path, monkeypatch):
    grimp = pytest.importorskip("grimp")
    tree = _assemble(tmp_path)
    monkeypatch.syspath_prepend(str(tree))
    for name in [m for m in sys.modules if m == "mindpulse" or m.startswith("mindpulse.")]:
        monkeypatch.delitem(sys.modules, name)
    graph = grimp.build_graph("mindpulse", cache_dir=None)
    modules = sorted(m for m in graph.modules if not _is_package_init(graph, m))

    def deps(m: str) -> list[str]:
        # an import of a package's __init__ is an import of the package, not of its modules
        return sorted(d for d in graph.find_modules_directly_imported_by(m) if d.startswith("mindpulse.")
                      and d != m and not m.startswith(d + "."))

    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in deps(m):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in modules:
        if m not in state:
            visit(m)
    assert not cycles, "import cycles (lazy imports included):\n" + "\n".join(" -> ".join(c) for c in cycles)


def _is_package_init(graph, module: str) -> bool:
    return any(m.startswith(module + ".") for m in graph.modules)
