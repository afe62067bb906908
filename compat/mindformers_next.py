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

from mindpulse.frameworks.framework_support import MINDFORMERS_BELOW

WORKERS = ROOT / "workers"


@dataclass
class ReleaseCheck:
    version: str
    requires_mindspore: str = ""
    missing: list[str] = field(default_factory=list)
    """Requirements (as the release states them) the index has no distribution for."""
    api: dict[str, str] = field(default_factory=dict)
    """`module.name` mindpulse imports → "ok" or what is wrong in this release; and the two
    shapes mindpulse relies on beyond names (`CELL_OUTPUTS`, `CALLBACK_TYPE`)."""
    error: str = ""


Need = tuple[tuple[str, str], ...]
"""One name mindpulse imports from MindFormers: its (module, name) places, any one of which will do
(a shim's `try: from A import x / except ImportError: from B import x` gives two)."""


def _mf_imports(nodes) -> list[tuple[str, str]]:
    return [(n.module, a.name) for n in nodes if isinstance(n, ast.ImportFrom) and n.module
            and n.module.split(".")[0] == "mindformers" for a in n.names]


def used_names(workers: Path = WORKERS) -> list[Need]:
    """Every MindFormers name mindpulse's rank code imports (`from mindformers.X import a`),
    read from the source; a name imported again in an `except ImportError` branch has both places."""
    needs: dict[Need, None] = {}
    for path in sorted(workers.rglob("*.py")):
        tree = ast.parse(path.read_text())
        done: set[int] = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.Try):
                continue
            fallback = [imp for h in node.handlers for imp in _mf_imports(h.body)]
            for module, name in _mf_imports(node.body):
                needs[((module, name),) + tuple(f for f in fallback if f[1] == name)] = None
            done.update(id(n) for n in node.body + [b for h in node.handlers for b in h.body])
        for node in ast.walk(tree):
            if id(node) not in done:
                for place in _mf_imports([node]):
                    needs[(place,)] = None
    return sorted(needs)


def need_label(need: Need) -> str:
    return " or ".join(f"{m}.{n}" for m, n in need)


def _defines(tree: ast.Module | ast.ClassDef, name: str) -> bool:
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return True
        if isinstance(node, ast.ImportFrom | ast.Import) and any((a.asname or a.name.split(".")[-1]) == name
                                                                 for a in node.names):
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
    return False


def _has(root: Path, module: str, name: str) -> str:
    """"ok", or what the release in `root` lacks."""
    base = root.joinpath(*module.split("."))
    path = base / "__init__.py" if (base / "__init__.py").exists() else base.with_suffix(".py")
    if not path.exists():
        return f"no module {module}"
    tree = ast.parse(path.read_text(errors="replace"))
    if _defines(tree, name) or (base / f"{name}.py").exists() or (base / name / "__init__.py").exists():
        return "ok"
    return f"{module} has no {name}"


def check_api(root: Path, needs: list[Need]) -> dict[str, str]:
    """Each needed name against the unpacked release in `root`: "ok" when one of its places
    has it, else what each place lacks."""
    result = {}
    for need in needs:
        found = [_has(root, module, name) for module, name in need]
        result[need_label(need)] = "ok" if "ok" in found else "; ".join(found)
    return result


CELL_OUTPUTS = ("loss", "overflow", "scaling_sens", "learning_rate", "global_norm")
"""What `MFTrainOneStepCell.construct` returns first, in this order: the MindFormers callback reads
them by position (workers/train_cell.py `_loss_scale_outputs`)."""
CALLBACK_TYPE = "MindFormerModuleType.CALLBACK"
"""The registry slot MindPulseMonitor registers in (workers/mindformers_monitor.py)."""


def check_shapes(root: Path) -> dict[str, str]:
    """The train cell's outputs and the callback registry slot in the release in `root`."""
    out = {}
    wrapper = root / "mindformers" / "wrapper" / "wrapper.py"
    got = "no mindformers/wrapper/wrapper.py"
    if wrapper.exists():
        got = "no MFTrainOneStepCell.construct"
        for cls in ast.parse(wrapper.read_text(errors="replace")).body:
            if isinstance(cls, ast.ClassDef) and cls.name == "MFTrainOneStepCell":
                for fn in cls.body:
                    if isinstance(fn, ast.FunctionDef) and fn.name == "construct":
                        rets = [n.value for n in ast.walk(fn) if isinstance(n, ast.Return)
                                and isinstance(n.value, ast.Tuple)]
                        heads = {tuple(ast.unparse(e) for e in r.elts[:len(CELL_OUTPUTS)]) for r in rets}
                        got = "ok" if heads == {CELL_OUTPUTS} else f"returns {sorted(heads)}"
    out["MFTrainOneStepCell outputs " + ", ".join(CELL_OUTPUTS)] = got
    register = root / "mindformers" / "tools" / "register" / "register.py"
    slot = "no mindformers/tools/register/register.py"
    if register.exists():
        slot = f"{CALLBACK_TYPE} missing"
        for cls in ast.parse(register.read_text(errors="replace")).body:
            if isinstance(cls, ast.ClassDef) and cls.name == "MindFormerModuleType" and _defines(cls, "CALLBACK"):
                slot = "ok"
    out[CALLBACK_TYPE] = slot
    return out


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
        check.api = check_api(unpacked, used_names()) | check_shapes(unpacked)
    return check


def releases_to_check(versions: tuple[str, ...]) -> list[str]:
    """Only releases at or above the supported range's end are checked here."""
    from packaging.version import Version

    return [v for v in versions if Version(v) >= Version(MINDFORMERS_BELOW)]
