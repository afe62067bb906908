"""MindFormers releases above the supported range, checked without running them: which of
their requirements the index lacks, and whether the MindFormers names mindpulse's rank code
imports (workers/) are still where it imports them from, read from the release's own wheel.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from venvs import ROOT, unpublished_requirements

from mindpulse.framework_support import MINDFORMERS_BELOW

WORKERS = ROOT / "workers"


@dataclass
class ReleaseCheck:
    version: str
    requires_mindspore: str = ""
    missing: list[str] = field(default_factory=list)
    """Requirements (as the release states them) the index has no distribution for."""
    api: dict[str, str] = field(default_factory=dict)
    """`module.name` mindpulse imports → "ok" or what is wrong in this release."""
    error: str = ""


def used_names(workers: Path = WORKERS) -> dict[str, set[str]]:
    """MindFormers module → names mindpulse's rank code imports from it (`from mindformers.X
    import a, b`), read from the source."""
    used: dict[str, set[str]] = {}
    for path in sorted(workers.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mindformers":
                used.setdefault(node.module, set()).update(a.name for a in node.names)
    return used


def _defines(tree: ast.Module, name: str) -> bool:
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return True
        if isinstance(node, ast.ImportFrom | ast.Import) and any((a.asname or a.name.split(".")[-1]) == name
                                                                 for a in node.names):
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
    return False


def check_api(root: Path, used: dict[str, set[str]]) -> dict[str, str]:
    """Each used `module.name` against the unpacked release in `root`."""
    result = {}
    for module, names in sorted(used.items()):
        base = root.joinpath(*module.split("."))
        path = base / "__init__.py" if (base / "__init__.py").exists() else base.with_suffix(".py")
        for name in sorted(names):
            key = f"{module}.{name}"
            if not path.exists():
                result[key] = f"no module {module}"
                continue
            tree = ast.parse(path.read_text(errors="replace"))
            result[key] = "ok" if _defines(tree, name) or (base / f"{name}.py").exists() \
                or (base / name / "__init__.py").exists() else f"{module} has no {name}"
    return result


def check_release(version: str, python: Path = Path(sys.executable)) -> ReleaseCheck:
    """Download the release's wheel (no dependencies), read its requirements and its source."""
    check = ReleaseCheck(version)
    with tempfile.TemporaryDirectory(prefix="compat-mf-") as tmp:
        got = subprocess.run([str(python), "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp,
                              f"mindformers=={version}"], capture_output=True, text=True, timeout=600)
        wheels = list(Path(tmp).glob("mindformers-*.whl"))
        if got.returncode != 0 or not wheels:
            check.error = f"pip download mindformers=={version} failed: {got.stderr[-500:]}"
            return check
        unpacked = Path(tmp) / "src"
        with zipfile.ZipFile(wheels[0]) as z:
            z.extractall(unpacked)
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            reqs = [ln.split(":", 1)[1].strip() for ln in z.read(meta).decode().splitlines()
                    if ln.startswith("Requires-Dist:") and "extra ==" not in ln]
        check.requires_mindspore = next((r[len("mindspore"):].strip() for r in reqs if r.startswith("mindspore")), "")
        check.missing = unpublished_requirements(python, reqs)
        check.api = check_api(unpacked, used_names())
    return check


def releases_to_check(versions: tuple[str, ...]) -> list[str]:
    """Only releases at or above the supported range's end are checked here."""
    from packaging.version import Version

    return [v for v in versions if Version(v) >= Version(MINDFORMERS_BELOW)]
