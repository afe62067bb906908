"""`metrics.msgpack`: every accepted packet, append-only, readable after a crash.

The file is a plain concatenation of msgpack maps (the packets' wire form), so any
msgpack streaming reader can read it; a torn last record is ignored by `read_packets`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from mindpulse.protocol import Packet, PacketError, from_wire, iter_stream


class MetricsWriter:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND: each write lands at the end even if a restarted aggregator reopens it
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.records = 0
        self.bytes = 0

    def append(self, raw: list[bytes]) -> None:
        if not raw:
            return
        blob = b"".join(raw)
        view = memoryview(blob)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self.records += len(raw)
        self.bytes += len(blob)

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = -1


def read_wire(path: Path) -> Iterator[dict]:
    """Yield the raw wire maps of a metrics file (stops quietly at a torn record)."""
    with open(path, "rb") as fh:
        yield from iter_stream(fh)


def read_packets(path: Path) -> Iterator[Packet]:
    """Yield validated packets; records that do not validate are skipped."""
    for obj in read_wire(path):
        try:
            yield from_wire(obj)
        except PacketError:
            continue
