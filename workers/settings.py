"""The rank's one way in: `RankSettings` from the run's `job.json`, found through the one
variable the launcher sets (`MINDPULSE_SETTINGS`). Nothing else under `workers/` reads a
mindpulse variable; MindSpore's own (RANK_ID, MS_ROLE, ...) are read where MindSpore needs them.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from mindpulse.common.errors import MindpulseError
from mindpulse.config.rank_settings import NODE_RANK_ENV, SETTINGS_ENV, RankSettings


class SettingsError(MindpulseError, RuntimeError):
    """job.json is missing or not of this version: the launcher and the rank disagree."""


@functools.lru_cache(maxsize=4)
def _load(path: str) -> RankSettings:
    try:
        return RankSettings.from_json(Path(path).read_text())
    except OSError as exc:
        raise SettingsError(f"{SETTINGS_ENV}={path}: cannot read the run's settings ({exc})") from None
    except ValueError as exc:
        raise SettingsError(f"{path}: {exc}") from None


def load_settings(env: dict[str, str] | None = None) -> RankSettings | None:
    """The run's settings, or None when this process was not started by mindpulse (a user
    script run by hand: the monitor then only logs)."""
    env = os.environ if env is None else env
    path = env.get(SETTINGS_ENV, "")
    return _load(path) if path else None


def settings_at(path: str, env: dict[str, str] | None = None) -> RankSettings:
    """rank_main's `--job PATH`. The environment is pointed at the same file when it names
    none, so everything else in the process (the Monitor in a user's script, the faults)
    reads the same settings; a different file there is a launcher bug, refused."""
    env = os.environ if env is None else env
    named = env.setdefault(SETTINGS_ENV, path)
    if Path(named).resolve() != Path(path).resolve():
        raise SettingsError(f"--job {path} and {SETTINGS_ENV}={named} name different settings")
    return _load(named)


def rank_id(env: dict[str, str] | None = None) -> int:
    """This process's global rank (MindSpore's RANK_ID, set by msrun and by the ray backend)."""
    env = os.environ if env is None else env
    return int(env.get("RANK_ID", "0"))


def node_rank(env: dict[str, str] | None = None) -> int:
    """msrun backend: the node whose msrun started this process (0 otherwise)."""
    env = os.environ if env is None else env
    return int(env.get(NODE_RANK_ENV, "0"))
