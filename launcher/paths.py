"""Where a relative input path of the config points: the one rule for every such path."""

from __future__ import annotations

from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent


def resolve_input(value: str, config_dir: Path) -> str:
    """An input file named in the config (a base checkpoint, a MindFormers YAML, ...) as an
    absolute path: relative paths against the config file's folder, then the working
    directory, then the project (the first that exists; the config's folder when none does,
    so the error that follows names a path the user can read)."""
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    for cand in (config_dir / p, Path.cwd() / p, PROJECT / p):
        if cand.exists():
            return str(cand.resolve())
    return str((config_dir / p).resolve())
