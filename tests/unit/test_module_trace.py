"""The tracer under test_step_path: what counts as entering a module (tests/module_trace.py)."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path

from module_trace import ModuleTrace

A = '''
from b import Point, twice


def run():
    total = twice(2) + twice(3)       # two entries into b
    Point(1)                          # the dataclass's generated __init__ is looked through
    return total + _own()


def _own():                           # a call within a: no entry
    return 0
'''
B = '''
from dataclasses import dataclass


def twice(x):
    return _double(x)                 # a call within b: no entry


def _double(x):
    return 2 * x


@dataclass
class Point:
    x: int

    def __post_init__(self):          # called by the generated __init__: an entry from a
        self.x = abs(self.x)
'''


def _load(root: Path):
    (root / "a.py").write_text(A)
    (root / "b.py").write_text(B)
    sys.path.insert(0, str(root))
    try:
        spec = importlib.util.spec_from_file_location("a", root / "a.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("b", None)


def test_entries_are_calls_from_another_module_in_order(tmp_path):
    a = _load(tmp_path)
    trace = ModuleTrace(tmp_path)
    trace.install()
    try:
        trace.active = True
        a.run()
        trace.active = False
        a.run()  # inactive: not recorded
    finally:
        trace.uninstall()
    name = threading.current_thread().name
    assert trace.entries[name] == ["a.py", "b.py", "b.py", "b.py"], trace.entries
    assert trace.first_entries(name) == ["a.py", "b.py"]
    assert trace.counts(name) == {"a.py": 1, "b.py": 3}


def test_other_threads_and_closed_ones(tmp_path):
    a = _load(tmp_path)
    trace = ModuleTrace(tmp_path)
    trace.install()
    try:
        trace.active = True
        worker = threading.Thread(target=a.run, name="worker")  # started after install: traced
        worker.start()
        worker.join()
        trace.closed.add(threading.current_thread().name)
        a.run()  # a closed thread: not recorded
        trace.active = False
    finally:
        trace.uninstall()
    taken = trace.take()
    assert taken == {"worker": ["a.py", "b.py", "b.py", "b.py"]}, taken
    assert trace.entries == {} and trace.closed == set()


def test_left_out_folders_are_not_the_project(tmp_path):
    (tmp_path / "tests").mkdir()
    trace = ModuleTrace(tmp_path)
    assert trace.module(str(tmp_path / "tests" / "x.py")) is None
    assert trace.module(str(tmp_path / "pkg" / "y.py")) == "pkg/y.py"
    assert trace.module("<string>") is None
    assert trace.module("/usr/lib/python3.11/asyncio/events.py") is None
