"""The run directory: `<output.root>/<name>-<YYYYmmdd-HHMMSS>/` and its files."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import yaml

from mindpulse.config import Backend, ConfigError, RunConfig, check_shell_safe_root


def make_run_dir(cfg: RunConfig, base: Path | None = None) -> Path:
    root = Path(cfg.output.root)
    if not root.is_absolute():
        root = (base or Path.cwd()) / root
    root = root.resolve()
    if cfg.backend is Backend.MSRUN:
        # the config check saw only output.root as written: a relative root sits under the
        # cwd, a link may point elsewhere; msrun's log folder is under this resolved path
        check_shell_safe_root(cfg.output.root, str(root))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = (root / f"{cfg.name}-{stamp}").resolve()
    if root not in run_dir.parents:
        raise ConfigError(f"name: {cfg.name!r} would place the run outside output.root ({root})")
    _, dmode = run_modes(cfg)
    n = 1
    candidate = run_dir
    try:
        root.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                candidate.mkdir(mode=dmode)  # never an existing folder: another launch may have made it
                break
            except FileExistsError:
                n += 1
                candidate = run_dir.with_name(f"{run_dir.name}.{n}")
    except OSError as exc:  # nothing started yet: the key to change, not a traceback
        raise ConfigError(f"output.root: cannot make the run directory under {root} "
                          f"({exc.strerror or type(exc).__name__}: {exc.filename or root}); "
                          "choose a folder this user can write") from None
    os.chmod(candidate, dmode)  # mkdir's mode passes through the umask
    make_dir(candidate / "logs", dmode)
    return candidate


def run_modes(cfg: RunConfig) -> tuple[int, int]:
    """(file mode, folder mode) of the run directory's contents, from `output.mode`."""
    from mindpulse.rundir.rundir_io import modes_of

    return modes_of(getattr(cfg.output, "mode", "private"))


def make_dir(path: Path, dmode: int) -> Path:
    """A folder of the run directory (and its missing parents under it) with the run's mode."""
    path = Path(path)
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, dmode)
    return path


def apply_run_mode(run_dir: Path, cfg: RunConfig) -> list[str]:
    """Every folder and file of the run directory gets `output.mode`'s permissions (what
    msrun, MindSpore or TensorBoard wrote there with their own umask included)."""
    from mindpulse.rundir.rundir_io import apply_mode

    return apply_mode(run_dir, getattr(cfg.output, "mode", "private"))


def write_atomic(path: Path, data: bytes) -> None:
    from mindpulse.rundir.rundir_io import write_atomic as _write_atomic

    _write_atomic(path, data)


def write_config(run_dir: Path, cfg: RunConfig) -> None:
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    write_atomic(run_dir / "config.yaml", text.encode())


def write_json(path: Path, obj: Any) -> None:
    from mindpulse.rundir.rundir_io import write_json_atomic

    write_json_atomic(path, obj)


def _json_default(x: Any) -> Any:
    if hasattr(x, "value"):
        return x.value
    if hasattr(x, "__dict__"):
        return x.__dict__
    return str(x)


class PidFile:
    """`RUN_DIR/pids.json`: the run's process ids (aggregator, agents, scheduler, ranks) for
    operators and tests while it runs; the summary keeps the final copy."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "pids.json"
        self.pids: dict[str, Any] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        self.pids[key] = value

    def get(self, key: str, default: Any = None) -> Any:
        return self.pids.get(key, default)

    def save(self) -> None:
        write_json(self.path, self.pids)
