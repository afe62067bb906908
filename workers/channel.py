"""The rank's one way out: a `Channel` ships packets and fetches directives and leases.

Two kinds, one behaviour: `RelayChannel` talks to the node agent's packet relay over
loopback (the normal case: the aggregator's load then grows with nodes, not ranks);
`ActorChannel` calls the aggregator actor itself (a run without relays, a benchmark).

Events are buffered and sent fire-and-forget in batches; a step's packet goes out at once
(`send_step`), with whatever is queued. Before a step the rank asks for its `lease`: the
answer comes from the cache without any I/O while the aggregator keeps up, and blocks
only when the aggregator is more than `monitor.max_lag_steps` steps behind. The relay
pushes every new lease down a connection of the relay channel's own, so the lease is
most often already in the socket when the rank needs it (no round trip). Rank 0 at a
checkpoint candidate sends the step in a `decide` call that returns its directive, so the
aggregator has seen everything before it decides. A missing or dead peer never blocks
training for longer than the decision timeout: the rank goes on (`Directive.no_directive`,
no lease) and says why in its log.

`connect` picks this rank's channel from its settings; `RankSession` (workers/session.py)
and the heartbeat each hold one.
"""

from __future__ import annotations

import abc
import logging
import select
import socket
import threading
import time
from typing import Any

from mindpulse.config import MonitorConfig
from mindpulse.config.rank_settings import RankSettings
from mindpulse.wire.directives import Directive, Lease
from mindpulse.wire.frames import (
    FRAME_HEADER_BYTES,
    MAX_FRAME,
    FrameReader,
    decode_frame_body,
    encode_frame,
    frame_length,
)
from mindpulse.wire.lease_board import LeaseView

log = logging.getLogger(__name__)

BATCH_PACKETS = 32
"""A batch goes out when it holds this many packets..."""
FLUSH_S = 0.5
"""...or when this long has passed since the last one went (checked on `send`)."""
CONNECT_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 30.0
REPLY_GRACE_S = 15.0
"""Waited past the decision timeout for the directive itself: the peer answers after
at most the timeout it was handed, so a longer silence means it is gone."""


