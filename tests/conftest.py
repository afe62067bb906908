"""Shared test helpers: run the real CLI in a subprocess and check nothing is left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import suite_schedule

# mindspore's generated protobuf code loads only with the pure-Python implementation once
# something else (tensorboard, Ray) imported protobuf first: tests import them in any order
os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"

# processes a run may start: none may outlive the launcher
_RUN_PROCESS_NAMES = ("raylet", "gcs_server", "ray::", "mindpulse.workers.scheduler", "default_worker.py",
                      "mindpulse.workers.rank_main", "msrun", "mindpulse.launcher.ray_session")
# what marks a process as a run's in its environment: the embedded cluster's tag (its Ray temp
# dir, inherited by every process of the run) and a rank's settings path (in the run dir).
# msrun starts its workers in sessions of their own with command lines that name neither
# the Ray temp dir nor a Ray process: only their environment (and the job.json path) says whose
_RUN_ENV_MARKS = ("MINDPULSE_RUN_TAG", "MINDPULSE_SETTINGS")


def _run_processes() -> dict[int, str]:
    """pid → what identifies it as a process of some run: its environment marks first (so
    that `tdir in text` / `run_dir in text` finds msrun's ranks too), then its command line."""
    found = {}
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or []) or (p.info["name"] or "")
            try:
                env = p.environ()
            except (psutil.AccessDenied, psutil.ZombieProcess, OSError):
                env = {}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        marks = " ".join(f"[{k}={env[k]}]" for k in _RUN_ENV_MARKS if env.get(k))
        if marks or any(k in cmd for k in _RUN_PROCESS_NAMES):
            found[p.info["pid"]] = (marks + " " + cmd[:300]).strip()
    return found


def run_leftovers(before: set[int], run_dir: Path | None, pids: dict) -> dict[int, str]:
    """The processes of one run still alive: every pid it reported, and every process that
    names its Ray temp dir or its run directory (command line or environment)."""
    left: dict[int, str] = {}
    keys = [k for k in (pids.get("ray_temp_dir"), pids.get("run_tag"), str(run_dir) if run_dir else None) if k]
    if keys:
        left.update({p: c for p, c in _run_processes().items() if p not in before and any(k in c for k in keys)})
    ranks = list((pids.get("ranks") or {}).values()) + list((pids.get("agents") or {}).values())
    for pid in ranks + [pids.get("scheduler")]:
        try:
            if pid and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left[pid] = "reported by the run"
        except psutil.Error:
            pass
    return left


def run_pids(run_dir: Path | None) -> dict:
    """The run's pids: summary.json's, else pids.json's (a launcher that died wrote no summary)."""
    if run_dir is None:
        return {}
    for name, key in (("summary.json", "pids"), ("pids.json", None)):
        try:
            data = json.loads((run_dir / name).read_text())
        except (OSError, ValueError):
            continue
        return (data.get(key) if key else data) or {}
    return {}


class CliRun:
    def __init__(self, proc: subprocess.CompletedProcess, out_root: Path):
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        dirs = sorted(d for d in out_root.iterdir() if d.is_dir()) if out_root.exists() else []
        self.run_dir = dirs[-1] if dirs else None

    @property
    def summary(self) -> dict:
        assert self.run_dir is not None, f"no run directory was made\n{self.output}"
        path = self.run_dir / "summary.json"
        assert path.exists(), f"summary.json missing in {self.run_dir}\n{self.output}"
        return json.loads(path.read_text())

    @property
    def output(self) -> str:
        return f"--- stdout ---\n{self.stdout[-6000:]}\n--- stderr ---\n{self.stderr[-6000:]}"


NO_REPORT = ["--set", "output.report=false"]
"""For launches whose test does not read the report: it is built in ~2 s after the summary
(matplotlib), and tested on its own (tests/unit/test_report.py, test_report_browser.py) and
in the launches that ask for it."""


