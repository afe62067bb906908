"""The aggregator as a Ray actor: one per run, named, async so decisions can wait.

Ranks call `ingest` fire-and-forget between decision points and `decide` at decision
points; `decide` returns once every rank has reported that step (or after `timeout_s`,
naming the missing ranks), so all ranks receive the same directive for the same step.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import ray

from mindpulse.protocol import Directive

from .core import AggregatorCore


def actor_name(run_id: str) -> str:
    return f"mindpulse-aggregator-{run_id}"


class AggregatorActor:
    def __init__(self, run_dir: str, world_size: int, per_print_step: int = 10, total_steps: int | None = None,
                 settings: dict[str, Any] | None = None):
        # restarted by Ray after a crash: rebuild the state from metrics.msgpack first
        replay = False
        try:
            replay = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        except Exception:
            pass
        self.core = AggregatorCore(Path(run_dir), world_size, per_print_step, total_steps, settings, replay=replay)
        self._reduced = asyncio.Condition()

    async def ingest(self, batch: list[bytes]) -> int:
        done = self.core.ingest(batch)
        if done:
            async with self._reduced:
                self._reduced.notify_all()
        return len(done)

    async def ingest_node(self, node: int, batch: dict[str, Any]) -> int:
        """A node agent's pre-reduced batch (node/prereduce.py)."""
        done = self.core.ingest_node(node, batch)
        if done:
            async with self._reduced:
                self._reduced.notify_all()
        return len(done)

    async def ingest_nodes(self, batches: list[tuple[Any, dict[str, Any]]]) -> int:
        """A group leader's call: several nodes' batches (or partials it merged already)."""
        done = self.core.ingest_nodes(batches)
        if done:
            async with self._reduced:
                self._reduced.notify_all()
        return len(done)

    async def decide_node(self, node: int, batch: dict[str, Any], step: int, timeout_s: float) -> bytes:
        """`decide` for a node agent's pre-reduced batch."""
        await self.ingest_node(node, batch)
        return await self.decide([], step, timeout_s)

    async def decide(self, batch: list[bytes], step: int, timeout_s: float) -> bytes:
        """Ingest `batch` (ending with this rank's packet for `step`) and wait for the directive."""
        await self.ingest(batch)
        directive = self.core.directive_for(step)
        if directive is None:
            try:
                async with self._reduced:
                    await asyncio.wait_for(
                        self._reduced.wait_for(lambda: self.core.directive_for(step) is not None), timeout_s
                    )
            except TimeoutError:
                missing = self.core.missing_for(step)
                self.core.console.append(
                    f"WARNING no directive for step {step} after {timeout_s:.0f}s: ranks {missing} have not reported it"
                )
                return Directive(step=step, reason=f"timeout: ranks {missing} missing").encode()
            directive = self.core.directive_for(step)
        return directive.encode()

    async def lease(self, after: int, timeout_s: float) -> bytes:
        """Long poll (one outstanding call per node agent): the lease once a step beyond
        `after` is reduced or a stop is decided, else the current one after `timeout_s`."""

        def moved() -> bool:
            lease = self.core.lease()
            return lease.reduced_through > after or lease.stopping

        if not moved():
            try:
                async with self._reduced:
                    await asyncio.wait_for(self._reduced.wait_for(moved), timeout_s)
            except TimeoutError:
                pass
        return self.core.lease().encode()

    async def request_stop(self, reason: str, rule: str = "interrupt", save: bool = False) -> None:
        self.core.request_stop(reason, rule=rule, save=save)

    async def poll(self) -> dict[str, Any]:
        return {"console": self.core.drain_console(), "progress": self.core.progress()}

    async def snapshot(self) -> dict[str, Any]:
        return self.core.snapshot()

    async def close(self) -> dict[str, Any]:
        snap = self.core.snapshot()
        self.core.close()
        return snap

    async def hang_check(self, timeout_s: float, heartbeat_stale_s: float):
        return self.core.hang_check(timeout_s, heartbeat_stale_s)

    async def ping(self) -> int:
        import os

        return os.getpid()


def start_aggregator(run_id: str, namespace: str, run_dir: Path, world_size: int, per_print_step: int,
                     total_steps: int | None, node_id: str | None = None, settings: dict[str, Any] | None = None):
    """Start the named actor; pinned to the driver's node so it can write the run directory."""
    options: dict[str, Any] = dict(
        name=actor_name(run_id),
        namespace=namespace,
        num_cpus=0,
        max_concurrency=4096,
        lifetime=None,
        # a crashed aggregator is restarted and rebuilds itself from metrics.msgpack; calls
        # made meanwhile wait in their callers and are retried on the new instance
        max_restarts=5,
        max_task_retries=-1,
    )
    if node_id:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    cls = ray.remote(AggregatorActor)
    return cls.options(**options).remote(str(run_dir), world_size, per_print_step, total_steps, settings)
