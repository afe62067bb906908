"""One NodeAgent per node (a Ray actor pinned to it): samples the node's cards on an
interval and ships telemetry packets to the aggregator. One sampler per node, never one
per rank: `npu-smi` is slow and must not run concurrently."""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

log = logging.getLogger(__name__)


class NodeAgent:
    def __init__(self, node: int, aggregator: Any, device: str, rank_devices: dict[int, int],
                 interval_s: float = 5.0):
        self.node = node
        self.name = f"node{node}-{socket.gethostname()}"
        self.aggregator = aggregator
        self.device = device
        self.rank_devices = {int(k): int(v) for k, v in rank_devices.items()}
        self.interval_s = interval_s
        self.sampler = None
        self.sent = 0
        self.errors: list[str] = []

    def start(self, rank_pids: dict[int, int]) -> dict[str, Any]:
        """Start sampling; returns what source is used (or why there is none)."""
        from mindpulse.aggregator.telemetry import NodeSampler, TelemetryUnavailable, pick_sampler

        if self.interval_s <= 0:
            return {"node": self.name, "source": None, "reason": "telemetry off"}
        try:
            sampler = pick_sampler(self.device)
        except TelemetryUnavailable as exc:
            self.errors.append(str(exc))
            return {"node": self.name, "source": None, "reason": str(exc)}
        self.sampler = NodeSampler(self.name, sampler, self.rank_devices, {int(k): int(v) for k, v in rank_pids.items()},
                                   interval_s=self.interval_s)
        self.sampler.start(self._ship)
        return {"node": self.name, "source": sampler.name}

    def _ship(self, sample: dict[str, Any]) -> None:
        from mindpulse.aggregator.telemetry import telemetry_packet

        try:
            self.aggregator.ingest.remote([telemetry_packet(sample).encode()])
            self.sent += 1
        except Exception as exc:  # the aggregator may be restarting: drop this sample
            self.errors.append(repr(exc))
            del self.errors[:-20]

    def stop(self) -> dict[str, Any]:
        if self.sampler is not None:
            self.sampler.stop()
            # one last sample so short runs still have telemetry at the end
            try:
                self._ship(self.sampler.sample_once())
            except Exception:
                pass
            self.sampler = None
        return {"node": self.name, "sent": self.sent, "errors": self.errors[-5:]}

    def ping(self) -> float:
        return time.time()
