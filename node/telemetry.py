"""Per-node telemetry: read every card of a node on an interval (never per training step).

A *sampler* reads all cards of one machine from one source; each source is one module of
:mod:`mindpulse.node.samplers`:

* :class:`DcmiSampler` - Huawei's ``libdcmi.so`` through ctypes (Ascend; used only when the
  library loads, ``dcmi_init`` returns 0 and a trial read returns values);
* :class:`NpuSmiSampler` - the ``npu-smi`` tool (Ascend), parsed by :mod:`mindpulse.node.npu_smi`;
* :class:`NvmlSampler` - NVIDIA's NVML through ``pynvml`` (GPUs);
* :class:`PsutilSampler` - the host CPU and memory (CPU runs), plus per-rank process stats.

Each returns *card records*: plain dicts with exactly the keys of :data:`CARD_KEYS`
(``None`` where the source has no value). This module picks the sampler for a device
(:func:`pick_sampler`). A :class:`NodeSampler` puts the node name and the ranks of each
card into the records, adds host and per-rank process statistics, and either samples once
(:meth:`NodeSampler.sample_once`) or on a daemon thread (:meth:`NodeSampler.start`). Its
sample dict has the fields of :class:`mindpulse.wire.protocol.TelemetryPacket` (``node``, ``ts``,
``source``, ``cards``, ``host``) plus ``warnings``; :func:`telemetry_packet` turns it into a
packet.

Nothing here raises while sampling: failures become ``None`` values and warnings.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .samplers.base import (
    CARD_KEYS,
    HOST_KEYS,
    MAX_SAMPLE_WARNINGS,
    PROCESS_KEYS,
    CardRecord,
    Sampler,
    TelemetryUnavailable,
    card_record,
)
from .samplers.dcmi import DcmiSampler
from .samplers.host import PsutilSampler
from .samplers.npu_smi import NpuSmiSampler, find_npu_smi, npu_smi_not_found
from .samplers.nvml import NvmlSampler

log = logging.getLogger(__name__)

__all__ = [
    "CARD_KEYS",
    "HOST_KEYS",
    "PROCESS_KEYS",
    "CardRecord",
    "TelemetryUnavailable",
    "Sampler",
    "NpuSmiSampler",
    "DcmiSampler",
    "NvmlSampler",
    "PsutilSampler",
    "NodeSampler",
    "card_record",
    "find_npu_smi",
    "pick_sampler",
    "sample_this_machine",
    "telemetry_packet",
]


# -------------------------------------------------------------------------- choosing one

_DEVICE_ALIASES = {
    "ascend": "ascend", "npu": "ascend",
    "gpu": "gpu", "cuda": "gpu", "nvidia": "gpu",
    "cpu": "cpu",
    "auto": "auto",
}
_SOURCES_OF = {"ascend": ("dcmi", "npu-smi"), "gpu": ("nvml",), "cpu": ("psutil",)}


def _has_values(records: list[dict[str, Any]]) -> bool:
    keys = ("util_pct", "memory_total_mb", "power_w", "temp_c")
    return any(any(r.get(k) is not None for k in keys) for r in records)


def _pick(device: str, prefer: str, notes: list[str]) -> Sampler:
    dev = _DEVICE_ALIASES.get(str(device).lower())
    if dev is None:
        raise ValueError(f"unknown device {device!r} (expected ascend, gpu, cpu or auto)")
    prefer = str(prefer).lower()
    all_sources = {s for v in _SOURCES_OF.values() for s in v}
    if prefer != "auto" and prefer not in all_sources:
        raise ValueError(f"unknown telemetry source {prefer!r} (expected auto, "
                         + ", ".join(sorted(all_sources)) + ")")
    if dev == "auto":
        for d in ("ascend", "gpu"):
            if prefer != "auto" and prefer not in _SOURCES_OF[d]:
                continue
            try:
                return _pick(d, prefer, notes)
            except TelemetryUnavailable as exc:
                notes.append(str(exc))
        if prefer not in ("auto", "psutil"):
            raise TelemetryUnavailable("; ".join(notes))
        return PsutilSampler()
    if prefer != "auto" and prefer not in _SOURCES_OF[dev]:
        raise ValueError(f"source {prefer!r} does not read {dev} devices "
                         f"(it has: {', '.join(_SOURCES_OF[dev])})")
    if dev == "cpu":
        return PsutilSampler()
    if dev == "gpu":
        if NvmlSampler.available():
            return NvmlSampler()
        raise TelemetryUnavailable(f"no GPU telemetry on this machine: {NvmlSampler.load_error}")
    # ascend
    missing = []
    if prefer in ("auto", "dcmi"):
        if DcmiSampler.available():
            s = DcmiSampler()
            trial = s.sample()
            if _has_values(trial):
                return s
            missing.append("DCMI loads but a trial read returned no values ("
                           + "; ".join(s.last_warnings[:3]) + ")")
            s.close()
        else:
            missing.append(f"DCMI is not usable: {DcmiSampler.load_error}")
    if prefer in ("auto", "npu-smi"):
        path = find_npu_smi()
        if path is not None:
            notes.extend(missing)
            return NpuSmiSampler(path)
        missing.append(npu_smi_not_found())
    raise TelemetryUnavailable("no Ascend telemetry on this machine: " + "; ".join(missing)
                               + ". Install the Ascend driver (it ships npu-smi and libdcmi.so)"
                               " or run with device cpu")


def pick_sampler(device: str, prefer: str = "auto") -> Sampler:
    """The sampler for ``device`` on this machine.

    ``ascend``: :class:`DcmiSampler` if DCMI works, else :class:`NpuSmiSampler` if
    ``npu-smi`` is found; ``gpu``: :class:`NvmlSampler`; ``cpu``: :class:`PsutilSampler`;
    ``auto``: the first of Ascend, GPU that works, else psutil. ``prefer`` names one source
    (``dcmi``, ``npu-smi``, ``nvml``, ``psutil``) to use only that one. Raises
    :class:`TelemetryUnavailable` saying what is missing, ``ValueError`` for unknown names.
    """
    return _pick(device, prefer, [])


# ------------------------------------------------------------------------------ per node


class NodeSampler:
    """All cards of one node, with the ranks on each card and the ranks' processes.

    ``rank_devices`` maps each global rank on this node to its physical card id (the
    ``card`` of the records); with the psutil source (one ``card=-1`` record for the host)
    every rank is on that record. ``rank_pids`` maps ranks to process ids for
    ``host["processes"]``. Host CPU and memory are read with psutil whatever the source.
    """

    def __init__(
        self,
        node: str,
        sampler: Sampler,
        rank_devices: dict[int, int],
        rank_pids: dict[int, int] | None = None,
        interval_s: float = 5.0,
    ) -> None:
        self.node = str(node)
        self.sampler = sampler
        self.rank_devices = dict(rank_devices or {})
        self.rank_pids = dict(rank_pids or {})
        self.interval_s = float(interval_s)
        self._host = sampler if isinstance(sampler, PsutilSampler) else PsutilSampler()
        self._sample_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples_taken = 0
        self.callback_errors = 0

    def sample_once(self) -> dict[str, Any]:
        """One sample: ``{"node", "ts", "source", "cards", "host", "warnings"}``; never raises."""
        with self._sample_lock:
            try:
                return self._sample()
            except Exception as exc:  # noqa: BLE001 - last line of defence
                log.exception("telemetry sample failed")
                return {"node": self.node, "ts": time.time(), "source": self.sampler.name,
                        "cards": [], "host": {}, "warnings": [f"sample failed: {type(exc).__name__}: {exc}"]}
            finally:
                self.samples_taken += 1

    def _sample(self) -> dict[str, Any]:
        ts = time.time()
        warnings: list[str] = []
        try:
            raw = self.sampler.sample()
            warnings.extend(str(w) for w in (getattr(self.sampler, "last_warnings", None) or []))
        except Exception as exc:  # noqa: BLE001 - a sampler that breaks its promise
            raw = []
            warnings.append(f"{self.sampler.name or type(self.sampler).__name__} sampler failed: "
                            f"{type(exc).__name__}: {exc}")
        cards = []
        for rec in raw if isinstance(raw, list) else []:
            if not isinstance(rec, dict):
                continue
            card = card_record(**{k: rec.get(k) for k in CARD_KEYS if k not in ("node", "ranks")})
            card["node"] = self.node
            if card["source"] is None:
                card["source"] = self.sampler.name
            cards.append(card)

        all_ranks = sorted(set(self.rank_devices) | set(self.rank_pids))
        host_card = [c for c in cards if c["card"] == -1]
        seen: set[Any] = set()
        for c in cards:
            if c["card"] == -1:
                c["ranks"] = list(all_ranks)
            elif c["card"] is not None:
                c["ranks"] = sorted(r for r, d in self.rank_devices.items() if d == c["card"])
            seen.add(c["card"])
        if cards and not host_card:
            lost = sorted(r for r, d in self.rank_devices.items() if d not in seen)
            if lost:
                warnings.append("ranks " + ", ".join(f"{r} (card {self.rank_devices[r]})" for r in lost)
                                + f" are on cards that {self.sampler.name} did not report")

        host: dict[str, Any] = {**dict.fromkeys(HOST_KEYS), "processes": []}
        try:
            if host_card:  # the psutil source just read the host
                h = host_card[0]
                host.update(cpu_pct=h["util_pct"], mem_used_mb=h["memory_used_mb"],
                            mem_total_mb=h["memory_total_mb"])
            else:
                host.update(self._host.host_stats())
            host["processes"] = self._host.process_stats(self.rank_pids)
        except Exception as exc:  # noqa: BLE001 - host statistics are extras: their failure is a warning, the cards stay
            warnings.append(f"host statistics failed: {type(exc).__name__}: {exc}")
        return {
            "node": self.node,
            "ts": ts,
            "source": self.sampler.name,
            "cards": cards,
            "host": host,
            "warnings": warnings[:MAX_SAMPLE_WARNINGS],
        }

    # -- background thread ---------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, callback: Callable[[dict[str, Any]], Any]) -> None:
        """Call ``callback(sample)`` now and then every ``interval_s`` on a daemon thread.

        A sample that takes longer than the interval is followed by a pause of a fifth of
        the interval, so a slow source is never run back to back. Exceptions of the
        callback are logged and counted, never stop the thread.
        """
        if self.running:
            raise RuntimeError(f"telemetry of node {self.node} is already running")
        self._stop.clear()
        self.sampler.cancel_event.clear()
        self._thread = threading.Thread(target=self._loop, args=(callback,), daemon=True,
                                        name=f"mindpulse-telemetry-{self.node}")
        self._thread.start()

    def _loop(self, callback: Callable[[dict[str, Any]], Any]) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            sample = self.sample_once()
            if self._stop.is_set():
                break
            try:
                callback(sample)
            except Exception:  # noqa: BLE001 - the sampling thread outlives a consumer's error: counted and logged
                self.callback_errors += 1
                if self.callback_errors == 1 or self.callback_errors % 100 == 0:
                    log.exception("telemetry callback failed (%d times)", self.callback_errors)
            elapsed = time.monotonic() - t0
            self._stop.wait(max(self.interval_s - elapsed, 0.2 * self.interval_s))

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Stop the thread (a sample in progress is abandoned); True if it has ended."""
        self._stop.set()
        self.sampler.cancel_event.set()
        t = self._thread
        if t is not None:
            t.join(timeout_s)
            if t.is_alive():
                return False
        self.sampler.cancel_event.clear()  # sample_once works again after a stop
        return True

    def close(self) -> None:
        """Stop and release the sampler."""
        self.stop()
        self.sampler.close()


