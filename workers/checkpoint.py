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
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from mindpulse.config import OutputConfig
from mindpulse.rundir.checkpoint_manifest import (
    KINDS,
    CkptEntry,
    ManifestError,
    is_bare_name,
    read_manifest,
    read_superseded,
    sha256_of,
    write_manifest,
)
from mindpulse.rundir.rundir_io import (  # the run directory's I/O
    SAVING_MARKER,
    fsync_dir,
    mark_saving,
    modes_of,
)
from mindpulse.wire.protocol import CheckpointKind

from .model_params import is_model_param

log = logging.getLogger(__name__)

class CheckpointManager:
    def __init__(self, ckpt_dir: Path, keep_periodic: int = 5, keep_best: int = 1, fmt: str = "ckpt",
                 mode: str = OutputConfig.mode.value):
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


