"""Atomic writes for the run directory's files, and the permissions they get.

`output.mode` says what the run directory's folders and files are: `private` (0700 / 0600,
the default: `config.yaml`, `job.json` and `plan.json` carry the `env:` values) or
`shared` (0755 / 0644). The run directory is made with its folder mode
(`launcher/rundir.py`); every file written here takes the read bits of the folder it is
written into, so a writer that has no config at hand (the aggregator) still follows it.
The run's logs (ranks, msrun, the scheduler) are opened here too (`open_log_fd`).
"""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

RUN_MODES: dict[str, tuple[int, int]] = {"private": (0o600, 0o700), "shared": (0o644, 0o755)}
"""`output.mode` → (file mode, folder mode) of what the run directory holds."""


def modes_of(mode: Any) -> tuple[int, int]:
    """(file mode, folder mode) for an `output.mode` value (a `FileMode` or its string);
    anything but `shared` is private."""
    name = str(getattr(mode, "value", mode) or "private")
    return RUN_MODES.get(name, RUN_MODES["private"])


def file_mode_in(folder: Path) -> int:
    """The mode of a new file in `folder`: owner read/write, and group/other read where the
    folder grants them read (0700 → 0600, 0755 → 0644); never group or other write."""
    try:
        dmode = os.stat(folder).st_mode
    except OSError:
        return 0o600
    return 0o600 | (dmode & (stat.S_IRGRP | stat.S_IROTH))


def open_log_fd(path: str | os.PathLike) -> int:
    """A run log (a rank's, msrun's, the scheduler's) opened write-only for appending, as a
    file descriptor: its folder made if missing, the file given `file_mode_in` its folder
    (also when it existed: an earlier attempt's log keeps the run's mode)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = file_mode_in(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, mode)
    try:
        os.fchmod(fd, mode)
    except OSError:  # a log another user made: appended to as it is
        pass
    return fd


def json_safe(obj: Any) -> Any:
    """Strict JSON: NaN/Inf become the strings "nan"/"inf"/"-inf"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if obj != obj else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (the folder's entry, not only the file's data)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, mode: int | None = None) -> None:
    """Temp file in the same folder, fsync, rename, fsync the folder: readers never see a torn
    file and the new name survives a crash. `mode`: the file's permissions (default: what
    `file_mode_in` says for its folder)."""
    path = Path(path)
    mode = file_mode_in(path.parent) if mode is None else mode
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # 0600 from the start
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: Path, obj: Any) -> None:
    text = json.dumps(json_safe(obj), indent=2, allow_nan=False, default=str) + "\n"
    write_atomic(path, text.encode())


def apply_mode(root: Path, mode: Any) -> list[str]:
    """Give every folder and plain file under `root` (and `root`) the `output.mode` permissions:
    what other programs wrote there with their own umask (msrun's logs, TensorBoard's event
    files) follows the run's mode too. Links are not followed. Returns what could not be
    changed (`path: error`)."""
    fmode, dmode = modes_of(mode)
    errors: list[str] = []

    def _chmod(p: str, m: int) -> None:
        try:
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode) or stat.S_IMODE(st.st_mode) == m:
                return
            # keep an executable bit where the owner has one (a script saved with the run)
            if stat.S_ISREG(st.st_mode) and st.st_mode & stat.S_IXUSR:
                m |= (m & 0o444) >> 2
            os.chmod(p, m)
        except OSError as exc:
            errors.append(f"{p}: {exc}")

    root = Path(root)
    _chmod(str(root), dmode)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            _chmod(os.path.join(dirpath, d), dmode)
        for f in filenames:
            full = os.path.join(dirpath, f)
            try:
                if stat.S_ISREG(os.lstat(full).st_mode):
                    _chmod(full, fmode)
            except OSError:
                pass
    return errors


SAVING_MARKER = ".saving.json"
"""Rank 0's note, in the checkpoints folder, that it is writing a checkpoint right now: the
step, when it started, and its writer (`process_identity`). Written before the write starts
and removed when it ends (whole or failed), so the launcher can let a write finish before
it stops the ranks. Best effort: no fsync (a marker that outlived a crash would only
mislead), and a marker that cannot be written never fails the checkpoint."""


def mark_saving(ckpt_dir: Path, step: int) -> Path | None:
    """Write the marker for a checkpoint write of `step` by this process; its path, or None
    when it could not be written."""
    import time

    from mindpulse.lifetime.process_identity import process_identity

    path = Path(ckpt_dir) / SAVING_MARKER
    note = dict(process_identity(), step=int(step), started=time.time())
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{SAVING_MARKER}.", dir=path.parent)
        with os.fdopen(fd, "wb") as fh:
            fh.write(json.dumps(note).encode())
        os.chmod(tmp, file_mode_in(path.parent))
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def saving_now(ckpt_dir: Path | str) -> dict[str, Any] | None:
    """What the marker in `ckpt_dir` says: None when there is none (or it is unreadable),
    else {"step", "pid", "started", "alive"}; `alive` is False when its writer is gone (a
    process killed mid-write leaves its marker behind; a pid now used by another process, or a
    marker written in another process table, is not its writer). Reads this host's
    processes: ask on the host that writes the checkpoints."""
    from mindpulse.lifetime.process_identity import process_alive, same_process_table

    try:
        note = json.loads((Path(ckpt_dir) / SAVING_MARKER).read_text())
        pid, step = int(note["pid"]), int(note["step"])
        started = float(note.get("started") or 0.0)
        create_time = float(note["create_time"])
        alive = pid > 0 and same_process_table(note) and process_alive(pid, create_time)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return {"step": step, "pid": pid, "started": started, "alive": alive}