class Channel(abc.ABC):
    """Buffered packets out, directives back; subclasses only move batches."""

    def __init__(self, decision_timeout_s: float = MonitorConfig.decision_timeout_s):
        self.decision_timeout_s = decision_timeout_s
        self.failures = 0
        """Batches or decisions that did not get through (the rank went on regardless);
        counted by `_failed` from the training thread and the outbox's (workers/outbox.py)."""
        self._failures_lock = threading.Lock()
        self._buffer: list[bytes] = []
        self._last_flush = time.monotonic()
        self._lease: Lease | None = None
        self.lost_since: float | None = None
        """When the peer stopped answering (None while it answers)."""
        self._later: tuple[int, Directive | None] | None = None
        """(step, its directive once read) of the decision asked by `decide_later`."""

    def send(self, packet: bytes) -> None:
        """Queue one encoded packet; it goes out with the next batch."""
        self._buffer.append(packet)
        if len(self._buffer) >= BATCH_PACKETS or time.monotonic() - self._last_flush >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        """Send what is queued now (fire-and-forget)."""
        if self._buffer:
            self._ship(self._take())

    def send_step(self, packet: bytes, step: int) -> None:
        """A rank's packet of `step`: out now, with what is queued (the relay forwards a
        step as soon as every rank of its node has sent it)."""
        self._ship(self._take() + [packet], step)

    def decide(self, packet: bytes, step: int, expect: int | None = None) -> Directive:
        """Send the queue and the decision step's packet; wait for the step's directive.
        `expect`: how many ranks of the node decide this step (None: all of them)."""
        return self._decide(self._take() + [packet], step, expect)

    answers_later = False
    """Whether `decide_later` returns before the answer (the rank may train on meanwhile)."""

    background = False
    """Whether the rank runs this channel's work on a thread of its own (workers/outbox.py): a
    channel that writes to a socket; one that hands packets to Ray, or a test's, runs inline."""

    def decide_later(self, packet: bytes, step: int, expect: int | None = None) -> None:
        """Like `decide`, but the directive is taken later (`verdict`): the rank trains on
        meanwhile. One decision at a time: the previous one's verdict is taken first. By
        default (`answers_later` False) the decision is made now and kept; `RelayChannel`
        writes the question and reads the answer when it has come."""
        self._later = (step, self._decide(self._take() + [packet], step, expect))

    def verdict(self, wait: bool) -> Directive | None:
        """The directive of the decision `decide_later` asked for: None while it has not come
        (`wait` False), or when none is pending. `wait` True blocks until it comes (at most
        the decision timeout: then a no-directive)."""
        later, self._later = self._later, None
        return later[1] if later is not None else None

    @property
    def cached_lease(self) -> Lease | None:
        """The newest lease already here (no wait, no question asked)."""
        self._poll_lease()
        return self._lease

    def lease(self, need: int) -> tuple[Lease | None, float]:
        """The lease once step `need` is reduced or a stop is decided: (lease, seconds this
        rank was blocked). None when no lease could be had (the rank goes on)."""
        self._poll_lease()
        cached = self._lease
        if _grants(cached, need):
            return cached, 0.0
        lease, waited = self._fetch_lease(need)
        if lease is not None:
            self._lease = lease
        return lease, waited

    def close(self) -> None:
        """Send what is queued and let go of the connection (a later call reconnects)."""
        self.flush()

    def _take(self) -> list[bytes]:
        batch, self._buffer = self._buffer, []
        self._last_flush = time.monotonic()
        return batch

    def no_directive_now(self, step: int, why: Any) -> Directive:
        """No directive for `step` (counted as a failure, said in the log): the rank goes on."""
        return self._no_directive(step, why)

    def _no_directive(self, step: int, why: Any) -> Directive:
        self._failed()
        log.warning("no directive for step %d (%s); continuing", step, why)
        return Directive.no_directive(step, str(why))

    def _failed(self) -> None:
        # `+=` is a read and a write, and two threads count (CPython 3.11 happens not to switch
        # threads inside it, a free-threaded build may: the lock does not rely on either)
        with self._failures_lock:
            self.failures += 1

    def lost_for(self) -> float:
        """Seconds since the peer last answered (0 while it answers)."""
        return 0.0 if self.lost_since is None else time.monotonic() - self.lost_since

    def _answered(self) -> None:
        self.lost_since = None

    def _lost(self) -> None:
        if self.lost_since is None:
            self.lost_since = time.monotonic()

    def _no_lease(self, need: int, why: Any) -> tuple[None, float]:
        self._lost()
        self._failed()
        log.warning("no lease for step %d (%s); continuing", need, why)
        return None, 0.0

    @abc.abstractmethod
    def _ship(self, batch: list[bytes], step: int | None = None) -> None:
        """Hand a batch over (`step`: it ends with this rank's packet of that step); never
        raises (count a failure and log instead)."""

    @abc.abstractmethod
    def _decide(self, batch: list[bytes], step: int, expect: int | None) -> Directive:
        """Hand a batch over and return the step's directive; never raises."""

    @abc.abstractmethod
    def _fetch_lease(self, need: int) -> tuple[Lease | None, float]:
        """Ask the peer for the lease covering `need`; never raises."""

    def _poll_lease(self) -> None:
        """Take, without waiting, a lease the peer already sent (none by default: only a
        channel whose peer pushes leases has one)."""
        return None


def _grants(lease: Lease | None, need: int) -> bool:
    return lease is not None and lease.covers(need)


