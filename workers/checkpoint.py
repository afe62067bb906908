"""Rank 0's checkpoint writer: atomic files, a manifest written before any deletion.

The aggregator decides when and what kind (`periodic`, `best`, `last`); rank 0 writes.
Each file: MindSpore checkpoint of the train cell (weights, optimizer state) plus the
step, epoch and the metric, written to a temp file, fsynced, renamed. The manifest
(`checkpoints/manifest.json`) lists every file with step, metric, kind, size and sha256;
it is rewritten (atomically) before old files are deleted, and the newest file is never
deleted, so a crash at any point leaves a valid manifest that names only whole files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mindpulse.protocol import CheckpointKind

from .model_params import is_model_param

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
KINDS = tuple(k.value for k in CheckpointKind)


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


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_manifest(ckpt_dir: Path) -> list[CkptEntry]:
    path = Path(ckpt_dir) / MANIFEST
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    out = []
    for f in data.get("files", []):
        try:
            out.append(CkptEntry(**{k: f.get(k) for k in CkptEntry.__dataclass_fields__}))
        except TypeError:
            continue
    return out


def write_manifest(ckpt_dir: Path, entries: list[CkptEntry]) -> None:
    body = {"version": 1, "files": [asdict(e) for e in sorted(entries, key=lambda e: (e.step, e.kind))]}
    best = [e for e in entries if e.kind == CheckpointKind.BEST]
    if best:
        body["best"] = asdict(max(best, key=lambda e: e.time))
    fd, tmp = tempfile.mkstemp(prefix=".manifest.", dir=ckpt_dir)
    with os.fdopen(fd, "w") as fh:
        json.dump(body, fh, indent=2, allow_nan=False, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, Path(ckpt_dir) / MANIFEST)
    _fsync_dir(Path(ckpt_dir))


def verify(ckpt_dir: Path, entry: CkptEntry) -> str | None:
    """None when the file is whole; else why it is refused."""
    path = Path(ckpt_dir) / entry.path
    if not path.exists():
        return f"{path} is missing"
    if path.stat().st_size != entry.size:
        return f"{path} has {path.stat().st_size} bytes, the manifest says {entry.size}"
    digest = sha256_of(path)
    if digest != entry.sha256:
        return f"{path} sha256 {digest[:12]}... does not match the manifest's {entry.sha256[:12]}..."
    return None


class CheckpointManager:
    def __init__(self, ckpt_dir: Path, keep_periodic: int = 5, keep_best: int = 1, fmt: str = "ckpt"):
        self.dir = Path(ckpt_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = {CheckpointKind.PERIODIC.value: keep_periodic, CheckpointKind.BEST.value: keep_best,
                     CheckpointKind.LAST.value: 1}
        self.fmt = fmt
        self.entries = read_manifest(self.dir)
        self._clean_temp()

    def _clean_temp(self) -> None:
        # temp files of a save that was killed midway: never in the manifest
        for p in self.dir.glob(".tmp-*"):
            try:
                p.unlink()
            except OSError:
                pass

    def save(self, train_cell: Any, step: int, epoch: int, kinds: Iterable[CheckpointKind | str],
             metric: float | None = None, metric_name: str = "", extra: dict[str, Any] | None = None
             ) -> list[CkptEntry]:
        """Write one file for the first kind; hard links for the others (one write)."""
        import mindspore as ms

        # plain values: they name files and go into the manifest (an enum's str() is its name)
        kinds = [CheckpointKind(k).value for k in kinds if k in KINDS]
        if not kinds:
            return []
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
        os.chmod(tmp, 0o644)
        size, digest = tmp.stat().st_size, sha256_of(tmp)
        os.replace(tmp, self.dir / first)
        _fsync_dir(self.dir)
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
            new.append(CkptEntry(name, step, epoch, k, metric, metric_name, size, digest, now))
        self.entries = [e for e in self.entries if e.path not in {n.path for n in new}] + new
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
        write_manifest(self.dir, self.entries)
        kept = {e.path for e in self.entries}
        for e in doomed:
            if e.path in kept:
                continue
            try:
                (self.dir / e.path).unlink()
            except FileNotFoundError:
                pass


def choose_resume(ckpt_dir: Path, which: str = "latest") -> tuple[CkptEntry | None, list[str]]:
    """The newest valid checkpoint (`latest`), or the best (`best`); files whose sha256 or
    size do not match the manifest are refused with a message, and the next one is used."""
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
