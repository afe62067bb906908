"""`mindpulse launch`: run directory → Ray → attempts (controller) → summary.

This module composes the pieces: local checks, the run directory and its config.yaml,
the signal handlers (Ctrl-C/SIGTERM/SIGHUP stop every rank after the same step, or at once
before any step; a second one kills: `interrupts.py`), the Ray session, the controller that
runs the attempts (`controller.py`), and the summary (`summary.py`).
"""

from __future__ import annotations

import logging
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any, TextIO

from mindpulse.config import RunConfig

from . import card_check, doctor, mindformers_plan
from .controller import Controller
from .input_checks import check_inputs
from .paths import resolve_input
from .preflight import LaunchRefused, check_local
from .progress import Console
from .ray_session import RaySession
from .resume import carry_tracker_runs
from .rundir import PidFile, make_run_dir, write_config
from .spec import ExitCode, RunResult, RunStatus
from .summary import RunHistory, write_summary
from .supervision import Interrupts

log = logging.getLogger(__name__)

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Launch:
    def __init__(self, cfg: RunConfig, config_path: Path | None, out: TextIO = sys.stdout,
                 resume: dict[str, Any] | None = None, resumed_run: Path | None = None):
        self.cfg = cfg
        self.resume = resume
        self.config_path = config_path
        self.out = out
        self.run_dir = make_run_dir(cfg)
        # `--resume RUN_DIR`: its tracker runs continue in this run (before any aggregator starts)
        self.carried = (carry_tracker_runs(resumed_run, self.run_dir, enabled=cfg.sinks.enabled)
                        if resumed_run is not None else [])
        self.run_id = f"{self.run_dir.name}-{uuid.uuid4().hex[:6]}"
        self.started = time.time()
        self.interrupts = Interrupts()
        self.pids = PidFile(self.run_dir)
        self.console = Console(out)
        self.summary: dict[str, Any] = {}

    def say(self, text: str) -> None:
        self.console.say(text)

    def _resolve_paths(self) -> None:
        """Relative paths in the config are resolved against the config file's folder."""
        base = self.config_path.parent if self.config_path else Path.cwd()
        job = self.cfg.job
        if job.script:
            p = Path(job.script)
            if not p.is_absolute():
                p = (base / p) if (base / p).exists() else (Path.cwd() / p)
            job.script = str(p.resolve())
        if job.recipe:
            for key in ("init_from", "train_file", "valid_file"):
                if getattr(job.recipe, key):
                    setattr(job.recipe, key, resolve_input(getattr(job.recipe, key), base))
        swan = self.cfg.sinks.swanlab
        if swan.logdir:  # the aggregator's working folder is not necessarily this one
            swan.logdir = str(Path(swan.logdir).expanduser().absolute())
        mindformers_plan.resolve_paths(self.cfg, self.config_path)

    def _config_hint(self) -> str:
        return str(self.config_path) if self.config_path else "CONFIG"

    def _refuse(self, exc: LaunchRefused) -> int:
        """Nothing ran: say why and leave no run directory behind."""
        print(f"mindpulse: {exc}", file=sys.stderr, flush=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return int(ExitCode.USAGE)

    def run(self) -> int:
        self._resolve_paths()
        try:
            check_local(self.cfg)
            mindformers_plan.check(self.cfg, str(self.run_dir))  # a MindFormers YAML: read and checked now
            check_inputs(self.cfg)  # the files the ranks open, a script that would not compile, trackers' folders
            card_check.check_faults(self.cfg, card_check.enabled(self.cfg))
        except LaunchRefused as exc:
            return self._refuse(exc)
        write_config(self.run_dir, self.cfg)
        self.say(f"mindpulse: run directory {self.run_dir}")
        for line in self.carried:
            self.say(f"mindpulse: {line}")
        # the framework check: on the embedded cluster its probe runs while Ray starts
        framework_probe = doctor.start(self.cfg)
        old = {s: signal.signal(s, self.interrupts.on_signal) for s in HANDLED_SIGNALS}
        result = RunResult(status=RunStatus.FAILED, message="launcher did not start")
        snapshot: dict[str, Any] = {}
        history = RunHistory(logs_dir=self.run_dir / "logs", resume=self.resume)
        try:
            with RaySession(self.cfg) as session:
                self.pids["ray_temp_dir"] = session.temp_dir
                # Ray's core installs its own SIGTERM handler at init: ours must come after
                for sig in HANDLED_SIGNALS:
                    signal.signal(sig, self.interrupts.on_signal)
                # every node's MindSpore (and MindFormers, CANN, driver) against the supported
                # ranges: a node that does not fit refuses the launch before any rank starts
                doctor.gate(self.cfg, framework_probe, self.console, self._config_hint())
                # the pre-flight card check (preflight.enabled): a refusal ends the launch before training
                refused = card_check.gate(self.cfg, run_dir=self.run_dir, run_id=self.run_id, session=session,
                                          pids=self.pids, console=self.console, interrupts=self.interrupts) \
                    if card_check.enabled(self.cfg) else None
                controller = Controller(self.cfg, run_dir=self.run_dir, run_id=self.run_id, session=session,
                                        resume=self.resume, pids=self.pids, console=self.console,
                                        interrupts=self.interrupts, started=self.started)
                history = controller.history
                result, snapshot = controller.run() if refused is None else (refused, {})
        except LaunchRefused as exc:
            for s, h in old.items():
                signal.signal(s, h)
            return self._refuse(exc)
        # any launcher error becomes a failed run (logged): its message goes into the summary
        except Exception as exc:
            log.exception("launcher failed")
            result = RunResult(status=RunStatus.FAILED, message=f"launcher error: {type(exc).__name__}: {exc}")
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            if framework_probe is not None:
                framework_probe.cancel()  # a launch that ended before reading its answer leaves no probe running
        status, self.summary = write_summary(self.cfg, self.run_dir, result, snapshot, history, self.pids.pids,
                                             self.started, self.say)
        return int(ExitCode.of(status))


def launch(cfg: RunConfig, config_path: Path | None, resume: dict[str, Any] | None = None,
           resumed_run: Path | None = None) -> int:
    """`resumed_run`: the run directory `--resume` names (its tracker runs continue here)."""
    return Launch(cfg, config_path, resume=resume, resumed_run=resumed_run).run()
