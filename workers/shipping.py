"""Ships a rank's packets to the run's aggregator and fetches directives.

Between decision points packets are buffered and sent fire-and-forget in batches (one
actor call per batch); at a decision point the buffer and the step's packet go in one
call that returns the directive. A missing or dead aggregator never blocks training for
longer than the decision timeout: the rank goes on and says so in its log.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from mindpulse.aggregator.packets import Action, Directive

log = logging.getLogger(__name__)

ENV_PREFIX = "MINDPULSE_"


@dataclass
class RankEnv:
    """What the launcher tells a rank through its environment."""

    run_id: str
    namespace: str
    aggregator: str
    rank: int
    world_size: int
    ray_address: str
    collect_freq: int
    decision_every: int
    decision_timeout_s: float
    total_steps: int
    batch_size: int
    relay: str = ""
    """host:port of the node agent's packet relay (empty: talk to the aggregator directly)."""

    @staticmethod
    def from_environ(env: dict[str, str] | None = None) -> "RankEnv | None":
        env = os.environ if env is None else env
        if not env.get("MINDPULSE_AGGREGATOR"):
            return None
        rank = int(env.get("RANK_ID", env.get("MINDPULSE_RANK", "0")))
        return RankEnv(
            run_id=env.get("MINDPULSE_RUN_ID", ""),
            namespace=env.get("MINDPULSE_NAMESPACE", "mindpulse"),
            aggregator=env["MINDPULSE_AGGREGATOR"],
            rank=rank,
            world_size=int(env.get("RANK_SIZE", env.get("MINDPULSE_WORLD_SIZE", "1"))),
            ray_address=env.get("MINDPULSE_RAY_ADDRESS", ""),
            collect_freq=int(env.get("MINDPULSE_COLLECT_FREQ", "10")),
            decision_every=int(env.get("MINDPULSE_DECISION_EVERY", "1")),
            decision_timeout_s=float(env.get("MINDPULSE_DECISION_TIMEOUT_S", "120")),
            total_steps=int(env.get("MINDPULSE_TOTAL_STEPS", "0")),
            batch_size=int(env.get("MINDPULSE_BATCH_SIZE", "0")),
            relay=env.get("MINDPULSE_RELAY", ""),
        )


class AggregatorClient:
    BATCH = 32
    FLUSH_S = 1.0

    def __init__(self, handle, decision_timeout_s: float = 120.0):
        self.handle = handle
        self.decision_timeout_s = decision_timeout_s
        self._buffer: list[bytes] = []
        self._last_flush = time.monotonic()
        self.failures = 0

    @staticmethod
    def connect(renv: RankEnv):
        """The node agent's relay when there is one (the normal case), else the aggregator."""
        if renv.relay:
            from mindpulse.aggregator.relay import RelayClient

            host, _, port = renv.relay.rpartition(":")
            return RelayClient(host, int(port), renv.decision_timeout_s)
        import ray

        if not ray.is_initialized():
            # a rank started outside Ray (msrun) joins the run's cluster as a driver
            ray.init(address=renv.ray_address or "auto", namespace=renv.namespace,
                     log_to_driver=False, logging_level=logging.WARNING)
        handle = ray.get_actor(renv.aggregator, namespace=renv.namespace)
        return AggregatorClient(handle, renv.decision_timeout_s)

    def send(self, packet: bytes) -> None:
        self._buffer.append(packet)
        if len(self._buffer) >= self.BATCH or time.monotonic() - self._last_flush >= self.FLUSH_S:
            self.flush()

    def flush(self) -> None:
        if not self._buffer:
            return
        batch, self._buffer = self._buffer, []
        self._last_flush = time.monotonic()
        try:
            self.handle.ingest.remote(batch)
        except Exception as exc:  # the aggregator is gone: training goes on
            self.failures += 1
            log.warning("could not ship %d packets to the aggregator: %s", len(batch), exc)

    def decide(self, packet: bytes, step: int) -> Directive:
        import ray

        batch, self._buffer = self._buffer + [packet], []
        self._last_flush = time.monotonic()
        try:
            ref = self.handle.decide.remote(batch, step, self.decision_timeout_s)
            return Directive.decode(ray.get(ref, timeout=self.decision_timeout_s + 10))
        except Exception as exc:
            self.failures += 1
            log.warning("no directive for step %d (%s); continuing", step, exc)
            return Directive(step=step, action=Action.CONTINUE, reason=f"no directive: {exc}")
