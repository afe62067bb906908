"""`make test` runs the cluster tests side by side (`-n 3 --dist loadgroup --no-loadscope-reorder`)
under the rules of tests/suite_schedule.py: the tests that share a module-scoped fixture (one
launch or cluster serving several checks) run in one worker, the multi-host test beds one at a
time, every other test is a unit of its own, and the units start longest first.
Here real integration files are scheduled by the real pytest-xdist, each test recorded instead
of run, and the workers they landed in, and the order, are checked."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from suite_schedule import load_durations, plain_id

ROOT = Path(__file__).resolve().parents[2]

RECORDER = '''
import os, pytest
from _pytest.reports import TestReport

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    shared = sorted(n for n, defs in item._fixtureinfo.name2fixturedefs.items() if defs and defs[-1].scope == "module")
    with open(os.environ["GROUPS_OUT"], "a") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER')} {','.join(shared) or '-'} {item.nodeid}\\n")
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for when in ("setup", "call", "teardown"):
        item.ihook.pytest_runtest_logreport(report=TestReport(item.nodeid, item.location, {}, "passed", None, when, []))
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True
'''

FILES = ["test_processes.py", "test_faults.py", "test_multihost.py", "test_headless_head.py",
         "test_unmodified_scripts.py"]


@pytest.mark.slow
def test_module_fixtures_keep_their_tests_together_and_the_longest_start_first(tmp_path):
    (tmp_path / "record_workers.py").write_text(RECORDER)
    out = tmp_path / "workers.txt"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               GROUPS_OUT=str(out))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "record_workers", "-p", "no:cacheprovider",
                        "-m", "cluster and not exclusive", "-n", "3", "--dist", "loadgroup", "--no-loadscope-reorder",
                        *(f"tests/integration/{f}" for f in FILES)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [line.split(" ", 2) for line in out.read_text().splitlines()]
    assert {n.split("::")[0].rsplit("/", 1)[-1] for _, _, n in rows} == set(FILES), rows
    # a module fixture's tests in one worker
    by_fixture: dict[tuple[str, str], set[str]] = defaultdict(set)
    for worker, shared, nodeid in rows:
        if shared != "-":
            by_fixture[(nodeid.split("::")[0], shared)].add(worker)
    expected = {"tests/integration/test_processes.py", "tests/integration/test_multihost.py"}
    assert {f for f, _ in by_fixture} >= expected, f"no module fixture recorded: {sorted(by_fixture)}"
    split = {k: sorted(w) for k, w in by_fixture.items() if len(w) > 1}
    assert not split, f"tests sharing a module fixture ran in several workers (xdist groups ignored?): {split}"
    # the multi-host test beds one at a time: in one worker
    beds = {w for w, _, n in rows if "test_multihost.py" in n or "test_headless_head.py" in n}
    assert len(beds) == 1, f"the multi-host test beds ran in workers {sorted(beds)}"
    # the rest are units of their own: xdist joins no two of a file's independent tests (a test in
    # a group carries "@group" in its node id; `plain_id` takes it off). Which worker takes which
    # unit is not checked: recorded, not run, every test ends at once, and a fresh-clone run saw
    # one worker take them all while the others were being handed their next units
    alone = [n for _, s, n in rows if "test_unmodified_scripts.py" in n and s == "-"]
    assert len(alone) > 1 and all(plain_id(n) == n for n in alone), \
        f"a file's independent tests were put in a group (one worker would run them all): {alone}"
    assert all(plain_id(n) != n for _, s, n in rows if s != "-"), "a test sharing a module fixture has no group"
    # the longest unit (by tests/cluster_durations.json) is the first test of a worker
    durations = load_durations()
    first = {}
    for worker, _, nodeid in rows:
        first.setdefault(worker, plain_id(nodeid))
    units: dict[str, float] = defaultdict(float)
    for _, shared, nodeid in rows:
        key = f"{nodeid.split('::')[0]}|{shared}" if shared != "-" else plain_id(nodeid)
        units[key] += durations.get(plain_id(nodeid), 0.0)
    longest = max(units, key=units.get)
    starters = {f"{n.split('::')[0]}|{s}" if s != "-" else plain_id(n) for w, s, n in rows
                if plain_id(n) == first[w]}
    assert longest in starters, f"the longest unit {longest} ({units[longest]:.0f} s) did not start first: {first}"