def telemetry_packet(sample: dict[str, Any]):
    """The :class:`mindpulse.wire.protocol.TelemetryPacket` of a :meth:`NodeSampler.sample_once` dict;
    its warnings travel in ``host["warnings"]``."""
    from mindpulse.wire.protocol import TelemetryPacket

    host = dict(sample.get("host") or {})
    if sample.get("warnings"):
        host["warnings"] = list(sample["warnings"])
    return TelemetryPacket(node=str(sample.get("node", "")), ts=float(sample.get("ts") or 0.0),
                           source=str(sample.get("source") or ""), cards=list(sample.get("cards") or []),
                           host=host)


def sample_this_machine(device: str = "auto") -> dict[str, Any]:
    """One sample of this machine with whatever source is present.

    ``auto``: DCMI or ``npu-smi`` if present, else NVML if there is a GPU, else psutil (the
    sources that were not usable are listed in the warnings). A named device without a
    source raises :class:`TelemetryUnavailable`.
    """
    notes: list[str] = []
    sampler = _pick(device, "auto", notes)
    try:
        sample = NodeSampler(socket.gethostname(), sampler, {}, interval_s=0.0).sample_once()
    finally:
        sampler.close()
    sample["warnings"] = [f"not used: {n}" for n in notes] + sample["warnings"]
    return sample
