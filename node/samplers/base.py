"""What every card sampler shares: the :class:`Sampler` interface, the card record, and
the small value helpers of the sources.

A *card record* is a plain dict with exactly the keys of :class:`CardRecord`, in its order
(:data:`CARD_KEYS` is derived from it); :func:`card_record` is the only way the samplers
build one. Values a source does not have are ``None`` (``ranks``: ``[]``).
"""

from __future__ import annotations

import abc
import threading
from typing import Any, TypedDict, cast

from mindpulse.common.errors import MindpulseError
from mindpulse.common.formatting import finite_float

__all__ = [
    "CARD_KEYS",
    "HOST_KEYS",
    "MAX_SAMPLE_WARNINGS",
    "PROCESS_KEYS",
    "CardRecord",
    "Sampler",
    "TelemetryUnavailable",
    "as_float",
    "bytes_to_mb",
    "card_record",
    "excerpt",
]


class CardRecord(TypedDict):
    """One card (NPU chip, GPU, or the host as ``card=-1``) as every sampler reports it.

    This class is the one definition of a card record's keys and their order.
    """

    node: str | None  # filled by the NodeSampler
    card: int | None  # physical card id (npu-smi / DCMI), NVML index, -1 for the host
    chip: int | None
    name: str | None
    health: str | None
    util_pct: float | None
    memory_used_mb: float | None
    memory_total_mb: float | None
    power_w: float | None
    temp_c: float | None
    ranks: list[int]  # filled by the NodeSampler
    source: str | None  # the sampler's name


#: Keys of a card record, in this order.
CARD_KEYS: tuple[str, ...] = tuple(CardRecord.__annotations__)
#: Keys of the ``host`` dict of a sample.
HOST_KEYS: tuple[str, ...] = ("cpu_pct", "mem_used_mb", "mem_total_mb", "processes")
#: Keys of one entry of ``host["processes"]``.
PROCESS_KEYS: tuple[str, ...] = ("rank", "pid", "cpu_pct", "rss_mb")

#: At most this many warnings per sample.
MAX_SAMPLE_WARNINGS = 50

_MB = float(1 << 20)
_EXCERPT = 200


class TelemetryUnavailable(MindpulseError, RuntimeError):
    """No telemetry source for the requested device on this machine; the message says why."""


def card_record(**values: Any) -> CardRecord:
    """A card record with every key of :data:`CARD_KEYS` (``None``/``[]`` where not given)."""
    rec: dict[str, Any] = dict.fromkeys(CARD_KEYS)
    rec["ranks"] = []
    for k, v in values.items():
        if k not in rec:
            raise KeyError(f"not a card record key: {k!r}")
        rec[k] = v
    return cast(CardRecord, rec)


as_float = finite_float
"""Float, or ``None`` for missing / non-numeric / non-finite values."""


def bytes_to_mb(nbytes: Any) -> float | None:
    """Bytes as MB (2**20), rounded to 0.1; ``None`` where :func:`as_float` gives ``None``."""
    f = as_float(nbytes)
    return None if f is None else round(f / _MB, 1)


def excerpt(text: str | bytes | None) -> str:
    """A tool's output on one line, cut to 200 characters, for a warning."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    s = " ".join((text or "").split())
    return s if len(s) <= _EXCERPT else s[:_EXCERPT] + "..."


class Sampler(abc.ABC):
    """Reads every card of this machine from one source.

    :meth:`sample` returns card records without ``node`` and ``ranks`` (the
    :class:`~mindpulse.node.telemetry.NodeSampler` fills them) and leaves what went wrong in
    :attr:`last_warnings`.
    """

    name: str = ""

    def __init__(self) -> None:
        self.last_warnings: list[str] = []
        #: Set to abandon a sample in progress (a NodeSampler sets it on stop).
        self.cancel_event = threading.Event()

    @classmethod
    def available(cls) -> bool:
        """Whether this source can be used on this machine."""
        return True

    @abc.abstractmethod
    def sample(self) -> list[dict[str, Any]]:
        """One reading of all cards; never raises for a failing source."""

    def close(self) -> None:  # noqa: B027 - a no-op unless the source holds something
        """Release what the source holds (library handles); the sampler is not used after."""
