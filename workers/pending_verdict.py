"""Rank 0's question on a checkpoint candidate, asked through the rank's outbox
(workers/outbox.py), and its answer, taken by the training thread when it has come."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from mindpulse.wire.directives import Directive
from mindpulse.wire.protocol import StepPacket

from .channel import REPLY_GRACE_S, Channel


class PendingVerdict:
    """Rank 0's question on a checkpoint candidate, asked through the outbox, and its answer.

    Through a thread of its own (`ThreadOutbox`) the question is written and its answer read
    there, one after the other, while the training thread trains on; the answer is then
    here to `take`. Inline, the channel is read here when the training thread asks (the
    channel keeps the question's answer until then)."""

    def __init__(self, pkt: StepPacket, build: Callable[[], StepPacket], channel: Channel, outbox: Any):
        self.pkt = pkt
        self._build = build
        self._channel = channel
        self._background = outbox.background
        self._answer: Directive | None = None
        self._came = threading.Event()
        self._wait_s = channel.decision_timeout_s + REPLY_GRACE_S
        if self._background:
            outbox.submit(self._ask_and_read)
        else:
            channel.decide_later(build().encode(), pkt.step, expect=1)

    def _ask_and_read(self) -> None:
        try:
            self._channel.decide_later(self._build().encode(), self.pkt.step, expect=1)
            self._answer = self._channel.verdict(wait=True)
        finally:  # whatever happened, the training thread is not left waiting for nothing
            if self._answer is None:
                self._answer = Directive.no_directive(self.pkt.step, "the verdict's question failed")
            self._came.set()

    def take(self, wait: bool) -> Directive | None:
        """The directive once it came (None before; `wait`: until it comes, at most the
        decision timeout and the reply's grace, then no directive)."""
        if not self._background:
            return self._channel.verdict(wait=wait)
        if not self._came.is_set() and (not wait or not self._came.wait(self._wait_s)):
            return Directive.no_directive(self.pkt.step, "no verdict in time") if wait else None
        return self._answer
