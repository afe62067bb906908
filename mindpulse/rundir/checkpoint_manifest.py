"""The checkpoint manifest: which checkpoint files a run's `checkpoints/` folder holds, read,
checked and chosen from. Shared: rank 0 writes it (workers/checkpoint.py), the driver reads it
to resume (launcher/resume.py, launcher/failure_policy.py), every rank checks a file against it
before loading it. No MindSpore here.

The manifest (`checkpoints/manifest.json`) lists every file with step, metric, kind, size and
sha256. It names files by their bare name inside its own folder: any other `path` (a folder,
`..`, an absolute path, the manifest itself) makes the whole manifest malformed
(`ManifestError`), so a tampered manifest can neither load nor delete a file elsewhere.
Entries newer than the step a run resumed from move to its `superseded` list (the files stay
on disk): `latest` and `best` then mean the resumed line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mindpulse.common.errors import MindpulseError
from mindpulse.rundir.rundir_io import modes_of, write_atomic
from mindpulse.wire.protocol import CheckpointKind

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
