"""The rank's heartbeat: "alive, at step N" (and "inside step N+1" while the loop is in it)
from a thread of its own.

The training loop cannot say it is alive while it is blocked in a collective, so a
separate thread does, every `monitor.heartbeat_s` seconds, over a channel of its own (a
socket is not shared between threads). A rank whose heartbeat stops (SIGSTOP, a dead
host) is then told apart from ranks that are alive but waiting for it. SIGUSR1 dumps
every thread's Python stack into the rank's log (the launcher sends it on a hang).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from mindpulse.config.rank_settings import RankSettings
from mindpulse.wire.protocol import EventKind, EventPacket, RankState

log = logging.getLogger(__name__)


def dump_stacks_on_sigusr1() -> None:
    """Every thread's Python stack into stderr (the rank's log) on SIGUSR1."""
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (ValueError, AttributeError, RuntimeError):
        pass  # not the main thread, or no such signal: stacks then come from py-spy only


IN_STEP = "in step {}"
"""A beat's message (for people) while the loop is inside a step; the aggregator reads the
beat's `state` (`RankState.IN_STEP`) and `state_step` to tell a rank blocked before the step
the others are in (the one they wait for) from those waiting inside it (in its all-reduce)."""
BUSY_SAVING = RankState.SAVING
BUSY_EVALUATING = RankState.EVALUATING
BUSY = "{} after step {}"
"""A beat's message while the rank writes a checkpoint or evaluates after a step (its state
`RankState.SAVING` or `EVALUATING`): time the hang clock does not count (a long save or
evaluation is not a hang)."""


class Heartbeat:
    def __init__(self, settings: RankSettings, rank: int, current_step: Callable[[], int],
                 in_step: Callable[[], int | None] | None = None, *, connect: Callable[[], Any] | None = None,
                 busy: Callable[[], RankState | None] | None = None):
        self.settings = settings
        self.connect = connect
        """Opens the beat's own channel (the session's `connect`, handed in: the session owns
        the heartbeat, so the heartbeat cannot import it)."""
        self.rank = rank
        self.current_step = current_step
        self.in_step = in_step or (lambda: None)
        self.busy = busy or (lambda: None)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        dump_stacks_on_sigusr1()
        self._thread = threading.Thread(target=self._beat, name="mindpulse-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """The thread ends at its next beat (it never delays the rank's exit: a daemon)."""
        self._stop.set()

    def packet(self) -> EventPacket:
        """One beat: the last finished step, and the step the loop is inside (if any)."""
        inside, busy, step = self.in_step(), self.busy(), self.current_step()
        if busy:
            state, state_step, message = RankState(busy), step, BUSY.format(RankState(busy).value, step)
        elif inside is not None:
            state, state_step, message = RankState.IN_STEP, inside, IN_STEP.format(inside)
        else:
            state, state_step, message = RankState.IDLE, 0, ""
        return EventPacket(rank=self.rank, kind=EventKind.HEARTBEAT.value, ts=time.time(), step=step,
                           pid=os.getpid(), message=message, state=state.value, state_step=state_step)

    def _beat(self) -> None:
        if self.connect is None:
            return  # nowhere to beat to (a session outside a launch)
        try:
            channel = self.connect()
        except Exception as exc:  # the monitor never kills the training it watches: no heartbeat, logged
            log.warning("[rank %d] heartbeat has no connection: %s", self.rank, exc)
            return
        while not self._stop.wait(self.settings.monitor.heartbeat_s):
            try:
                channel.send(self.packet().encode())
                channel.flush()
            except Exception:
                pass  # a beat lost is the signal itself: the aggregator sees the silence
        channel.close()
