"""Atomic JSON writes for files the aggregator owns in the run directory."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any


def json_safe(obj: Any) -> Any:
    """Strict JSON: NaN/Inf become the strings "nan"/"inf"/"-inf"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if obj != obj else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_atomic(path: Path, data: bytes) -> None:
    """Temp file in the same folder, fsync, rename: readers never see a torn file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; run files are meant to be read by others
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    text = json.dumps(json_safe(obj), indent=2, allow_nan=False, default=str) + "\n"
    write_atomic(path, text.encode())
