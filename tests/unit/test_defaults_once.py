"""Every setting has one default: the config schema's. A function parameter or a dataclass field
elsewhere that is named like a schema field and repeats its default as a literal is a copy that
drifts (`per_print_step` had three, `collect_freq` two with different values): it must name the
schema's default (`MonitorConfig.per_print_step`) instead."""

from __future__ import annotations

import ast
import dataclasses
import enum
from pathlib import Path

from mindpulse.config import schema

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("mindpulse", "launcher", "node", "workers", "aggregator", "views")
NO_VALUE = (0, 0.0, "", None)
"""Defaults that mean "not set": not a copy of anything."""


def schema_defaults() -> dict[str, set]:
    """Each schema field name → the defaults it has (a name may appear in several sections)."""
    out: dict[str, set] = {}
    for obj in vars(schema).values():
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == schema.__name__:
            for f in dataclasses.fields(obj):
                d = f.default
                if d is dataclasses.MISSING or isinstance(d, bool):
                    continue
                d = d.value if isinstance(d, enum.Enum) else d
                if isinstance(d, (int, float, str)) and d not in NO_VALUE:
                    out.setdefault(f.name, set()).add(d)
    return out


def literal_defaults(tree: ast.AST):
    """(line, name, value) of every literal default of a parameter or an annotated field."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            pos = a.posonlyargs + a.args
            pairs = list(zip(pos[len(pos) - len(a.defaults):], a.defaults)) + list(zip(a.kwonlyargs, a.kw_defaults))
            for arg, d in pairs:
                if isinstance(d, ast.Constant):
                    yield d.lineno, arg.arg, d.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(node.value,
                                                                                                  ast.Constant):
            yield node.lineno, node.target.id, node.value.value


def test_no_source_file_repeats_a_schema_default_as_a_literal():
    defaults = schema_defaults()
    assert {"per_print_step", "collect_freq", "straggler_window", "seq_length"} <= set(defaults), "no schema seen"
    copies = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(schema.__file__).resolve():
                continue
            for line, name, value in literal_defaults(ast.parse(path.read_text(), str(path))):
                if name in defaults and not isinstance(value, bool) and value in defaults[name]:
                    copies.append(f"{path.relative_to(ROOT)}:{line}: {name} = {value!r}")
    assert not copies, ("literal copies of the config schema's defaults (name the schema's, e.g. "
                        "MonitorConfig.per_print_step):\n" + "\n".join(copies))


def test_the_scan_finds_a_copy():
    """The check can fail: a parameter that repeats `per_print_step`'s default is found."""
    tree = ast.parse(f"def f(per_print_step: int = {schema.MonitorConfig.per_print_step}, other: int = 3): pass")
    found = [(n, v) for _, n, v in literal_defaults(tree) if v in schema_defaults().get(n, ())]
    assert found == [("per_print_step", schema.MonitorConfig.per_print_step)]
