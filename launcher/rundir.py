"""The run directory: `<output.root>/<name>-<YYYYmmdd-HHMMSS>/` and its files."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml

from mindpulse.config import ConfigError, RunConfig


def make_run_dir(cfg: RunConfig, base: Path | None = None) -> Path:
    root = Path(cfg.output.root)
    if not root.is_absolute():
        root = (base or Path.cwd()) / root
    root = root.resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = (root / f"{cfg.name}-{stamp}").resolve()
    if root not in run_dir.parents:
        raise ConfigError(f"name: {cfg.name!r} would place the run outside output.root ({root})")
    n = 1
    candidate = run_dir
    while candidate.exists():
        n += 1
        candidate = run_dir.with_name(f"{run_dir.name}.{n}")
    candidate.mkdir(parents=True)
    (candidate / "logs").mkdir()
    return candidate


def write_atomic(path: Path, data: bytes) -> None:
    from mindpulse.aggregator.rundir_io import write_atomic as _write_atomic

    _write_atomic(path, data)


def write_config(run_dir: Path, cfg: RunConfig) -> None:
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    write_atomic(run_dir / "config.yaml", text.encode())


def write_json(path: Path, obj: Any) -> None:
    from mindpulse.aggregator.rundir_io import write_json_atomic

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
