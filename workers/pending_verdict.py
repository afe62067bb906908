"""Rank 0's question on a checkpoint candidate, asked through the rank's outbox
(workers/outbox.py), and its answer, taken by the training thread when it has come."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from mindpulse.wire.directives import Directive
from mindpulse.wire.protocol import StepPacket

from .channel import REPLY_GRACE_S, WRITE_TIMEOUT_S, Channel


class PendingVerdict:
    """Rank 0's question on a checkpoint candidate, asked through the outbox, and its answer.

    Through a thread of its own (`ThreadOutbox`) the question is written there, and the
    answer read there too without ever holding the thread up: each later job of the outbox
    first looks whether the answer is in (`poll`, a `select` with no wait), so the rank's next
    packets go out as before while the aggregator decides. When the training thread must
    have the answer (the next candidate, the run's end) it asks the outbox to read it,
    blocking (`take(wait=True)`: at most the channel's own decision timeout and the reply's
    grace). An answer read late is kept, never dropped. Inline, the channel is read here when
    the training thread asks (the channel keeps the question's answer until then)."""

    def __init__(self, pkt: StepPacket, build: Callable[[], StepPacket], channel: Channel, outbox: Any):
        self.pkt = pkt
        self._build = build
        self._channel = channel
        self._outbox = outbox
        self._background = outbox.background
        self._answer: Directive | None = None
        self._came = threading.Event()
        self._asked = False
        if self._background:
            outbox.submit(self._ask)
        else:
            channel.decide_later(build().encode(), pkt.step, expect=1)

    def _ask(self) -> None:
        try:
            self._channel.decide_later(self._build().encode(), self.pkt.step, expect=1)
        except Exception:  # the question did not go out: the rank goes on without a verdict
            self._keep(Directive.no_directive(self.pkt.step, "the verdict's question failed"))
            raise
        self._asked = True

    def _keep(self, d: Directive | None) -> None:
        if d is not None and not self._came.is_set():
            self._answer = d
            self._came.set()

    @property
    def due(self) -> bool:
        """Asked, and the answer not read yet."""
        return self._asked and not self._came.is_set()

    def poll(self) -> None:
        """On the outbox thread, before its next job: keep the answer if it is in (no wait)."""
        if self._asked and not self._came.is_set():
            self._keep(self._channel.verdict(wait=False))

    def _read(self) -> None:
        """On the outbox thread: read the answer, waiting for it (the channel bounds the wait)."""
        if self._came.is_set():
            return
        try:
            d = self._channel.verdict(wait=True) if self._asked else None
        finally:
            self._keep(d if self._asked and d is not None
                       else Directive.no_directive(self.pkt.step, "no answer to the verdict's question"))

    def take(self, wait: bool) -> Directive | None:
        """The directive once it came (None before; `wait`: until it comes, at most the
        decision timeout and the reply's grace, then no directive)."""
        if not self._background:
            return self._channel.verdict(wait=wait)
        if not self._came.is_set() and wait:
            try:
                self._outbox.call(self._read, timeout=self._channel.decision_timeout_s + REPLY_GRACE_S
                                  + WRITE_TIMEOUT_S)
            except Exception as exc:  # no answer in time (or the read failed): the rank goes on without one
                self._keep(Directive.no_directive(self.pkt.step, f"no verdict: {exc}"))
        return self._answer if self._came.is_set() else None
