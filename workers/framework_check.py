"""The rank's own check of the MindSpore (and, for a MindFormers job, the MindFormers) it is
about to import, before it imports either.

The driver refuses a node whose versions are out of range before any rank trains; this is
the same judgement made again where the import happens (defence in depth, and the only
check on paths the driver does not probe: a node whose environment changed since, a rank
started by hand with msrun). A rank that would import a missing or unsupported framework
ends at once with exit code 2 and one line naming its node, what it found, the range and the
fix (`mindpulse.frameworks.framework_support`), instead of a ModuleNotFoundError's traceback from deep
inside the job.

Neither framework is imported here: the package `import` would load is found with
`importlib.util.find_spec` (the same search `import` makes, so `job.mindformers.source` first
when it is set) and its version read from its own source (`mindspore/version.py`,
`mindformers/__init__.py`), where a source checkout has it too (its installed metadata, if
any, would name another copy). Importing MindFormers' package would cost the recipe ~3 s of
text-metric imports it leaves out (workers/lean_mindformers.py).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from mindpulse.frameworks.framework_support import Framework, FrameworkVersionError, VersionCheck, check_version

REFUSED_EXIT = 2
"""A rank's exit code when it refuses its framework: the code a launch gives bad input."""

VERSION_FILES = ("version.py", "__init__.py")
"""Where each framework's package states `__version__`, in the order read (MindSpore:
`version.py`, imported by its `__init__`; MindFormers: `__init__.py`)."""


@dataclass(frozen=True)
class Found:
    """One framework as this process would import it."""

    framework: Framework
    version: str | None
    """None: not importable here."""
    origin: str | None
    """The package's folder (None: not importable here)."""

    def check(self, node: str) -> VersionCheck:
        return check_version(self.framework, self.version, node, self.origin or "")

    def line(self) -> str:
        return f"{self.framework.value} {self.version} from {self.origin}"


def _version_in(source: str) -> str | None:
    """The string assigned to `__version__` at the top level of a module's source."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            if any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
                return node.value.value
    return None


def find(framework: Framework) -> Found:
    """Where `import <framework>` would load it from in this process, and its version."""
    name = framework.value
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a broken parent entry in sys.modules: as if missing
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return Found(framework, None, None)
    folder = Path(next(iter(spec.submodule_search_locations)))
    for file in VERSION_FILES:
        try:
            version = _version_in((folder / file).read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
        if version:
            return Found(framework, version, str(folder))
    try:  # a package that states no __version__ in its source: its installed metadata
        return Found(framework, importlib.metadata.version(name), str(folder))
    except importlib.metadata.PackageNotFoundError:
        return Found(framework, "", str(folder))


def put_first(source: str) -> None:
    """`job.mindformers.source`: the tree goes first on this process's path and on the path of
    every process it starts (MindFormers' own subprocesses), ahead of any installed copy."""
    path = str(Path(source).resolve())
    if sys.path[:1] != [path]:
        sys.path.insert(0, path)
    importlib.invalidate_caches()
    old = os.environ.get("PYTHONPATH", "")
    if old.split(os.pathsep)[:1] != [path]:
        os.environ["PYTHONPATH"] = path + (os.pathsep + old if old else "")


def check(frameworks: tuple[Framework, ...], node: str | None = None) -> list[Found]:
    """Find and judge each framework (`job.mindformers.source` put first beforehand);
    FrameworkVersionError naming the node (default: this host's name) when one is missing or
    out of range. Returns what was found, for the rank's log."""
    node = node or socket.gethostname()
    found = [find(f) for f in frameworks]
    bad = [c for c in (f.check(node) for f in found) if not c.ok]
    if bad:
        raise FrameworkVersionError(bad)
    return found