def mindpulse_cmd() -> list[str]:
    return [sys.executable, "-m", "mindpulse.launcher.cli"]


@pytest.fixture
def run_cli(tmp_path, request):
    """Run `mindpulse ARGS` with output.root in tmp_path; assert no process is left behind."""
    before = set(_run_processes())
    runs: list[CliRun] = []

    # a launch takes every core and its checks judge speed: `make test` runs it alone
    assert request.node.get_closest_marker("cluster"), f"{request.node.nodeid} launches: mark it cluster"

    def _run(*args: str, timeout: float = 600, env: dict | None = None, report: bool = False,
             exe: list[str] | None = None, cwd: Path | None = None) -> CliRun:
        """`report`: build the HTML report (~2 s a launch; only tests that check it ask);
        `exe`/`cwd`: another installed `mindpulse` command, run from another folder."""
        out_root = tmp_path / "runs"
        cmd = (exe or mindpulse_cmd()) + list(args)
        if args and args[0] in ("launch", "preflight"):
            cmd += ["--set", f"output.root={out_root}"]
        if args and args[0] == "launch" and not report:
            cmd += NO_REPORT
        proc = subprocess.run(cmd, cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, **(env or {})))
        r = CliRun(proc, out_root)
        runs.append(r)
        return r

    yield _run
    # every pid the run reported, and every process of the run's own Ray session or run
    # directory (its temp dir or run dir in their command lines or environment: msrun's
    # ranks too), must be gone; other Ray users on the machine are not ours
    deadline = time.time() + 20
    leftovers: dict[int, str] = {}
    while time.time() < deadline:
        leftovers = {}
        for r in runs:
            if r.run_dir:
                leftovers.update(run_leftovers(before, r.run_dir, run_pids(r.run_dir)))
        if not leftovers:
            break
        time.sleep(0.5)
    for pid in leftovers:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert not leftovers, f"processes left running after the launcher exited: {leftovers}"


def last_steps(run_dir: Path) -> dict[int, int]:
    """Each rank's newest step in a run's metrics (every segment)."""
    from mindpulse.rundir.metrics_store import read_wire

    out: dict[int, int] = {}
    if not (Path(run_dir) / "metrics.msgpack").exists():
        return out
    for o in read_wire(Path(run_dir) / "metrics.msgpack"):
        if o.get("t") == "step":
            out[o["rank"]] = max(out.get(o["rank"], 0), o["step"])
    return out


def step_packets(run_dir: Path) -> list[dict]:
    """Every step packet of a run, as `metrics.msgpack` holds them."""
    from mindpulse.rundir.metrics_store import read_wire

    return [o for o in read_wire(Path(run_dir) / "metrics.msgpack") if o.get("t") == "step"]


def assert_every_step_from_every_rank(run_dir: Path, steps: int, world: int) -> list[dict]:
    pk = step_packets(run_dir)
    seen = {(o["rank"], o["step"]) for o in pk}
    missing = [(r, s) for r in range(world) for s in range(0, steps + 1) if (r, s) not in seen]
    assert not missing, f"the aggregator never got these (rank, step) packets: {missing}"
    return pk


# Cluster tests run side by side (`make test`: pytest-xdist, `--dist loadgroup`): the tests that
# share a module fixture stay in one worker, every other one is a unit of its own, longest first
# (tests/suite_schedule.py). tryfirst: xdist reads the group marks in its own collection hook,
# which must see these.
def pytest_addoption(parser):
    parser.addoption("--cluster-durations-out", default=None, metavar="PATH",
                     help="write each test's seconds (merged into PATH's): the order the cluster tests start in "
                          "(tests/cluster_durations.json)")


def pytest_configure(config):
    out = config.getoption("--cluster-durations-out")
    if out:
        config.pluginmanager.register(suite_schedule.DurationRecorder(Path(out)), "cluster-durations")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    suite_schedule.assign_groups(items)
    items[:] = suite_schedule.longest_first(items, suite_schedule.load_durations())
