"""A real virtual environment with mindpulse and its core dependencies, and neither MindSpore
nor MindFormers: what a CPU-only head node installs (`pip install mindpulse`).

It is built once per checkout and dependency set, and kept under
`$XDG_CACHE_HOME/mindpulse/headless-venv/<key>` (default `~/.cache`): the key hashes the
core dependencies in pyproject.toml, this interpreter's version, the versions the test
environment holds and the checkout's path (mindpulse is installed editable from it, so code
changes need no rebuild). Every package is pinned to the version this test environment holds
(a constraints file): a Ray node started from the head's environment must run the Ray of the
nodes started from this one, and pip then takes every wheel from its cache. Building it on a
fresh machine takes a minute or two; afterwards it is reused as it is.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = ("mindspore", "mindformers")
CHECKOUT = ".checkout"
"""The checkout it was built for (its editable mindpulse): older builds for it are removed."""
COMPLETE = ".complete"
"""Written last: a folder without it is a build that did not finish, and is built again."""


def cache_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "mindpulse" / "headless-venv"


def core_dependencies() -> list[str]:
    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def constraints() -> list[str]:
    """Every distribution of this environment at its version, but the frameworks and mindpulse."""
    seen: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = _canonical(dist.metadata["Name"] or "")
        if name and name not in (*FRAMEWORKS, "mindpulse") and name not in seen:
            seen[name] = dist.version
    return sorted(f"{n}=={v}" for n, v in seen.items())


def headless_venv() -> Path:
    """The environment's folder (bin/python, bin/ray, bin/mindpulse), built when missing."""
    deps, cons = core_dependencies(), constraints()
    key = hashlib.sha256("\n".join([sys.version, str(ROOT), *deps, "--", *cons]).encode()).hexdigest()[:16]
    venv = cache_root() / key
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time (parallel test processes)
        if (venv / COMPLETE).exists():
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        _drop_older(venv)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        (venv / "constraints.txt").write_text("\n".join(cons) + "\n")
        py = str(venv / "bin" / "python")
        for step in ([py, "-m", "pip", "install", "-q", "-c", str(venv / "constraints.txt"), *deps],
                     [py, "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)]):
            res = subprocess.run(step, capture_output=True, text=True, timeout=1200)
            if res.returncode:
                raise RuntimeError(f"building the headless environment failed: {' '.join(step)}\n"
                                   f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        (venv / CHECKOUT).write_text(str(ROOT))
        (venv / COMPLETE).write_text("\n".join(deps) + "\n")
        return venv


def _drop_older(venv: Path) -> None:
    """Remove this checkout's environments built for other dependencies (~0.6 GB each)."""
    for other in venv.parent.iterdir():
        if other != venv and other.is_dir() and (other / CHECKOUT).exists() \
                and (other / CHECKOUT).read_text() == str(ROOT):
            shutil.rmtree(other, ignore_errors=True)
            (venv.parent / f"{other.name}.lock").unlink(missing_ok=True)
