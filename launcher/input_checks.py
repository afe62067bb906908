"""The config's files checked on the head before anything starts: what a rank would open
(`mindpulse/inputs/input_paths.py`, the same check each rank repeats at its start on its own node),
a script that would not compile, and the folders the aggregator writes on this machine (a
tracker's). A problem refuses the launch (exit 2) naming the key and the file, instead of
ranks that fail one by one after Ray, the aggregator and every rank have started."""

from __future__ import annotations

import os
from pathlib import Path

from mindpulse.config import RecipeConfig, RunConfig
from mindpulse.inputs.input_paths import input_problems
from mindpulse.inputs.recipe_corpus import TRAIN_NAME, shipped, too_small

from .preflight import LaunchRefused


def check_inputs(cfg: RunConfig) -> None:
    """LaunchRefused naming the key and the file of the first problem found."""
    problems = input_problems(cfg)
    if problems:
        raise LaunchRefused(problems[0] + (f" (and {len(problems) - 1} more: " + "; ".join(problems[1:]) + ")"
                                           if len(problems) > 1 else ""))
    if cfg.job.script:
        check_script_compiles(cfg.job.script)
    if cfg.job.recipe is not None:
        check_corpus(cfg, cfg.job.recipe)
    check_tracker_folders(cfg)


def check_script_compiles(script: str) -> None:
    """A syntax error in `job.script` would end every rank at its first line: said now, with
    the line (a folder or zip run through its `__main__.py` is left to the ranks)."""
    path = Path(script)
    if not path.is_file() or path.suffix != ".py":
        return
    try:
        compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise LaunchRefused(f"job.script: {path} line {exc.lineno}: {type(exc).__name__}: {exc.msg}; "
                            "fix the script (every rank would fail at its start)") from None
    except ValueError as exc:  # source bytes compile() refuses (a NUL byte): not Python
        raise LaunchRefused(f"job.script: {path} is not a Python source file ({exc})") from None


def check_corpus(cfg: RunConfig, recipe: RecipeConfig) -> None:
    """The recipe's training text must give every rank one step or more an epoch
    (mindpulse/inputs/recipe_corpus.py, the rule the ranks' data stream applies)."""
    path = Path(recipe.train_file) if recipe.train_file else shipped(TRAIN_NAME)
    what = f"job.recipe.train_file {path}" if recipe.train_file else f"the shipped corpus {path}"
    size = path.stat().st_size
    if size < 2:
        raise LaunchRefused(f"job.recipe.train_file: {path} is empty; give a UTF-8 text file")
    small = too_small(size, recipe.seq_length, cfg.world.world_size, cfg.train.batch_size)
    if small:
        raise LaunchRefused(f"train.batch_size: {cfg.train.batch_size}: {what}: {small}")


def writable_folder_problem(key: str, folder: Path) -> str | None:
    """Why `folder` could not be made or written by this process (None: it can): the folder
    itself when it exists, else the nearest parent that does."""
    folder = Path(folder).expanduser().absolute()
    probe = folder
    while not probe.exists():
        if probe.is_symlink():
            return f"{key}: {folder} cannot be made: {probe} is a broken link"
        probe = probe.parent
    if not probe.is_dir():
        return f"{key}: {folder} cannot be made: {probe} is a file, not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{key}: {folder} cannot be {'written' if probe == folder else 'made'}: {probe} is not writable"
    return None


def check_tracker_folders(cfg: RunConfig) -> None:
    """The trackers' local folders (their defaults are under the run directory, made by now):
    the aggregator writes them on this machine once the run is under way."""
    checks: list[tuple[str, Path]] = []
    swan = cfg.sinks.swanlab
    if swan.enabled and swan.logdir:
        checks.append(("sinks.swanlab.logdir", Path(swan.logdir)))
    mlf = cfg.sinks.mlflow
    store = file_store_of(mlf.tracking_uri) if mlf.enabled else None
    if store is not None:
        checks.append(("sinks.mlflow.tracking_uri", store))
    for key, folder in checks:
        problem = writable_folder_problem(key, folder)
        if problem:
            raise LaunchRefused(problem + "; choose a folder this user can write")


def file_store_of(uri: str) -> Path | None:
    """The folder of an MLflow file store URI (`file:///x`, `/x`, `x`); None for a server or a
    database (`http://`, `sqlite:///`, ...) and for the default (under the run directory)."""
    if not uri:
        return None
    if uri.startswith("file:"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(uri).path))
    return None if "://" in uri else Path(uri)
