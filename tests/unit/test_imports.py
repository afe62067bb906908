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


def _base_packages() -> list[str]:
    return sorted(p.name for p in (ROOT / "mindpulse").iterdir() if (p / "__init__.py").is_file())


def test_the_base_is_sub_packages_each_installed_and_documented():
    """The shared base holds no flat module but its `__init__.py`: every module is in a
    sub-package named for what it holds, which pyproject installs and docs/architecture.md's
    base table lists with each of its modules."""
    import tomllib

    flat = sorted(p.name for p in (ROOT / "mindpulse").glob("*.py") if p.name != "__init__.py")
    assert not flat, f"modules directly under mindpulse/ (put each in the sub-package of its concern): {flat}"
    installed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    doc = (ROOT / "docs" / "architecture.md").read_text()
    table = doc[doc.index("| base package |"):]
    table = table[:table.index("\n\n")]
    for pkg in _base_packages():
        assert f"mindpulse.{pkg}" in installed, f"mindpulse/{pkg}/ is not in pyproject's [tool.setuptools] packages"
        row = next((line for line in table.splitlines() if line.startswith(f"| `{pkg}/` |")), None)
        assert row is not None, f"docs/architecture.md's base table has no row for mindpulse/{pkg}/"
        for mod in sorted((ROOT / "mindpulse" / pkg).glob("*.py")):
            if mod.name != "__init__.py":
                assert f"`{mod.name}`" in row, f"docs/architecture.md's row for {pkg}/ does not name {mod.name}"


def test_the_launcher_reaches_other_places_only_through_its_doors():
    """One module of the driver imports aggregator, node agent or rank code (the import
    contracts' one exception): every other launcher module imports none of it, lazily or not."""
    import ast

    others = ("mindpulse.aggregator", "mindpulse.node", "mindpulse.workers")
    found = []
    for path in sorted((ROOT / "launcher").rglob("*.py")):
        if path.name == "doors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                      if any(n == o or n.startswith(o + ".") for o in others)]
    assert not found, "the driver imports another place's code outside launcher/doors.py:\n" + "\n".join(found)
