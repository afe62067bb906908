"""Rank 0's checkpoint writer: atomic files, a manifest written before any deletion.

The aggregator decides when and what kind (`periodic`, `best`, `last`); rank 0 writes.
Each file: MindSpore checkpoint of the train cell (weights, optimizer state) plus the
step, epoch and the metric, written to a temp file, fsynced, renamed. The manifest
(`checkpoints/manifest.json`) lists every file with step, metric, kind, size and sha256;
it is rewritten (atomically) before old files are deleted, and the newest file is never
deleted, so a crash at any point leaves a valid manifest that names only whole files.

A manifest names files by their bare name inside its own folder: any other `path` (a
folder, `..`, an absolute path, the manifest itself) makes the whole manifest malformed
(`ManifestError`), so a tampered manifest can neither load nor delete a file elsewhere.
Entries newer than the step a run resumed from move to its `superseded` list (the files
stay on disk): `latest` and `best` then mean the resumed line.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mindpulse.aggregator.rundir_io import (  # the run directory's I/O
    SAVING_MARKER,
    fsync_dir,
    mark_saving,
    modes_of,
    write_atomic,
)
from mindpulse.errors import MindpulseError
from mindpulse.protocol import CheckpointKind

from .model_params import is_model_param

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
KINDS = tuple(k.value for k in CheckpointKind)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(MindpulseError, ValueError):
    """A manifest that cannot be trusted (not JSON, wrong shape, a path that is not a bare
    file name in its folder); the message names the file."""


class CheckpointRefused(MindpulseError, ValueError):
    """A checkpoint a rank must not load (missing, or its size or sha256 differs from the
    manifest's); the message names the file."""


@dataclass
class CkptEntry:
    path: str
    """File name, relative to the checkpoints folder."""
    step: int
    epoch: int
    kind: str
    metric: float | None
    metric_name: str
    size: int
    sha256: str
    time: float


def format_of(path: str | Path) -> str:
    """The MindSpore format of a checkpoint file, from its name: `safetensors` or `ckpt`."""
    return "safetensors" if str(path).endswith(".safetensors") else "ckpt"


def is_bare_name(name: Any) -> bool:
    """Whether `name` is a plain file name of a checkpoint (no folder, not the manifest)."""
    return (isinstance(name, str) and name not in ("", ".", "..", MANIFEST) and "/" not in name
            and "\\" not in name and "\0" not in name and not name.startswith(".") and Path(name).name == name)


def path_in(ckpt_dir: Path, name: str) -> Path:
    """`ckpt_dir / name`, refused unless `name` is a bare file name inside that folder."""
    if not is_bare_name(name):
        raise ManifestError(f"{Path(ckpt_dir) / MANIFEST}: {name!r} is not a file name inside {ckpt_dir}")
    return Path(ckpt_dir) / name


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _entry_of(f: Any, where: str) -> CkptEntry:
    """One manifest record, checked field by field (ManifestError names what is wrong)."""
    if not isinstance(f, dict):
        raise ManifestError(f"{where} is a {type(f).__name__}, not a mapping")

    def integer(key: str, default: int | None = None) -> int:
        v = f.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ManifestError(f"{where}: {key} {v!r} is not a whole number >= 0")
        return v

    def number(key: str, default: float | None) -> float | None:
        v = f.get(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ManifestError(f"{where}: {key} {v!r} is not a finite number")
        return float(v)

    name = f.get("path")
    if not is_bare_name(name):
        raise ManifestError(f"{where}: path {name!r} is not a bare file name inside the checkpoints folder")
    kind = f.get("kind")
    if kind not in KINDS:
        raise ManifestError(f"{where}: kind {kind!r} is not one of {', '.join(KINDS)}")
    sha = f.get("sha256")
    if not isinstance(sha, str) or not _SHA256.match(sha):
        raise ManifestError(f"{where}: sha256 {sha!r} is not 64 lowercase hex digits")
    metric_name = f.get("metric_name") or ""
    if not isinstance(metric_name, str):
        raise ManifestError(f"{where}: metric_name {metric_name!r} is not a string")
    return CkptEntry(path=name, step=integer("step"), epoch=integer("epoch", 0), kind=kind,
                     metric=number("metric", None), metric_name=metric_name, size=integer("size"), sha256=sha,
                     time=number("time", 0.0) or 0.0)


def _read_body(ckpt_dir: Path) -> dict[str, Any]:
    """The manifest's JSON ({} when there is none); ManifestError when it is not a mapping
    whose `files` (and `superseded`) are lists."""
    path = Path(ckpt_dir) / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: cannot be read ({exc})") from None
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise ManifestError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ManifestError(f"{path}: the top level is a {type(body).__name__}, not a mapping")
    for key in ("files", "superseded"):
        if not isinstance(body.get(key, []), list):
            raise ManifestError(f"{path}: `{key}` is not a list")
    return body


def read_manifest(ckpt_dir: Path) -> list[CkptEntry]:
    """The checkpoints the manifest lists ([] without a manifest); ManifestError (naming the
    file and the bad record) for a malformed one."""
    path = Path(ckpt_dir) / MANIFEST
    return [_entry_of(f, f"{path}: files[{i}]") for i, f in enumerate(_read_body(ckpt_dir).get("files", []))]


def read_superseded(ckpt_dir: Path) -> list[dict[str, Any]]:
    """The records a resume superseded (files kept on disk, no longer `latest` or `best`)."""
    path = Path(ckpt_dir) / MANIFEST
    out = []
    for i, f in enumerate(_read_body(ckpt_dir).get("superseded", [])):
        _entry_of(f, f"{path}: superseded[{i}]")  # checked like the others
        out.append(dict(f))
    return out


def known_entries(ckpt_dir: Path) -> list[CkptEntry]:
    """Every file the manifest knows, listed or superseded (to check a file given by path)."""
    path = Path(ckpt_dir) / MANIFEST
    body = _read_body(ckpt_dir)
    return ([_entry_of(f, f"{path}: files[{i}]") for i, f in enumerate(body.get("files", []))]
            + [_entry_of(f, f"{path}: superseded[{i}]") for i, f in enumerate(body.get("superseded", []))])


def write_manifest(ckpt_dir: Path, entries: list[CkptEntry], superseded: list[dict[str, Any]] | None = None,
                   mode: int | None = None) -> None:
    """Atomically (temp, fsync, rename). `superseded`: None keeps the current manifest's list;
    `mode`: None keeps the current manifest's permissions (0600 for a new one)."""
    ckpt_dir = Path(ckpt_dir)
    target = ckpt_dir / MANIFEST
    if superseded is None:
        try:
            superseded = read_superseded(ckpt_dir)
        except ManifestError:
            superseded = []
    if mode is None:
        try:
            mode = target.stat().st_mode & 0o777
        except OSError:
            mode = modes_of("private")[0]
    body: dict[str, Any] = {"version": 1,
                            "files": [asdict(e) for e in sorted(entries, key=lambda e: (e.step, e.kind))]}
    best = [e for e in entries if e.kind == CheckpointKind.BEST]
    if best:
        body["best"] = asdict(max(best, key=lambda e: e.time))
    if superseded:
        body["superseded"] = sorted(superseded, key=lambda f: (f.get("step", 0), f.get("kind", "")))
    write_atomic(target, (json.dumps(body, indent=2, allow_nan=False, default=str)).encode(), mode=mode)


def verify(ckpt_dir: Path, entry: CkptEntry) -> str | None:
    """None when the file is whole; else why it is refused."""
    try:
        path = path_in(ckpt_dir, entry.path)
    except ManifestError as exc:
        return str(exc)
    if not path.is_file():
        return f"{path} is missing"
    if path.stat().st_size != entry.size:
        return f"{path} has {path.stat().st_size} bytes, the manifest says {entry.size}"
    digest = sha256_of(path)
    if digest != entry.sha256:
        return f"{path} sha256 {digest[:12]}... does not match the manifest's {entry.sha256[:12]}..."
    return None


def verify_for_load(path: str | Path, kind: str = "") -> None:
    """A rank's check before it loads a resume checkpoint, on its own host: the file must
    match the size and sha256 its folder's manifest lists for it. A file of `kind` `file`
    (given by path, in no manifest) has nothing to be checked against and passes. Raises
    CheckpointRefused naming the file."""
    path = Path(path)
    try:
        known = known_entries(path.parent)
    except ManifestError as exc:
        raise CheckpointRefused(f"resume: refused {path}: {exc}") from None
    entry = next((e for e in known if e.path == path.name), None)
    if entry is None:
        if kind == "file":
            log.warning("resume: %s is in no manifest; its sha256 cannot be checked", path)
            if not path.is_file():
                raise CheckpointRefused(f"resume: refused {path}: it is missing")
            return
        raise CheckpointRefused(f"resume: refused {path}: {path.parent / MANIFEST} does not list it")
    why = verify(path.parent, entry)
    if why is not None:
        raise CheckpointRefused(f"resume: refused {path}: {why}")


def supersede_after(ckpt_dir: Path, step: int, note: str = "") -> list[CkptEntry]:
    """Move the manifest's entries newer than `step` to its `superseded` list (their files
    stay): a run resumed from `step` makes them another line. Returns them."""
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / MANIFEST).exists():
        return []
    entries = read_manifest(ckpt_dir)
    newer = [e for e in entries if e.step > step]
    if not newer:
        return []
    now = time.time()
    superseded = read_superseded(ckpt_dir)
    names = {e.path for e in newer}
    superseded = [f for f in superseded if f.get("path") not in names]
    superseded += [dict(asdict(e), superseded_at=now, superseded_by=note or f"resume from step {step}")
                   for e in newer]
    write_manifest(ckpt_dir, [e for e in entries if e.step <= step], superseded)
    return newer


class CheckpointManager:
    def __init__(self, ckpt_dir: Path, keep_periodic: int = 5, keep_best: int = 1, fmt: str = "ckpt",
                 mode: str = "private"):
        self.dir = Path(ckpt_dir)
        self.file_mode, self.dir_mode = modes_of(mode)
        self.keep = {CheckpointKind.PERIODIC.value: keep_periodic, CheckpointKind.BEST.value: keep_best,
                     CheckpointKind.LAST.value: 1}
        self.fmt = fmt
        self.entries: list[CkptEntry] = []
        self.superseded: list[dict[str, Any]] = []
        self._loaded = False
        try:
            self._open()
        except (OSError, ManifestError) as exc:
            # never fatal to the rank: every save tries again and reports why it cannot
            log.error("checkpoints: %s", exc)

    def _open(self) -> None:
        """Make the folder (with the run's folder mode) and read its manifest, once. A
        malformed manifest is never overwritten: every save is refused with its error."""
        if self._loaded:
            return
        if not self.dir.is_dir():
            if self.dir.exists() or self.dir.is_symlink():
                raise NotADirectoryError(errno.ENOTDIR, "the checkpoints folder is not a folder", str(self.dir))
            self.dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.dir, self.dir_mode)
        self.entries = read_manifest(self.dir)
        self.superseded = read_superseded(self.dir)
        self._clean_temp()
        self._loaded = True

    def _clean_temp(self) -> None:
        # temp files of a save that was killed midway (never in the manifest), and the
        # save-in-progress marker it left: no write of this writer is in progress yet
        for p in [*self.dir.glob(".tmp-*"), *self.dir.glob(SAVING_MARKER + "*")]:
            try:
                p.unlink()
            except OSError:
                pass

    def save(self, train_cell: Any, step: int, epoch: int, kinds: Iterable[CheckpointKind | str],
             metric: float | None = None, metric_name: str = "", extra: dict[str, Any] | None = None,
             before_write: Callable[[int], None] | None = None) -> list[CkptEntry]:
        """Write one file for the first kind; hard links for the others (one write). While it
        writes, the folder holds the save-in-progress marker (`SAVING_MARKER`), so a launcher
        stopping the ranks after another rank failed lets the write finish
        (`checkpoint.save_grace_s`). `before_write(step)`: called once the marker is down (faults)."""
        # plain values: they name files and go into the manifest (an enum's str() is its name)
        kinds = [CheckpointKind(k).value for k in kinds if k in KINDS]
        if not kinds:
            return []
        self._open()  # a folder that could not be made (or read) at the start is an error now
        marker = mark_saving(self.dir, step)
        if marker is None:
            log.warning("[rank 0] could not mark the checkpoint write of step %d as in progress in %s: a rank "
                        "failing during it stops rank 0 at once", step, self.dir)
        try:
            if before_write is not None:
                before_write(step)
            return self._save(train_cell, step, epoch, kinds, metric, metric_name, extra)
        finally:
            if marker is not None:
                try:
                    marker.unlink()
                except OSError:
                    pass

    def _save(self, train_cell: Any, step: int, epoch: int, kinds: list[str], metric: float | None,
              metric_name: str, extra: dict[str, Any] | None) -> list[CkptEntry]:
        import mindspore as ms

        ext = "safetensors" if self.fmt == "safetensors" else "ckpt"
        first = f"step_{step:08d}-{kinds[0]}.{ext}"
        tmp = self.dir / f".tmp-{first}"
        append = {"step": step, "epoch": epoch, **(extra or {})}
        if metric is not None:
            append["metric"] = float(metric)
        ms.save_checkpoint(train_cell, str(tmp), append_dict=append, format=self.fmt,
                           choice_func=is_model_param)
        if not tmp.exists():  # some MindSpore versions add the suffix themselves
            cand = list(self.dir.glob(f".tmp-{first}*"))
            if not cand:
                raise OSError(f"MindSpore did not write {tmp}")
            tmp = cand[0]
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, self.file_mode)
        size, digest = tmp.stat().st_size, sha256_of(tmp)
        os.replace(tmp, self.dir / first)
        fsync_dir(self.dir)
        now = time.time()
        new = [CkptEntry(first, step, epoch, kinds[0], metric, metric_name, size, digest, now)]
        for k in kinds[1:]:
            name = f"step_{step:08d}-{k}.{ext}"
            target = self.dir / name
            if target.exists():
                target.unlink()
            try:
                os.link(self.dir / first, target)
            except OSError:
                import shutil

                shutil.copyfile(self.dir / first, target)
                os.chmod(target, self.file_mode)
            new.append(CkptEntry(name, step, epoch, k, metric, metric_name, size, digest, now))
        names = {n.path for n in new}
        self.entries = [e for e in self.entries if e.path not in names] + new
        # a superseded record whose file name was just written again no longer describes it
        self.superseded = [f for f in self.superseded if f.get("path") not in names]
        self._retain()
        return new

    def _retain(self) -> None:
        """Bookkeeping first (manifest without the doomed files), then delete them."""
        newest = max(self.entries, key=lambda e: (e.step, e.time), default=None)
        doomed: list[CkptEntry] = []
        for kind, keep in self.keep.items():
            mine = sorted((e for e in self.entries if e.kind == kind), key=lambda e: (e.step, e.time))
            if kind == CheckpointKind.BEST:
                mine = sorted(mine, key=lambda e: e.time)  # the newest best is the best so far
            excess = mine[: max(0, len(mine) - keep)]
            doomed.extend(e for e in excess if e is not newest)
        self.entries = [e for e in self.entries if e not in doomed]
        write_manifest(self.dir, self.entries, self.superseded, mode=self.file_mode)
        kept = {e.path for e in self.entries} | {f.get("path") for f in self.superseded}
        for e in doomed:
            if e.path in kept or not is_bare_name(e.path):  # never anything outside this folder
                continue
            try:
                (self.dir / e.path).unlink()
            except FileNotFoundError:
                pass


def choose_resume(ckpt_dir: Path, which: str = "latest") -> tuple[CkptEntry | None, list[str]]:
    """The newest valid checkpoint (`latest`), or the best (`best`); files whose sha256 or
    size do not match the manifest are refused with a message, and the next one is used.
    ManifestError for a malformed manifest."""
    entries = read_manifest(ckpt_dir)
    if which == "best":
        order = sorted((e for e in entries if e.kind == CheckpointKind.BEST), key=lambda e: e.time, reverse=True)
    else:
        order = sorted(entries, key=lambda e: (e.step, e.time), reverse=True)
    refused = []
    for e in order:
        why = verify(ckpt_dir, e)
        if why is None:
            return e, refused
        refused.append(f"refused {e.path} (step {e.step}): {why}")
    return None, refused