class RelayChannel(Channel):
    """Frames (mindpulse/wire/frames.py's `encode_frame`) to the node agent's relay on this machine.

    Packets and decisions go on one connection. Leases are read from the node's lease
    board (mindpulse/wire/lease_board.py: shared memory the agent writes each new lease to), so
    taking the lease before a step is a read of mapped memory: no socket, no round trip.
    A second connection asks the relay for leases only at the first lease (the answer
    names the board) and when the board's lease does not let this rank start its next
    step; the rank then blocks until the relay answers. Without a board (no shared memory
    on the node) every lease is asked for there."""

    def __init__(self, host: str, port: int, decision_timeout_s: float = MonitorConfig.decision_timeout_s,
                 token: str = ""):
        super().__init__(decision_timeout_s)
        self.addr = (host, port)
        self.token = token
        self.sock: socket.socket | None = None
        self.lease_sock: socket.socket | None = None
        self._lease_reader = FrameReader()
        self.board: LeaseView | None = None
        self._greeted = False
        """The relay answered this connection's first lease question (and named its board)."""
        self._asked_on: socket.socket | None = None
        """The connection `decide_later` asked on (a reconnection since gets no answer to it)."""
        self._no_service = False
        """The relay has no lease to give (no aggregator behind it): nothing holds the rank."""
        self._connect()
        # the lease connection opens at the first lease asked for: a channel that never asks
        # (the heartbeat's) never opens one

    def _open(self, what: str) -> socket.socket | None:
        try:
            sock = socket.create_connection(self.addr, timeout=CONNECT_TIMEOUT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.token:  # the relay drops a connection whose first frame is not this
                sock.sendall(encode_frame({"op": "hello", "token": self.token}))
            return sock
        except OSError as exc:
            self._failed()
            log.warning("cannot reach the node's packet relay at %s:%d (%s): %s", *self.addr, what, exc)
            return None

    def _connect(self) -> None:
        self.sock = self._open("packets")

    def _write(self, obj: dict[str, Any]) -> bool:
        if self.sock is None:
            self._connect()
            if self.sock is None:
                return False
        try:
            self.sock.settimeout(WRITE_TIMEOUT_S)
            self.sock.sendall(encode_frame(obj))
            return True
        except OSError as exc:
            self._failed()
            log.warning("packet relay write failed: %s", exc)
            self._disconnect()
            return False

    def _ship(self, batch: list[bytes], step: int | None = None) -> None:
        frame: dict[str, Any] = {"op": "send", "packets": batch}
        if step is not None:
            frame["step"] = step
        self._write(frame)

    def _reply(self, sock: socket.socket | None = None) -> dict[str, Any]:
        """The relay's answer to the request just written (it answers within the timeout
        it was handed)."""
        sock = sock or self.sock
        assert sock is not None
        sock.settimeout(self.decision_timeout_s + REPLY_GRACE_S)
        n = frame_length(_recv_exact(sock, FRAME_HEADER_BYTES))
        if n > MAX_FRAME:
            raise ValueError(f"a {n}-byte frame from the relay")
        return decode_frame_body(_recv_exact(sock, n))

    # ---- leases: the board, and questions to the relay ------------------------------------
    def _subscribe(self) -> socket.socket:
        """The lease connection (raises OSError when the relay is unreachable)."""
        if self.lease_sock is None:
            sock = self._open("leases")
            if sock is None:
                raise OSError("relay unreachable")
            self.lease_sock, self._lease_reader = sock, FrameReader()
        return self.lease_sock

    def _ask(self, need: int | None, deadline: float) -> None:
        """Ask the relay for the lease (covering step `need`; None: as it is) and read
        answers until one comes that does, or `deadline`. Raises OSError or ValueError when
        the connection broke."""
        sock = self._subscribe()
        sock.settimeout(WRITE_TIMEOUT_S)
        sock.sendall(encode_frame({"op": "lease"} if need is None else {"op": "lease", "need": need}))
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            sock.settimeout(left)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                return
            if not chunk:
                raise ConnectionError("relay closed the lease connection")
            for body in self._lease_reader.feed(chunk):
                self._take_answer(decode_frame_body(body))
            if self._no_service or (self._greeted and (need is None or _grants(self._lease, need))):
                return

    def _take_answer(self, msg: dict[str, Any]) -> None:
        self._answered()
        raw = msg.get("lease")
        if raw is None:
            self._no_service = True
        else:
            lease = Lease.decode(raw)
            if self._lease is None or lease.reduced_through >= self._lease.reduced_through or lease.stopping:
                self._lease = lease  # answers to questions asked earlier may come late: keep the newest
        if not self._greeted:
            self._greeted = True
            path = msg.get("board")
            if isinstance(path, str) and self.board is None:
                try:
                    self.board = LeaseView(path)
                except (OSError, ValueError) as exc:
                    log.info("no lease board at %s (%s): each lease is asked of the relay", path, exc)

    def _poll_lease(self) -> None:
        """The board's newest lease, if it moved (a read of shared memory)."""
        if self.board is None:
            return
        raw = self.board.read()
        if raw is not None:
            try:
                self._lease = Lease.decode(raw)
            except Exception:  # a board is written whole or not at all; never trust it blindly
                self.board.torn += 1

    def _fetch_lease(self, need: int) -> tuple[Lease | None, float]:
        deadline = time.monotonic() + self.decision_timeout_s
        waited = False
        try:
            if not self._greeted:  # the first lease (and the board's name): not a wait
                self._ask(None, deadline)
                self._poll_lease()
            t0 = time.monotonic()
            if not self._no_service and not _grants(self._lease, need):
                waited = True
                self._ask(need, deadline)
        except Exception as exc:  # any broken lease connection or answer: the rank goes on without a lease
            self._drop_leases()
            return self._no_lease(need, exc)
        if self._no_service:
            return None, 0.0
        if self._lease is None:
            return self._no_lease(need, "no lease from the relay")
        return self._lease, (time.monotonic() - t0) if waited else 0.0

    def _drop_leases(self) -> None:
        """Let go of the lease connection and the board (the next lease asks again)."""
        self._greeted = False
        if self.board is not None:
            self.board.close()
            self.board = None
        if self.lease_sock is not None:
            try:
                self.lease_sock.close()
            finally:
                self.lease_sock = None

    def _decide(self, batch: list[bytes], step: int, expect: int | None) -> Directive:
        frame: dict[str, Any] = {"op": "decide", "packets": batch, "step": step, "timeout": self.decision_timeout_s}
        if expect is not None:
            frame["expect"] = expect
        if not self._write(frame):
            return Directive.no_directive(step, "relay unreachable")
        try:
            return Directive.decode(self._reply()["directive"])
        except Exception as exc:  # a dead relay or a bad answer: the rank goes on without a directive
            self._disconnect()
            return self._no_directive(step, exc)

    answers_later = True
    background = True

    def decide_later(self, packet: bytes, step: int, expect: int | None = None) -> None:
        if self._later is not None:
            self.verdict(wait=True)  # one question on the connection at a time: its answer first
        frame: dict[str, Any] = {"op": "decide", "packets": self._take() + [packet], "step": step,
                                 "timeout": self.decision_timeout_s}
        if expect is not None:
            frame["expect"] = expect
        written = self._write(frame)
        self._later = (step, None if written else Directive.no_directive(step, "relay unreachable"))
        self._asked_on = self.sock  # the answer comes on this connection or not at all

    def verdict(self, wait: bool) -> Directive | None:
        if self._later is None:
            return None
        step, known = self._later
        if known is None:
            if self.sock is None or self.sock is not self._asked_on:
                known = self._no_directive(step, "the relay connection closed before the answer")
            else:
                if not wait:
                    # the answer's first byte is here: the relay writes a frame whole, read it now
                    ready, _, _ = select.select([self.sock], [], [], 0)
                    if not ready:
                        return None
                try:
                    known = Directive.decode(self._reply()["directive"])
                except Exception as exc:  # a dead relay or a bad answer: the rank goes on without a directive
                    self._disconnect()
                    known = self._no_directive(step, exc)
        self._later = None
        return known

    def close(self) -> None:
        if self._later is not None:
            self.verdict(wait=True)  # a verdict asked for is read before the connection goes
        super().close()
        self._disconnect()
        self._drop_leases()

    def _disconnect(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None


class ActorChannel(Channel):
    """Calls the aggregator actor (`ingest` / `decide`) through its Ray handle."""

    def __init__(self, handle: Any, decision_timeout_s: float = MonitorConfig.decision_timeout_s):
        super().__init__(decision_timeout_s)
        self.handle = handle

    @staticmethod
    def connect(settings: RankSettings) -> ActorChannel:
        import ray

        if not ray.is_initialized():
            # a rank started outside Ray (msrun) joins the run's cluster as a driver
            ray.init(address=settings.ray_address or "auto", namespace=settings.namespace,
                     log_to_driver=False, logging_level=logging.WARNING)
        handle = ray.get_actor(settings.aggregator, namespace=settings.namespace)
        return ActorChannel(handle, settings.monitor.decision_timeout_s)

    def _ship(self, batch: list[bytes], step: int | None = None) -> None:
        try:
            self.handle.ingest.remote(batch)
        except Exception as exc:  # the aggregator is gone: training goes on
            self._failed()
            log.warning("could not ship %d packets to the aggregator: %s", len(batch), exc)

    def _decide(self, batch: list[bytes], step: int, expect: int | None) -> Directive:
        import ray

        try:
            ref = self.handle.decide.remote(batch, step, self.decision_timeout_s)
            return Directive.decode(ray.get(ref, timeout=self.decision_timeout_s + 10))
        except Exception as exc:  # the aggregator is gone or late: the rank goes on without a directive
            return self._no_directive(step, exc)

    def _fetch_lease(self, need: int) -> tuple[Lease | None, float]:
        import ray

        t0 = time.monotonic()
        try:
            ref = self.handle.lease.remote(need - 1, self.decision_timeout_s)
            lease = Lease.decode(ray.get(ref, timeout=self.decision_timeout_s + 10))
            self._answered()
            return lease, time.monotonic() - t0
        except Exception as exc:  # the aggregator is gone or late: the rank goes on without a lease
            return self._no_lease(need, exc)


def connect(settings: RankSettings, rank: int) -> Channel:
    """This rank's channel: its node's relay when the run has one, else the aggregator."""
    relay = settings.relay_of(rank)
    if relay:
        host, _, port = relay.rpartition(":")
        return RelayChannel(host, int(port), settings.monitor.decision_timeout_s, token=settings.relay_token)
    return ActorChannel.connect(settings)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("relay closed the connection")
        buf.extend(chunk)
    return bytes(buf)
