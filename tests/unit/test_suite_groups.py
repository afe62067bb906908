"""`make test` runs the cluster tests side by side (`-n 3 --dist loadgroup`) only because each
test file stays in one worker (its module-scoped launch serves several checks; its launches
are not meant to overlap) and the two multi-host files, which share one fixed subnet, stay in
one worker together. Here the real integration files are scheduled by the real pytest-xdist,
each test recorded instead of run, and the workers they landed in are checked."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

RECORDER = '''
import os, pytest
from _pytest.reports import TestReport

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    with open(os.environ["GROUPS_OUT"], "a") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER')} {item.nodeid}\\n")
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for when in ("setup", "call", "teardown"):
        item.ihook.pytest_runtest_logreport(report=TestReport(item.nodeid, item.location, {}, "passed", None, when, []))
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True
'''


@pytest.mark.slow
def test_each_cluster_file_runs_in_one_worker_and_the_subnet_files_together(tmp_path):
    (tmp_path / "record_workers.py").write_text(RECORDER)
    out = tmp_path / "workers.txt"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               GROUPS_OUT=str(out))
    files = ["test_processes.py", "test_faults.py", "test_multihost.py", "test_headless_head.py",
             "test_unmodified_scripts.py"]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "record_workers", "-p", "no:cacheprovider",
                        "-m", "cluster and not exclusive", "-n", "3", "--dist", "loadgroup",
                        *(f"tests/integration/{f}" for f in files)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    workers: dict[str, set[str]] = defaultdict(set)
    for line in out.read_text().splitlines():
        worker, nodeid = line.split(" ", 1)
        workers[nodeid.split("::")[0].rsplit("/", 1)[-1]].add(worker)
    assert set(workers) == set(files), f"recorded files: {sorted(workers)}"
    split = {f: sorted(w) for f, w in workers.items() if len(w) > 1}
    assert not split, f"a file's tests ran in several workers (xdist groups ignored?): {split}"
    assert workers["test_multihost.py"] == workers["test_headless_head.py"], (
        "the two multi-host files share one subnet and must run in one worker")
    assert len(set().union(*workers.values())) > 1, "the groups were not spread over the workers"
