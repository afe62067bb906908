"""`--resume RUN_DIR [--resume-from best|latest|PATH]`: pick a valid checkpoint to continue
from; carry RUN_DIR's tracker runs into the new run directory (`carry_tracker_runs`); before
every attempt, make the resumed line the manifest's (`supersede_newer`) and hand its best to
the new aggregator (`best_seed`)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mindpulse.config import ConfigError


def resolve_resume(run_dir: Path, which: str = "latest") -> tuple[dict[str, Any], Path]:
    """Returns ({path, step, epoch, kind, refused: [...]}, the run's config.yaml).

    A checkpoint whose sha256 (or size) does not match the manifest is refused with a
    message and the next valid one is used; none valid, or a malformed manifest, is a
    usage error (exit 2) that names the file.
    """
    from mindpulse.rundir.checkpoint_manifest import ManifestError

    try:
        return _resolve(Path(run_dir), which)
    except ManifestError as exc:
        raise ConfigError(f"--resume: malformed checkpoint manifest: {exc}") from None


def _resolve(run_dir: Path, which: str) -> tuple[dict[str, Any], Path]:
    from mindpulse.rundir.checkpoint_manifest import choose_resume, known_entries, verify

    run_dir = run_dir.resolve()
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.exists():
        raise ConfigError(f"--resume: {run_dir} is not a mindpulse run directory (no config.yaml)")
    ckpt_dir = run_dir / "checkpoints"
    if which not in ("best", "latest"):
        path = Path(which).resolve()
        if not path.is_file():
            raise ConfigError(f"--resume-from: {path} does not exist; use best, latest or a checkpoint file")
        known = known_entries(path.parent)
        entry = next((e for e in known if e.path == path.name), None)
        if entry is not None:
            why = verify(path.parent, entry)
            if why:
                raise ConfigError(f"--resume-from: refused {path}: {why}")
            return {"path": str(path), "step": entry.step, "epoch": entry.epoch, "kind": entry.kind,
                    "refused": []}, cfg_path
        m = re.search(r"step_(\d+)", path.name)
        if not m:
            raise ConfigError(f"--resume-from: {path} is not in a manifest and its name has no step_N")
        return {"path": str(path), "step": int(m.group(1)), "epoch": 0, "kind": "file", "refused": []}, cfg_path
    if not (ckpt_dir / "manifest.json").exists():
        raise ConfigError(f"--resume: {run_dir} has no checkpoints/manifest.json; nothing to resume from")
    entry, refused = choose_resume(ckpt_dir, which)
    if entry is None:
        detail = "; ".join(refused) if refused else f"no {which} checkpoint listed"
        raise ConfigError(f"--resume: no valid checkpoint in {ckpt_dir} ({detail})")
    return {"path": str(ckpt_dir / entry.path), "step": entry.step, "epoch": entry.epoch, "kind": entry.kind,
            "refused": refused}, cfg_path


def carry_tracker_runs(resumed_run: Path, run_dir: Path, enabled: Iterable[str]) -> list[str]:
    """`--resume RUN_DIR`: RUN_DIR's `trackers.json` (each tracker's run id) is written into the
    new run directory before its aggregator starts, so the MLflow and SwanLab sinks continue the
    tracker runs the resumed job logged to (each sink starts a new run, and says why, where its
    config changed since: another tracking URI or experiment, another SwanLab mode or project).
    A RUN_DIR without one carries nothing; one that cannot be read is said, naming the file, and
    the trackers start new runs. `enabled`: the trackers this launch's config turns on, the only
    ones said to continue (the others' ids are kept for a later launch). Returns lines to show."""
    from mindpulse.rundir.rundir_io import write_json_atomic
    from mindpulse.rundir.tracker_runs import TRACKERS_FILE, TrackerFailed, TrackerIds

    try:
        runs = TrackerIds(Path(resumed_run)).read()
    except TrackerFailed as exc:
        return [f"WARNING --resume: {exc}; the trackers start new runs"]
    if not runs:
        return []
    write_json_atomic(Path(run_dir) / TRACKERS_FILE, runs)
    on = set(enabled)
    named = [f"{name} {entry.get('run_id')}" for name, entry in sorted(runs.items())
             if isinstance(entry, dict) and name in on]
    return [f"tracker runs continued from {Path(resumed_run) / TRACKERS_FILE}: " + ", ".join(named)] if named else []


def supersede_newer(resume: dict[str, Any] | None) -> list[str]:
    """Before an attempt starts from `resume`: the manifest that lists the resume
    checkpoint moves its entries of later steps to its `superseded` list (files kept), so
    `latest` and `best` mean the line this attempt continues. One place for `--resume` and
    for a restart (which resumes from the newest valid one: only refused files are newer).
    A start from scratch (None) or a file in no manifest cuts nothing. Returns lines to show."""
    from mindpulse.rundir.checkpoint_manifest import ManifestError, read_manifest, supersede_after

    if resume is None:
        return []
    path = Path(resume["path"])
    ckpt_dir, step = path.parent, int(resume["step"])
    try:
        if not any(e.path == path.name for e in read_manifest(ckpt_dir)):
            return []  # a file given by path, in no manifest: no line to cut
        newer = supersede_after(ckpt_dir, step, note=f"resumed from step {step}")
    except (ManifestError, OSError) as exc:
        return [f"WARNING the checkpoints newer than step {step} stay listed: {exc}"]
    if not newer:
        return []
    names = ", ".join(e.path for e in newer)
    return [f"{ckpt_dir / 'manifest.json'}: {len(newer)} checkpoint(s) newer than step {step} superseded "
            f"(kept on disk, no longer latest or best): {names}"]


def best_seed(ckpt_dir: Path) -> dict[str, Any] | None:
    """The best checkpoint the run's manifest lists (a whole file), as the aggregator's
    starting best: {metric, metric_name, step, path}; None when there is none."""
    from mindpulse.rundir.checkpoint_manifest import ManifestError, read_manifest, verify

    try:
        best = [e for e in read_manifest(ckpt_dir) if e.kind == "best" and e.metric is not None]
    except (ManifestError, OSError):
        return None
    for e in sorted(best, key=lambda e: e.time, reverse=True):
        if verify(ckpt_dir, e) is None:
            return {"metric": e.metric, "metric_name": e.metric_name, "step": e.step,
                    "path": str(Path(ckpt_dir) / e.path)}
    return None


def rollback_point(ckpt_dir: Path, before_step: int) -> tuple[dict[str, Any] | None, list[str]]:
    """The newest valid checkpoint strictly before `before_step` (a rollback's target), as a
    resume dict, or None (no such checkpoint: the rollback starts from the beginning);
    with the files refused on the way (their sha256 or size does not match)."""
    from mindpulse.rundir.checkpoint_manifest import ManifestError, read_manifest, verify

    try:
        entries = [e for e in read_manifest(ckpt_dir) if e.step < before_step]
    except (ManifestError, OSError) as exc:
        return None, [f"the checkpoint manifest cannot be read ({exc})"]
    refused = []
    for e in sorted(entries, key=lambda e: (e.step, e.time), reverse=True):
        why = verify(ckpt_dir, e)
        if why is None:
            return {"path": str(Path(ckpt_dir) / e.path), "step": e.step, "epoch": e.epoch, "kind": e.kind,
                    "refused": refused}, refused
        refused.append(why)
    return None, refused
