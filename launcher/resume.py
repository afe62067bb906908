"""`--resume RUN_DIR [--resume-from best|latest|PATH]`: pick a valid checkpoint to continue from."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mindpulse.config import ConfigError


def resolve_resume(run_dir: Path, which: str = "latest") -> tuple[dict[str, Any], Path]:
    """Returns ({path, step, epoch, kind, refused: [...]}, the run's config.yaml).

    A checkpoint whose sha256 (or size) does not match the manifest is refused with a
    message and the next valid one is used; none valid is a usage error (exit 2).
    """
    from mindpulse.workers.checkpoint import choose_resume, read_manifest, verify

    run_dir = Path(run_dir).resolve()
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.exists():
        raise ConfigError(f"--resume: {run_dir} is not a mindpulse run directory (no config.yaml)")
    ckpt_dir = run_dir / "checkpoints"
    if which not in ("best", "latest"):
        path = Path(which).resolve()
        if not path.exists():
            raise ConfigError(f"--resume-from: {path} does not exist; use best, latest or a checkpoint file")
        entry = next((e for e in read_manifest(path.parent) if e.path == path.name), None)
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
