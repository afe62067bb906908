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

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"

# processes a run may start: none may outlive the launcher
_RUN_PROCESS_NAMES = ("raylet", "gcs_server", "ray::", "mindpulse.workers.scheduler", "default_worker.py")


def _run_processes() -> dict[int, str]:
    found = {}
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or []) or (p.info["name"] or "")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if any(k in cmd for k in _RUN_PROCESS_NAMES):
            found[p.info["pid"]] = cmd[:200]
    return found


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


def mindpulse_cmd() -> list[str]:
    return [sys.executable, "-m", "mindpulse.launcher.cli"]


@pytest.fixture
def run_cli(tmp_path):
    """Run `mindpulse ARGS` with output.root in tmp_path; assert no process is left behind."""
    before = set(_run_processes())
    runs: list[CliRun] = []

    def _run(*args: str, timeout: float = 600, env: dict | None = None) -> CliRun:
        out_root = tmp_path / "runs"
        cmd = mindpulse_cmd() + list(args)
        if args and args[0] == "launch":
            cmd += ["--set", f"output.root={out_root}"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, **(env or {})))
        r = CliRun(proc, out_root)
        runs.append(r)
        return r

    yield _run
    # every pid the run reported, and every process of the run's own Ray session (its temp
    # dir is in their command lines), must be gone; other Ray users on the machine are not ours
    deadline = time.time() + 20
    leftovers: dict[int, str] = {}
    while time.time() < deadline:
        leftovers = {}
        for r in runs:
            if r.run_dir and (r.run_dir / "summary.json").exists():
                pids = json.loads((r.run_dir / "summary.json").read_text()).get("pids", {})
                tdir = pids.get("ray_temp_dir")
                if tdir:
                    leftovers.update({p: c for p, c in _run_processes().items() if p not in before and tdir in c})
                ranks = list((pids.get("ranks") or {}).values()) + list((pids.get("agents") or {}).values())
                for pid in ranks + [pids.get("scheduler")]:
                    if pid and psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                        leftovers[pid] = "reported by the run"
        if not leftovers:
            break
        time.sleep(0.5)
    for pid in leftovers:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert not leftovers, f"processes left running after the launcher exited: {leftovers}"
