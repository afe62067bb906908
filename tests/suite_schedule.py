"""How `make test` spreads the cluster tests over its workers (pytest-xdist, `--dist loadgroup`).

A launch spends much of its time waiting (Ray's start, the ranks' imports, a fault's timeout),
so a few run side by side. Two rules decide what may run apart:

- Tests that share a module-scoped fixture (one launch or one cluster serving several checks)
  form one group, named for their file and those fixtures, and run in one worker one after
  another. A file may name a group of its own instead: the multi-host test beds
  (`xdist_group("netns")`) run one at a time. Each bed has its own bridge and namespaces, so
  beds with the same addresses would not see each other, but each is a cluster of 2-3 Ray
  nodes and 4 ranks, and three at once beside the other launches overloaded 2 cores (Ray
  gives a new raylet a fixed 30 s to register). Every other cluster test is a unit of its own:
  it starts and ends its own cluster on free ports.
- The units start longest first (the longest-processing-time rule), so that the short ones fill
  the end and no worker is left running one long test alone while the others idle. Their
  lengths come from tests/cluster_durations.json, written by a run with
  `--cluster-durations-out tests/cluster_durations.json`; a test it does not list counts as
  the longest (a new test starts early rather than last). The file only orders the units:
  a stale one makes the suite slower, never wrong.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

DURATIONS = Path(__file__).resolve().parent / "cluster_durations.json"
SHARED_SCOPES = ("module", "class", "package")
"""Fixture scopes that outlive one test: the tests using one such fixture must share a worker."""


def shared_fixtures(item: pytest.Item) -> list[str]:
    """The module- (class-, package-) scoped fixtures an item uses, sorted."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return sorted(name for name, defs in info.name2fixturedefs.items() if defs and defs[-1].scope in SHARED_SCOPES)


def group_of(item: pytest.Item) -> str | None:
    """The xdist group an unmarked cluster test joins: its file and shared fixtures; None where
    it uses none (a unit of its own)."""
    shared = shared_fixtures(item)
    return f"{Path(str(item.fspath)).stem}.{'+'.join(shared)}" if shared else None


def unit_of(item: pytest.Item) -> str:
    """What xdist schedules the item with: its group where it has one, else the item alone."""
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    return item.nodeid


def plain_id(nodeid: str) -> str:
    """A node id without the `@group` suffix xdist adds to grouped tests."""
    at, bracket = nodeid.rfind("@"), nodeid.rfind("]")
    return nodeid[:at] if at > bracket else nodeid


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # no file, or a broken one: every unit counts the same
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, (int, float))}


def longest_first(items: list[pytest.Item], durations: dict[str, float]) -> list[pytest.Item]:
    """The items reordered so that the cluster units with the most seconds come first (a stable
    sort: a unit's items keep their order); the other items after them, in their order."""
    unknown = max(durations.values(), default=0.0)
    seconds: dict[str, float] = {}
    for item in items:
        if item.get_closest_marker("cluster"):
            unit = unit_of(item)
            seconds[unit] = seconds.get(unit, 0.0) + durations.get(plain_id(item.nodeid), unknown)
    return sorted(items, key=lambda it: -seconds.get(unit_of(it), -1.0) if it.get_closest_marker("cluster")
                  else 1.0)


class DurationRecorder:
    """Adds up each test's setup, call and teardown seconds; writes them (merged into what the
    file held) at the end of the session, on the controller only."""

    def __init__(self, path: Path):
        self.path = path
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.outcome != "skipped":
            key = plain_id(report.nodeid)
            self.seconds[key] = self.seconds.get(key, 0.0) + float(report.duration)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(session.config, "workerinput") or not self.seconds:
            return
        merged = load_durations(self.path)
        merged.update({k: round(v, 1) for k, v in self.seconds.items()})
        self.path.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")


def assign_groups(items: Iterable[pytest.Item]) -> None:
    """Mark each cluster test that shares a module fixture with its group (see the docstring)."""
    for item in items:
        if item.get_closest_marker("cluster") and not item.get_closest_marker("xdist_group"):
            group = group_of(item)
            if group is not None:
                item.add_marker(pytest.mark.xdist_group(group))
