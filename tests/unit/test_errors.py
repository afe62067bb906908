"""How mindpulse's code handles errors: every exception it defines derives from
`MindpulseError`, and every handler broad enough to catch anything (`except Exception`,
`except BaseException`, a bare `except:`) either raises again or says on the spot why
swallowing the error is right there."""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import re
import tokenize
from pathlib import Path

import pytest

from mindpulse.common.errors import MindpulseError

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"mindpulse": "mindpulse", "launcher": "mindpulse.launcher", "node": "mindpulse.node",
            "workers": "mindpulse.workers", "aggregator": "mindpulse.aggregator", "views": "mindpulse.views"}
"""Each source folder and the import name it is installed under (pyproject.toml `package-dir`)."""
SCANNED_FOLDERS = (*PACKAGES, "tools", "bench")

NOT_MINDPULSE_ERRORS = {
    # a BaseException on purpose, like KeyboardInterrupt: the start's `except Exception`
    # handlers must let the user's interrupt through to the controller
    "mindpulse.launcher.interrupts.StartInterrupted",
}

UNCHECKED_HANDLERS: set[str] = set()

_HEAVY_IMPORTS = ("mindspore", "mindformers")


def _modules() -> list[tuple[str, Path]]:
    """(import name, source file) of every module of the package, code folders included."""
    out = []
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            out.append((".".join([package, *parts]), path))
    return out


def _imports_heavy(tree: ast.Module) -> bool:
    """Imports MindSpore or MindFormers at module level (seconds to import, and MindFormers
    writes log folders where it is imported)."""
    for node in tree.body:
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n.split(".")[0] in _HEAVY_IMPORTS for n in names):
            return True
    return False


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in cls.bases]


def test_every_exception_the_package_defines_derives_from_mindpulse_error():
    wrong, ours, heavy = [], {"MindpulseError"}, []
    for name, path in _modules():
        tree = ast.parse(path.read_text(), str(path))
        if _imports_heavy(tree):
            heavy.append((path, tree))
            continue
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if obj.__module__ != name or not issubclass(obj, BaseException):
                continue
            qualname = f"{name}.{obj.__qualname__}"
            if issubclass(obj, MindpulseError):
                ours.add(obj.__name__)
            elif qualname not in NOT_MINDPULSE_ERRORS:
                wrong.append(f"{qualname}({', '.join(b.__name__ for b in obj.__bases__)})")
    for path, tree in heavy:
        # not imported here: a class based on an exception must name MindpulseError or one of ours
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            bases = _base_names(cls)
            if any(b.endswith(("Error", "Exception")) for b in bases) and not ours & set(bases):
                wrong.append(f"{path.relative_to(ROOT)}:{cls.lineno} {cls.name}({', '.join(bases)})")
    assert not wrong, ("these exceptions must derive from mindpulse.common.errors.MindpulseError (keep their other "
                       "bases: `class X(MindpulseError, ValueError)`):\n" + "\n".join(wrong))
    for qualname in NOT_MINDPULSE_ERRORS:
        module, _, cls = qualname.rpartition(".")
        obj = getattr(importlib.import_module(module), cls)
        assert not issubclass(obj, Exception), f"{qualname} is an Exception now: derive it from MindpulseError"


def test_project_errors_keep_their_builtin_kind():
    from mindpulse.config import ConfigError
    from mindpulse.wire.protocol import PacketError

    with pytest.raises(ValueError):
        raise ConfigError("world.nodes: 0 is not a positive integer")
    assert issubclass(PacketError, MindpulseError) and issubclass(PacketError, ValueError)


def _catches_anything(handler: ast.ExceptHandler) -> bool:
    t = handler.type
    names = t.elts if isinstance(t, ast.Tuple) else [t]
    return t is None or any(isinstance(n, ast.Name) and n.id in ("Exception", "BaseException") for n in names)


def _raises(body: list[ast.stmt]) -> bool:
    """A `raise` in the handler's own code (not in a function or class defined there)."""
    todo: list[ast.AST] = list(body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Raise):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return False


_TOOL_TAGS = re.compile(r"#|noqa(:\s*[A-Z]+[0-9]+([,\s]+[A-Z]+[0-9]+)*)?|type:\s*ignore(\[[^\]]*\])?"
                        r"|pragma:\s*no\s+(cover|branch)|nosec(\s+[A-Z]+[0-9]+)*|pylint:\s*disable=[\w,-]+", re.I)


def _says_why(comment: str) -> bool:
    """A comment with words beyond the tools' tags (`# noqa: BLE001` alone is not a reason)."""
    return any(ch.isalpha() for ch in _TOOL_TAGS.sub("", comment))


def unexplained_handlers(path: Path) -> list[int]:
    """Lines of `path`'s handlers that catch anything, never raise, and have no `#` comment
    that gives a reason on the `except` line, the line above it or the first line of their body."""
    text = path.read_text()
    comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                if tok.type == tokenize.COMMENT and _says_why(tok.string)}
    return sorted(
        node.lineno for node in ast.walk(ast.parse(text, str(path)))
        if isinstance(node, ast.ExceptHandler) and _catches_anything(node) and not _raises(node.body)
        and not {node.lineno - 1, node.lineno, node.body[0].lineno} & comments)


def test_every_handler_that_swallows_any_error_says_why():
    found = []
    for folder in SCANNED_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in UNCHECKED_HANDLERS or rel.startswith("bench/results/"):
                continue
            found += [f"{rel}:{line}" for line in unexplained_handlers(path)]
    assert not found, (
        "these handlers catch every error and drop it without saying why. Catch only what can occur there "
        "(OSError around a file, (ValueError, TypeError) around a parse), or say on the `except` line or the "
        "line above why swallowing is right (`# a sink's failure must not stop the aggregator`):\n"
        + "\n".join(found))


def test_the_handler_check_finds_a_silent_handler(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("try:\n    f()\nexcept Exception:\n    pass\n"
                   "try:\n    f()\nexcept Exception:  # best effort\n    pass\n"
                   "try:\n    f()\nexcept:\n    log()\n    raise\n"
                   "try:\n    f()\nexcept (OSError, BaseException):\n    def g():\n        raise\n"
                   "try:\n    f()\nexcept Exception:  # noqa: BLE001\n    pass\n"
                   "try:\n    f()\nexcept Exception:  # noqa: BLE001 - a sampler never raises\n    pass\n"
                   "try:\n    f()\nexcept Exception:  # type: ignore[misc]\n    pass\n"
                   "try:\n    f()\nexcept Exception:  # NOQA: BLE001 S110\n    pass\n"
                   "try:\n    f()\nexcept Exception:  # pragma: no cover\n    pass\n"
                   "try:\n    f()\nexcept Exception:  # pylint: disable=broad-except\n    pass  # nosec B110\n")
    assert unexplained_handlers(src) == [3, 16, 21, 29, 33, 37, 41]
