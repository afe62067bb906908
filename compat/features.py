"""One feature on one pair: a real short launch through the CLI in the pair's venv (2 ranks on
CPU, a few steps), judged by its exit code and its summary.json.

A cell passes when the launch exits 0 and its summary says: status succeeded, every step
completed, a first and a last loss, both ranks seen by the monitor at the last step, no
monitor error; the `Model.train` script also needs the Monitor added by auto-attach (its rank
logs say so). A failing cell keeps the first check that failed and the error the ranks or the
launcher printed last, for docs/compat.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from matrix import Feature
from venvs import ROOT, Venv

SCRIPTS = ROOT / "tests" / "integration" / "scripts"
RANKS = 2
LAUNCH_TIMEOUT_S = 600
AUTO_ATTACHED = "mindpulse added its Monitor to Model.train's callbacks"


@dataclass
class Cell:
    feature: Feature
    passed: bool
    seconds: float
    reason: str = ""
    """Why it failed: the check, then the error the run printed (empty when it passed)."""
    steps: int = 0
    first_loss: float | None = None
    last_loss: float | None = None


def launch_args(feature: Feature, steps: int, work: Path) -> list[str]:
    """The CLI arguments after `mindpulse` for `feature`: `steps` steps, 2 ranks, no report."""
    common = ["--set", f"monitor.per_print_step={steps}", "--set", "output.report=false",
              "--set", f"world.ranks_per_node={RANKS}"]
    if feature is Feature.SCRIPT_MODEL_TRAIN:
        args = ["--ckpt-dir", str(work / "ckpt_{rank}"), "--steps", str(steps), "--mode", "graph", "--cell", "model"]
        return ["launch", "--set", f"job.script={SCRIPTS / 'plain_train.py'}",
                "--set", "job.args=[" + ", ".join(f"'{a}'" for a in args) + "]", "--set", "train.steps=0", *common]
    if feature is Feature.SCRIPT_HAND_LOOP:
        args = ["--loop", "manual", "--steps", str(steps)]
        return ["launch", "--set", f"job.script={SCRIPTS / 'user_train.py'}",
                "--set", "job.args=[" + ", ".join(f"'{a}'" for a in args) + "]", "--set", "train.steps=0", *common]
    config = {Feature.MINDFORMERS_YAML: "mindformers_finetune.yaml", Feature.RECIPE: "local_cpu.yaml"}[feature]
    return ["launch", str(ROOT / "cluster_configs" / config), "--set", f"train.steps={steps}", *common]


def judge(feature: Feature, returncode: int, run_dir: Path | None, steps: int, output: str) -> tuple[bool, str]:
    """(passed, reason): the first check that failed, with the error the run printed."""
    summary: dict = {}
    if run_dir is not None and (run_dir / "summary.json").exists():
        summary = json.loads((run_dir / "summary.json").read_text())
    checks = [
        (returncode == 0, f"exit code {returncode}"),
        (bool(summary), "no summary.json"),
        (summary.get("status") == "succeeded", f"status {summary.get('status')}"),
        (summary.get("steps_completed") == steps, f"{summary.get('steps_completed')} of {steps} steps completed"),
        (_finite(summary.get("first_loss")) and _finite(summary.get("last_loss")), "no loss reached the aggregator"),
        (sorted((r["rank"], r["last_step"]) for r in summary.get("ranks", [])) == [(r, steps) for r in range(RANKS)],
         "the monitor did not see every rank at the last step: "
         + str([(r["rank"], r["last_step"]) for r in summary.get("ranks", [])])),
        (summary.get("monitor_errors", 0) == 0, f"{summary.get('monitor_errors')} monitor errors"),
    ]
    if feature is Feature.SCRIPT_MODEL_TRAIN:
        logs = [run_dir / "logs" / f"rank_{r}.log" for r in range(RANKS)] if run_dir else []
        attached = all(p.exists() and AUTO_ATTACHED in p.read_text(errors="replace") for p in logs)
        checks.append((attached, "auto-attach did not add the Monitor on every rank"))
    for ok, what in checks:
        if not ok:
            return False, f"{what}; {_last_error(run_dir, output, summary)}".rstrip("; ")
    return True, ""


def _finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


_ERROR = re.compile(r"^\s*(?:[\w.]+(?:Error|Exception)|RuntimeError|ImportError|ModuleNotFoundError)\b.*$", re.M)


def _last_error(run_dir: Path | None, output: str, summary: dict) -> str:
    """The last exception line a rank logged, else the summary's message, else the launcher's."""
    texts = []
    if run_dir is not None:
        texts += [p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("rank_*.log"))]
    for text in texts + [output]:
        found = _ERROR.findall(text)
        if found:
            return found[-1].strip()[:400]
    if summary.get("message"):
        return str(summary["message"])[:400]
    tail = [ln for ln in output.strip().splitlines() if ln.strip()]
    return tail[-1][:400] if tail else ""


@contextlib.contextmanager
def held(lock: Path | None):
    """An exclusive flock on `lock` while launches run (launches on a shared machine take
    every core: one at a time)."""
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cli(venv: Venv) -> list[str]:
    return [str(venv.python), "-m", "mindpulse.launcher.cli"]


def run(venv: Venv, feature: Feature, steps: int, keep: Path | None = None) -> Cell:
    """Launch `feature` in `venv` and judge it. The run directory goes under `keep` when given
    (for the failing cells' logs), else a temporary folder."""
    with tempfile.TemporaryDirectory(prefix=f"compat-{venv.pair.name}-") as tmp:
        work = Path(tmp)
        out_root = (keep / venv.pair.name / feature.value) if keep else work / "runs"
        args = launch_args(feature, steps, work) + ["--set", f"output.root={out_root}"]
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        env["PATH"] = f"{venv.python.parent}{os.pathsep}{env.get('PATH', '')}"
        started = time.monotonic()
        try:
            proc = subprocess.run(cli(venv) + args, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=LAUNCH_TIMEOUT_S)
            code, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            code, output = 124, f"timed out after {LAUNCH_TIMEOUT_S} s: {exc.stdout or ''}{exc.stderr or ''}"
        seconds = round(time.monotonic() - started, 1)
        dirs = sorted(d for d in out_root.iterdir() if d.is_dir()) if out_root.exists() else []
        run_dir = dirs[-1] if dirs else None
        passed, reason = judge(feature, code, run_dir, steps, output)
        if keep and not passed:
            out_root.mkdir(parents=True, exist_ok=True)
            (out_root / "launcher.log").write_text(output)
        path = run_dir / "summary.json" if run_dir else None
        summary = json.loads(path.read_text()) if path and path.exists() else {}
        return Cell(feature, passed, seconds, reason, summary.get("steps_completed") or 0,
                    summary.get("first_loss"), summary.get("last_loss"))
