"""Which of the project's modules running code enters, in order, thread by thread.

A `ModuleTrace` is a `sys.setprofile` / `threading.setprofile` hook over the real code: while
it is `active`, every call into a frame of a project file (the repository's own Python files;
the virtualenv, the standard library and the tests are left out) whose caller is in another
module, or outside the project (the event loop, a socket callback, MindSpore calling a
callback), is an *entry* into that module, recorded under the name of the thread that made
it. Generated code (a dataclass's `__init__`, whose file is `<string>`) is looked through:
the caller is the project frame below it. A resumed generator or coroutine is entered like a
called function.

Install it before the threads to be traced start (`threading.setprofile` reaches only the
threads started after it), and keep it inactive until the stretch of interest.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any


class ModuleTrace:
    def __init__(self, root: Path, leave_out: tuple[str, ...] = (".venv", "tests", "bench", "build")):
        self.root = str(Path(root).resolve()) + os.sep
        self.leave_out = tuple(d + os.sep for d in leave_out)
        self._modules: dict[str, str | None] = {}
        self.active = False
        self.entries: dict[str, list[str]] = {}
        """Thread name → the modules it entered, in order, every entry."""
        self.closed: set[str] = set()
        """Threads whose part is over: what they enter from now on is not recorded."""
        self._lock = threading.Lock()

    def module(self, filename: str) -> str | None:
        """`filename` relative to the repository when it is one of the project's modules."""
        known = self._modules.get(filename, "")
        if known != "":
            return known
        rel: str | None = None
        if filename.endswith(".py") and not filename.startswith("<"):
            path = os.path.realpath(filename)
            if path.startswith(self.root):
                rel = path[len(self.root):]
                if rel.startswith(self.leave_out):
                    rel = None
        self._modules[filename] = rel
        return rel

    def _hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not self.active:
            return
        mod = self.module(frame.f_code.co_filename)
        if mod is None:
            return
        caller = frame.f_back
        while caller is not None and caller.f_code.co_filename.startswith("<"):
            caller = caller.f_back
        if caller is not None and self.module(caller.f_code.co_filename) == mod:
            return
        name = threading.current_thread().name
        if name in self.closed:
            return
        with self._lock:
            self.entries.setdefault(name, []).append(mod)

    def install(self) -> None:
        threading.setprofile(self._hook)
        sys.setprofile(self._hook)

    def uninstall(self) -> None:
        self.active = False
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]

    def take(self) -> dict[str, list[str]]:
        """What was recorded so far (and a fresh record, every thread open again)."""
        with self._lock:
            entries, self.entries = self.entries, {}
            self.closed = set()
        return entries

    def first_entries(self, thread: str) -> list[str]:
        """The modules `thread` entered, each once, in the order first entered."""
        return list(dict.fromkeys(self.entries.get(thread, [])))

    def counts(self, thread: str) -> Counter[str]:
        """How many times `thread` entered each module."""
        return Counter(self.entries.get(thread, []))
