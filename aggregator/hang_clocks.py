"""The aggregator's two hang clocks: start-up (until a rank's first finished step) and the
running clock (from each rank's, or its node's, last new step), and whom to blame when both
ran out.

Every rank's clock is fed by its step packets and its heartbeats (their state fields: inside
a step, or busy saving or evaluating after one: `protocol.RankState`), and each node's by its
partials. Every time the aggregator reads for these clocks comes from `now()`, this module's
one clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

from mindpulse.config import auto_hang_timeout
from mindpulse.wire.protocol import RankState


def now() -> float:
    return time.time()


class HangClocks:
    def __init__(self, world_size: int, ranks_per_node: int, startup_timeout_s: float, device: str):
        self.world_size = world_size
        self.ranks_per_node = ranks_per_node
        self.startup_timeout_s = startup_timeout_s
        self.device = device
        self.started = now()
        self.last_progress = now()
        """When any rank last finished a step it had not reported before."""
        self.heartbeat: dict[int, tuple[float, int]] = {}
        """Each rank's last sign of life: (when, its step)."""
        self.ended_at: dict[int, float] = {}
        """When each rank said its training ended (its END: the Monitor's end of training, or its
        script's end): a process still alive `monitor.exit_timeout_s` later is named and ended."""
        self.first_step: dict[int, int] = {}
        """Each rank's first reported step (the one it started at: 0, or the resume step)."""
        self.top_step: dict[int, int] = {}
        self.progress_at: dict[int, float] = {}
        """When each rank last finished a new step; absent while it is starting up."""
        self.node_first: dict[int, int] = {}
        self.node_top: dict[int, int] = {}
        self.node_progress_at: dict[int, float] = {}
        """The same clocks per node, from node partials (every rank of the node reached the step)."""
        self.in_step: dict[int, int] = {}
        """The step each rank's loop was inside at its last heartbeat (absent: between steps)."""
        self.newest_clock = 0.0
        """The newest of every rank's and node's clock (`progress_at`, `node_progress_at`):
        while every rank is live, one comparison tells that some rank is within its clock
        (the check then costs nothing per rank: at 32,768 ranks a full pass was ~0.3 s)."""

    # ---- what moves them
    def on_step_packet(self, rank: int, step: int, newer: bool) -> None:
        """A rank's step packet (`newer`: a step beyond the last it reported)."""
        t = now()
        if newer:
            self.last_progress = t
        self.heartbeat[rank] = (t, step)
        self._note_step(rank, step, t)

    def on_heartbeat(self, rank: int, step: int, state: RankState, state_step: int) -> None:
        """A heartbeat: the rank's last finished step, and what its loop is doing."""
        t = now()
        self.heartbeat[rank] = (t, step)
        self._note_step(rank, step, t)
        if state is RankState.IN_STEP:
            self.in_step[rank] = state_step
        else:
            self.in_step.pop(rank, None)
        if rank in self.progress_at and state.busy:
            self.progress_at[rank] = self.newest_clock = t  # saving or evaluating: its clock waits until it is done

    def on_end(self, rank: int, ts: float) -> None:
        self.ended_at.setdefault(rank, ts or now())

    def on_node_step(self, nodes: list[int], step: int) -> None:
        """A node partial (or a group's, over several nodes) of `step`."""
        t = now()
        rpn = self.ranks_per_node
        for n in nodes:
            if not (rpn and 0 <= n * rpn < self.world_size):
                continue  # no rank of this world reads that clock (a stray or forged node id)
            first = self.node_first.setdefault(n, step)
            if step > self.node_top.get(n, first):
                self.node_top[n] = step
                self.node_progress_at[n] = self.newest_clock = t
                self.last_progress = t

    def _note_step(self, rank: int, step: int, t: float) -> None:
        first = self.first_step.setdefault(rank, step)
        if step > self.top_step.get(rank, first):
            self.top_step[rank] = step
            self.progress_at[rank] = self.newest_clock = t  # its first finished step ends its start-up

    # ---- the verdict
    def limit(self, timeout_s: float | None, step_times: list[float]) -> float:
        """The running clock's limit: `timeout_s`, or with None (`monitor.hang_timeout_s: auto`)
        the one the recent reduced steps' times give (config.auto_hang_timeout)."""
        if timeout_s is not None:
            return timeout_s
        return auto_hang_timeout(step_times, self.device)

    def check(self, timeout_s: float, heartbeat_stale_s: float, *, no_monitor: Collection[int],
              last_step_of_rank: Callable[[int], int], pid_of: Callable[[int], Any],
              started_ranks: list[int]) -> dict[str, Any] | None:
        """None, or the ranks to blame when no live rank is within its clock.

        A rank's clock starts at its first finished step (the step after the one it started
        at) and runs `timeout_s` from its last new step; until that first step (start-up, the
        first graph compile, the first collective's connection) it runs `startup_timeout_s`
        from the aggregator's start. Blamed: the ranks whose heartbeat went silent (stopped
        processes), else the ranks behind the others' last step, else, all at one step, those
        not inside the next step that others are inside (the others wait for them in its
        collective), else every rank at that step."""
        t = now()
        if not self.ended_at and not no_monitor and t - self.newest_clock < timeout_s:
            return None  # every rank is live and one of them is within its clock
        # a rank that trains without a Monitor reports no steps: not a hang (advice.py names it)
        live = [r for r in range(self.world_size) if r not in self.ended_at and r not in no_monitor]
        if not live:
            return None
        rpn = self.ranks_per_node
        # a rank's clock: its own packets and heartbeats, or its node's partials
        progress = {r: max(self.progress_at.get(r, 0.0), self.node_progress_at.get(r // rpn, 0.0) if rpn else 0.0)
                    for r in live}
        progress = {r: p for r, p in progress.items() if p > 0}
        starting = [r for r in live if r not in progress]
        if any(t - progress[r] < timeout_s for r in live if r in progress):
            return None
        if starting and t - self.started < self.startup_timeout_s:
            return None
        silent = [r for r in live if t - self.heartbeat.get(r, (self.started, 0))[0] > heartbeat_stale_s]
        # packets between decision points may still sit in a client's buffer: the heartbeat's
        # step is as fresh as the rank itself
        steps = {r: max(last_step_of_rank(r), self.heartbeat.get(r, (0, 0))[1]) for r in range(self.world_size)}
        inside = [r for r in live if self.in_step.get(r) == steps[r] + 1]
        if silent:
            stuck = silent
        else:
            low = min(steps[r] for r in live)
            stuck = [r for r in live if steps[r] == low]
            if len(stuck) == len(live):  # all at one step: the ones the others wait for did not enter the next
                outside = [r for r in stuck if r not in inside]
                if inside and outside:
                    stuck = outside
        last = max(progress.values(), default=self.started)
        return {"stuck": sorted(stuck), "steps": steps, "silent": sorted(silent), "inside": sorted(inside),
                "phase": "startup" if starting else "running",
                "limit_s": self.startup_timeout_s if starting else timeout_s,
                "no_progress_s": t - last,
                "pids": {r: pid_of(r) for r in range(self.world_size)},
                "started": sorted(started_ranks)}


__all__ = ["HangClocks", "now"]
