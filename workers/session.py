"""One rank's monitoring session, under the `Monitor` callback (or a hand-written loop).

Per step it builds a `StepPacket` (loss, the learning rate of the step, grad norms,
NaN/Inf counts, step time, samples, user metrics and evaluation results, and every
`collect_freq` steps a parameter fingerprint and rank 0's layer statistics) and ships it
through the rank's channel. At the schedule's decision steps it waits for the directive,
so that every rank stops after the same step, and rank 0 writes the checkpoint the
directive asks for. It owns the rank's parts: the channel, the heartbeat, the fault
injector, the profiler window, the weight statistics and the checkpoint writer.

Outside a launch (no settings: a user script run by hand) it has no channel: it logs
each step and never blocks.

**The channel**, the rank's one way out: a `Channel` ships packets and fetches directives.

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
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mindpulse.config import RunConfig, monitor_settings_of, schedule_of
from mindpulse.lease_board import LeaseView
from mindpulse.protocol import (
    FRAME_HEADER_BYTES,
    MAX_FRAME,
    Action,
    CheckpointKind,
    Directive,
    EventKind,
    EventPacket,
    FrameReader,
    Lease,
    RankSettings,
    RankState,
    Schedule,
    StepPacket,
    decode_frame_body,
    encode_frame,
    frame_length,
)

from .checkpoint_writer import CheckpointWriter
from .faults import FaultInjector, faults_for
from .fingerprint import HostViews, fingerprint_of, param_sums
from .flops import achieved_tflops, params_flops_per_token, trainable_parameters
from .heartbeat import BUSY_EVALUATING, BUSY_SAVING, Heartbeat
from .model_params import model_parameters
from .profiler import ProfileWindow
from .settings import rank_id
from .weight_stats import DEFAULT_HIST_REGEX, WeightStats, structure_text

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

    def __init__(self, decision_timeout_s: float = 120.0):
        self.decision_timeout_s = decision_timeout_s
        self.failures = 0
        """Batches or decisions that did not get through (the rank went on regardless)."""
        self._buffer: list[bytes] = []
        self._last_flush = time.monotonic()
        self._lease: Lease | None = None
        self.lost_since: float | None = None
        """When the peer stopped answering (None while it answers)."""

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

    def _no_directive(self, step: int, why: Any) -> Directive:
        self.failures += 1
        log.warning("no directive for step %d (%s); continuing", step, why)
        return Directive.no_directive(step, str(why))

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
        self.failures += 1
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
    """Frames (protocol's `encode_frame`) to the node agent's relay on this machine.

    Packets and decisions go on one connection. Leases are read from the node's lease
    board (mindpulse/lease_board.py: shared memory the agent writes each new lease to), so
    taking the lease before a step is a read of mapped memory: no socket, no round trip.
    A second connection asks the relay for leases only at the first lease (the answer
    names the board) and when the board's lease does not let this rank start its next
    step; the rank then blocks until the relay answers. Without a board (no shared memory
    on the node) every lease is asked for there."""

    def __init__(self, host: str, port: int, decision_timeout_s: float = 120.0, token: str = ""):
        super().__init__(decision_timeout_s)
        self.addr = (host, port)
        self.token = token
        self.sock: socket.socket | None = None
        self.lease_sock: socket.socket | None = None
        self._lease_reader = FrameReader()
        self.board: LeaseView | None = None
        self._greeted = False
        """The relay answered this connection's first lease question (and named its board)."""
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
            self.failures += 1
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
            self.failures += 1
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
        except Exception as exc:
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
        except Exception as exc:
            self._disconnect()
            return self._no_directive(step, exc)

    def close(self) -> None:
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

    def __init__(self, handle: Any, decision_timeout_s: float = 120.0):
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
            self.failures += 1
            log.warning("could not ship %d packets to the aggregator: %s", len(batch), exc)

    def _decide(self, batch: list[bytes], step: int, expect: int | None) -> Directive:
        import ray

        try:
            ref = self.handle.decide.remote(batch, step, self.decision_timeout_s)
            return Directive.decode(ray.get(ref, timeout=self.decision_timeout_s + 10))
        except Exception as exc:
            return self._no_directive(step, exc)

    def _fetch_lease(self, need: int) -> tuple[Lease | None, float]:
        import ray

        t0 = time.monotonic()
        try:
            ref = self.handle.lease.remote(need - 1, self.decision_timeout_s)
            lease = Lease.decode(ray.get(ref, timeout=self.decision_timeout_s + 10))
            self._answered()
            return lease, time.monotonic() - t0
        except Exception as exc:
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



# Outside a launch (a script run by hand, a benchmark): the config's defaults, so a script
# collects, decides and reports weights the same by hand as launched with a default config.
UNLAUNCHED_SCHEDULE = schedule_of(RunConfig())
UNLAUNCHED_MONITOR = monitor_settings_of(RunConfig())  # its heartbeat interval is unused: no heartbeat runs

EVENT_MESSAGE_CHARS = 4000
REPORTED_ERRORS = 20
"""Monitor errors per rank reported one by one (the rest are counted)."""


def as_number(x: Any) -> float | None:
    """A Python float from a number, a numpy scalar or a MindSpore tensor of one element
    (the functional `value_and_grad` style hands the loss over as a Tensor)."""
    if x is None:
        return None
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if hasattr(x, "asnumpy"):  # a MindSpore tensor
        x = x.asnumpy()
    if hasattr(x, "reshape") and getattr(x, "size", 1) == 1:  # numpy array or scalar of one value
        return float(x.reshape(-1)[0])
    return float(x)


def as_count(x: Any) -> int:
    v = as_number(x)
    return int(v) if v is not None and v == v and abs(v) != float("inf") else 0
STRUCTURE_MESSAGE_CHARS = 60000


@dataclass
class StepOutcome:
    """What recording a step tells the loop."""

    step: int
    stop: bool
    reason: str = ""


def schedule_with(base: Schedule, *, collect_freq: int | None = None, max_lag_steps: int | None = None,
                  total_steps: int | None = None, eval_every: int | None = None,
                  eval_per_epoch: bool | None = None) -> Schedule:
    """`base` with a script's explicit overrides (None keeps the run's value; a collect
    period of 0 too: every step modulo 0 is no schedule)."""
    changes: dict[str, Any] = {}
    if collect_freq:
        changes["collect_freq"] = collect_freq
    if max_lag_steps is not None:
        changes["max_lag_steps"] = max_lag_steps
    if total_steps is not None:
        changes["total_steps"] = total_steps
    if eval_every is not None:
        changes["eval_every"] = eval_every
    if eval_per_epoch is not None:
        changes["eval_per_epoch"] = eval_per_epoch
    return dataclasses.replace(base, **changes)


@dataclasses.dataclass
class SincePacket:
    """Seconds a rank spent outside its steps since its last step packet, by cause; the next
    packet carries them (goodput badput) and they start again from zero."""

    monitor_wait_s: float = 0.0
    """Blocked on the aggregator (a verdict, a lease)."""
    checkpoint_s: float = 0.0
    """Writing checkpoints."""
    profile_s: float = 0.0
    """Starting and stopping the profiler."""
    monitor_self_s: float = 0.0
    """In mindpulse's own code (the callback, the step's packet, the channel), the above and
    evaluation left out: what watching costs the rank (`RankSession.record`)."""

    def outside(self) -> float:
        """The seconds so far that are not mindpulse's own work (waits, checkpoints, profiler)."""
        return self.monitor_wait_s + self.checkpoint_s + self.profile_s

    def take(self) -> dict[str, float]:
        """The seconds by `StepPacket` field, reset to zero."""
        out = dict(vars(self))
        for name in out:
            setattr(self, name, 0.0)
        return out


_created = 0
"""RankSessions (Monitors) created in this process: a script that trains without one is
named at once (workers/auto_attach.py)."""


def sessions_created() -> int:
    return _created


class RankSession:
    """Args:
        settings: the run's settings (None outside a launch).
        rank: this rank (default: MindSpore's RANK_ID).
        channel: where packets go (default: the settings' relay or aggregator; none outside a launch).
        schedule: the special steps (default: the settings').
        batch_size: samples per step on this rank (default: the settings' `train.batch_size`).
        step_offset: the global step this run starts after (default: the settings' resume point).
        evaluate: returns this rank's validation metrics at the schedule's evaluation steps.
        epoch_steps: steps per epoch (for evaluation at epoch ends).
        network / train_cell: what is fingerprinted / what rank 0 checkpoints.
    """

    def __init__(
        self,
        settings: RankSettings | None,
        *,
        rank: int | None = None,
        channel: Channel | None = None,
        schedule: Schedule | None = None,
        batch_size: int | None = None,
        step_offset: int | None = None,
        evaluate: Callable[[], dict[str, float]] | None = None,
        epoch_steps: int | None = None,
        network: Any = None,
        train_cell: Any = None,
        metrics: list[str] | None = None,
        tokens_per_step: int | None = None,
        flops_per_token: float | None = None,
    ):
        global _created
        _created += 1
        self.settings = settings
        declared = list(metrics or [])
        if settings is not None:
            declared += list((settings.config.get("eval") or {}).get("metrics") or [])
        self.metrics = frozenset(declared) if metrics is not None else None
        """Metric names the script declared (`Monitor(metrics=[...])`, plus `eval.metrics`): an
        evaluation that reports another name is a monitor error (its rule or best-checkpoint
        judgement would silently never see it)."""
        self.rank = rank if rank is not None else rank_id()
        self.schedule = schedule or (settings.schedule if settings else UNLAUNCHED_SCHEDULE)
        self.monitor_settings = settings.monitor if settings else UNLAUNCHED_MONITOR
        self.batch_size = batch_size or (settings.batch_size if settings else None) or None
        if step_offset is None:
            step_offset = settings.resume.step if settings and settings.resume else 0
        self.step_offset = step_offset
        self.evaluate = evaluate
        self.epoch_steps = epoch_steps
        self.network = network
        self.train_cell = train_cell
        if channel is None and settings is not None:
            channel = connect(settings, self.rank)
        self.channel = channel
        self.step = step_offset
        """The last step recorded (the offset before the first)."""
        self.injector = FaultInjector(self.rank, faults_for(self.rank, settings.faults if settings else ()))
        self.checkpoints = (CheckpointWriter.for_run(settings, self.send_event, self.injector.before_save)
                            if settings is not None and self.rank == 0 else None)
        self.profile = ProfileWindow.for_rank(settings, self.rank)
        self.in_step: int | None = None
        """The step the loop is inside: its faults let it start, it has not ended (the
        heartbeat says so: a rank blocked before a step that the others are inside is the
        one they wait for)."""
        self.busy: RankState | None = None
        """What the rank does outside its steps right now: `saving` (a checkpoint) or `evaluating`
        (the heartbeat says so: that time is not a hang)."""
        self.heartbeat = Heartbeat(settings, self.rank, lambda: self.step, lambda: self.in_step,
                                   connect=lambda: connect(settings, self.rank),
                                   busy=lambda: self.busy) if settings else None
        self.weight_stats: WeightStats | None = None
        self._last_sums: Any = None
        self._params: tuple[Any, list, HostViews] | None = None
        """(network, its parameters, their host views) as last listed (`_listed`)."""
        self.started = False
        self.finished = False
        self.stopped: Directive | None = None
        """The directive that stopped every rank (None while training goes on)."""
        self.since_packet = SincePacket()
        self._self_from = (time.perf_counter(), 0.0)
        """Where `monitor_self_s`'s clock runs from: (perf_counter, `since_packet.outside()` then)."""
        """Seconds spent outside the steps since the last step packet (it carries them)."""
        self.errors = 0
        """Errors inside the monitor on this rank (logged and counted; training went on)."""
        self.overflow_steps = 0
        """Steps this rank's loss-scale cell skipped for overflow (every packet carries it)."""
        self.on_directive: Callable[[Directive], None] | None = None
        self.tokens_per_step = tokens_per_step
        """Tokens this rank trains on per step (None: not known, no TFLOPS reported)."""
        self.flops_per_token = flops_per_token
        """Model FLOPs per token (None: 6 x the network's trainable parameters, once it is known)."""

    # ---- life cycle ------------------------------------------------------------------------
    def start(self, network: Any = None, train_cell: Any = None, arm_next: bool = True) -> None:
        """Announce the rank and ship the fingerprint of the weights before any update."""
        if train_cell is not None:
            self.train_cell = train_cell
        if self.started:
            return
        self.started = True
        if network is not None and self.network is None:
            self.network = network
        self.injector.bind(self.train_cell, self.network)
        self.send_event(EventKind.START)
        self._watch_layers()
        if self.heartbeat is not None:
            self.heartbeat.start()
        if self.step_offset == 0:
            self.injector.before_step(0)  # desync@R:0 perturbs the weights before step 0's fingerprint
        fp, norm = self._fingerprint()
        self._ship(StepPacket(rank=self.rank, step=self.step_offset, ts=time.time(), fingerprint=fp,
                              param_norm=norm))
        if arm_next:  # faults and the profiler of the first step (a hand loop's)
            self.before_step(self.step_offset + 1)

    def finish(self, message: str = "") -> None:
        if self.finished:  # once: its END and the channel's close
            return
        self.finished = True
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.profile is not None:
            self.profile.end(self.step, force=True)
        if self.channel is not None:
            self.channel.flush()
        self.send_event(EventKind.END, message)
        if self.channel is not None:
            self.channel.close()  # now, not when the garbage collector gets to the session

    def before_step(self, step: int) -> float:
        """Around the loop's steps: faults of `step`, and the profiler window's start.
        Returns the seconds the profiler took (goodput: not the data path's)."""
        self.injector.before_step(step)
        self.in_step = step  # after its faults: a rank held there (a hang) is not inside the step
        return self._profiled(self.profile.begin, step) if self.profile is not None else 0.0

    def after_step(self, step: int) -> None:
        self.in_step = None
        self.injector.after_step(step)
        if self.profile is not None:
            self._profiled(self.profile.end, step)

    def _profiled(self, call: Any, step: int) -> float:
        t = time.perf_counter()
        call(step)
        spent = time.perf_counter() - t
        self.since_packet.profile_s += spent
        return spent

    # ---- one step --------------------------------------------------------------------------
    def record(self, loss: Any, *, step: int | None = None, since: float | None = None, **fields: Any) -> StepOutcome:
        """Ship one finished step (the next one unless `step` is given); returns whether to
        stop. Numbers may be Python numbers, numpy scalars or MindSpore tensors. An error
        inside the monitor is logged and counted, never raised into the training loop: only
        a stop ends training. `since`: the `time.perf_counter()` at which mindpulse's code took
        over from the training for this step (a callback's entry), for `monitor_self_s`."""
        self._self_from = (time.perf_counter() if since is None else since, self.since_packet.outside())
        try:
            return self._record(loss, step=step, **fields)
        except Exception as exc:
            self.monitor_error(f"recording step {self.step}", exc)
            return self._outcome(self.step)
        finally:
            self._count_self_time()

    def _count_self_time(self, excluded: float = 0.0) -> float:
        """Add the time in mindpulse's code since `_self_from` (less what was waits, checkpoints,
        the profiler, and `excluded`: evaluation) to `monitor_self_s`; the clock starts again. What
        is counted after a packet was built (its encoding and sending, the lease) goes in the next."""
        t, outside = self._self_from
        now = time.perf_counter()
        spent = max(0.0, now - t - excluded - (self.since_packet.outside() - outside))
        self.since_packet.monitor_self_s += spent
        self._self_from = (now, self.since_packet.outside())
        return spent

    def _record(
        self,
        loss: Any,
        *,
        step: int | None = None,
        epoch: int = 0,
        lr: float | None = None,
        grad_norm: float | None = None,
        grad_norm_local: float | None = None,
        nan_count: int = 0,
        inf_count: int = 0,
        step_time_s: float | None = None,
        samples: int | None = None,
        extra: dict[str, float] | None = None,
        data_wait_s: float | None = None,
        compute_s: float | None = None,
        tokens: int | None = None,
        loss_scale: float | None = None,
        overflow: bool | None = None,
    ) -> StepOutcome:
        self.step = s = step if step is not None else self.step + 1
        if overflow:
            self.overflow_steps += 1
        fp = norm = None
        weights: dict[str, Any] = {}
        if self.schedule.is_collect(s):
            fp, norm = self._fingerprint()
            if self.weight_stats is not None:
                try:
                    weights = self.weight_stats.collect(self._last_sums)
                except Exception as exc:
                    log.warning("[rank %d] weight statistics failed at step %d: %s", self.rank, s, exc)
        evaluates = self.evaluate is not None
        # rank 0 waits for the verdict on a checkpoint candidate (the checkpoint must hold
        # exactly this step's weights); nobody else ever waits for a directive
        decision = self.rank == 0 and self.schedule.is_candidate(s, evaluates, self.epoch_steps)
        eval_s = 0.0
        if evaluates and self.schedule.eval_due(s, self.epoch_steps):
            t_eval = time.perf_counter()
            self.busy = BUSY_EVALUATING
            try:
                results = self.evaluate()
                undeclared = sorted(set(results) - self.metrics) if self.metrics is not None else []
                if undeclared:
                    self.monitor_error(f"evaluating at step {s}", ValueError(
                        f"evaluate() reported {undeclared}, not among the declared metrics {sorted(self.metrics)}; "
                        "add them to Monitor(metrics=[...]) and eval.metrics"))
                extra = dict(extra or {}, **results)
            except Exception as exc:
                log.error("[rank %d] evaluation at step %d failed: %s", self.rank, s, exc)
            finally:
                self.busy = None
            eval_s = time.perf_counter() - t_eval
        self._count_self_time(excluded=eval_s)
        pkt = StepPacket(
            rank=self.rank,
            step=s,
            epoch=epoch,
            loss=as_number(loss),
            lr=as_number(lr),
            grad_norm=as_number(grad_norm),
            grad_norm_local=as_number(grad_norm_local),
            nan_count=as_count(nan_count),
            inf_count=as_count(inf_count),
            step_time_s=as_number(step_time_s),
            data_wait_s=as_number(data_wait_s),
            compute_s=as_number(compute_s),
            samples=as_count(samples or self.batch_size or 0),
            tokens=(tok := as_count(tokens if tokens is not None else self.tokens_per_step or 0)),
            tflops=self._tflops(tok, step_time_s, data_wait_s, compute_s),
            ts=time.time(),
            fingerprint=fp,
            param_norm=norm,
            decision=bool(decision),
            eval_s=eval_s,
            extra={str(k): float(as_number(v)) for k, v in (extra or {}).items() if as_number(v) is not None},
            monitor_errors=self.errors,
            weights=weights,
            loss_scale=as_number(loss_scale),
            overflow=None if overflow is None else bool(overflow),
            overflow_steps=self.overflow_steps,
            **self.since_packet.take(),
        )
        self._self_from = (self._self_from[0], 0.0)  # the packet took the seconds so far
        self._ship(pkt)
        if self.weight_stats is not None and self.schedule.is_collect(s + 1):
            try:
                self.weight_stats.keep_previous()  # the next step is a collect step: measure its change
            except Exception as exc:
                log.warning("[rank %d] cannot keep the weights for the update ratio: %s", self.rank, exc)
        return self._outcome(s)

    def _tflops(self, tokens: int, step_time_s: Any, data_wait_s: Any, compute_s: Any) -> float | None:
        """This rank's achieved TFLOPS: over its own time of the step, its data wait plus its
        compute up to the gradient all-reduce where measured (a slow card or data path shows
        as its own drop, not as everyone's wait in the collective), else its step time plus
        data wait."""
        if not tokens:
            return None
        if self.flops_per_token is None and self.network is not None:
            try:  # once: 6 x the trainable parameters ("6N")
                self.flops_per_token = params_flops_per_token(trainable_parameters(self.network))
            except Exception as exc:
                self.flops_per_token = 0
                log.warning("[rank %d] cannot count the model's parameters for its FLOPs: %s", self.rank, exc)
        wait, comp = as_number(data_wait_s) or 0.0, as_number(compute_s)
        own = comp if comp is not None else as_number(step_time_s)
        busy = max(wait, 0.0) + own if own else None
        return achieved_tflops(tokens, self.flops_per_token or 0, busy)

    def _outcome(self, s: int) -> StepOutcome:
        if self.stopped is not None:
            return StepOutcome(step=s, stop=True, reason=self.stopped.reason)
        total = self.schedule.total_steps
        if total and s >= total:
            return StepOutcome(step=s, stop=True, reason=f"reached train.steps={total}")
        return StepOutcome(step=s, stop=False)

    def monitor_error(self, where: str, exc: BaseException) -> None:
        """An error inside the monitor: logged, counted (every step packet carries the count
        to summary.json), the first few reported to the aggregator; training goes on."""
        self.errors += 1
        if self.errors <= REPORTED_ERRORS:
            log.warning("[rank %d] monitor error while %s (training goes on): %s: %s", self.rank, where,
                        type(exc).__name__, exc, exc_info=self.errors <= 3)
            try:
                self.send_event(EventKind.MONITOR_ERROR, f"{where}: {type(exc).__name__}: {exc}")
            except Exception:
                pass

    # ---- shipping and directives -----------------------------------------------------------
    def send_event(self, kind: EventKind, message: str = "") -> None:
        if self.channel is None:
            return
        pkt = EventPacket(rank=self.rank, kind=kind.value, ts=time.time(), step=self.step, pid=os.getpid(),
                          host=socket.gethostname(), message=message[:EVENT_MESSAGE_CHARS])
        self.channel.send(pkt.encode())
        self.channel.flush()

    def _ship(self, pkt: StepPacket) -> None:
        """Ship a step, then make sure the next one may start (the lease)."""
        if self.channel is None:
            log.info("[rank %d] step %d loss %s", self.rank, pkt.step, pkt.loss)
            return
        if pkt.decision:
            t0 = time.monotonic()
            d = self.channel.decide(pkt.encode(), pkt.step, expect=1)
            self.since_packet.monitor_wait_s += time.monotonic() - t0
            self._follow(d, pkt)
        else:
            self.channel.send_step(pkt.encode(), pkt.step)
        if self.stopped is None:
            self._check_lease(pkt)

    def _check_lease(self, pkt: StepPacket) -> None:
        """Before the step after `pkt`: every rank may run `max_lag_steps` steps ahead of the
        aggregator and stops after the step a stop names (the same on every rank)."""
        assert self.channel is not None
        need = self.schedule.lease_need(pkt.step)
        if need < self.step_offset:
            return  # steps before this attempt's first are never reduced by its aggregator
        lease, waited = self.channel.lease(need)
        self.since_packet.monitor_wait_s += waited
        if lease is None:
            lost = self.channel.lost_for()
            if lost > self.monitor_settings.decision_timeout_s:
                # the node's relay (and with it every decision) is gone: training on unwatched
                # could leave this rank alone in a collective, or outlive its run
                self._follow(Directive(step=pkt.step, action=Action.STOP,
                                       reason=f"no relay for {lost:.0f}s (monitor.decision_timeout_s)"), pkt)
            return
        if lease.stopping and pkt.step >= lease.stop_after:
            d = Directive(step=pkt.step, action=Action.STOP, reason=lease.reason,
                          saves=frozenset({CheckpointKind.LAST}) if lease.save_last else frozenset())
            self._follow(d, pkt)
        elif not lease.allows(pkt.step + 1, self.schedule.max_lag_steps):
            log.warning("[rank %d] no lease for step %d after %.0fs (aggregator at step %d); continuing",
                        self.rank, pkt.step + 1, waited, lease.reduced_through)

    def _follow(self, d: Directive, pkt: StepPacket) -> None:
        if d.save_kinds and self.rank == 0:
            t_save = time.perf_counter()
            self.busy = BUSY_SAVING
            try:
                self._save(d, pkt)
            finally:
                self.busy = None
                self.since_packet.checkpoint_s += time.perf_counter() - t_save
        if d.action.stops:
            self.stopped = d
        if self.on_directive:
            self.on_directive(d)

    def _save(self, d: Directive, pkt: StepPacket) -> None:
        if self.checkpoints is None or self.train_cell is None:
            log.warning("[rank 0] asked to save %s at step %d but no checkpoint folder or train cell is known",
                        d.save, pkt.step)
            return
        self.checkpoints.write(d, pkt.step, pkt.epoch, self.train_cell)

    # ---- what the packets carry about the weights --------------------------------------------
    def _listed(self) -> tuple[list, HostViews]:
        """The network's parameters (the same tensors every step) and one set of host views
        of them, shared by the fingerprint and the weight statistics; listed again for a new
        network."""
        if self._params is None or self._params[0] is not self.network:
            params = model_parameters(self.network)
            self._params = (self.network, params, HostViews(params))
        return self._params[1], self._params[2]

    def _fingerprint(self) -> tuple[str | None, float | None]:
        if self.network is None:
            return None, None
        try:
            params, views = self._listed()
            self._last_sums = param_sums(params, views=views)
            return fingerprint_of(self._last_sums)
        except Exception as exc:
            log.warning("[rank %d] fingerprint failed: %s", self.rank, exc)
            self._last_sums = None
            return None, None

    def _watch_layers(self) -> None:
        """Per-layer statistics every collect_freq steps (rank 0 ships them: data-parallel
        weights are identical), and the model's structure once."""
        self.weight_stats = None
        if self.rank != 0 or self.network is None or not self.monitor_settings.weight_stats:
            return
        try:
            params, views = self._listed()
            self.weight_stats = WeightStats(params, self.monitor_settings.histogram_regex or DEFAULT_HIST_REGEX,
                                            self.train_cell, views=views)
            text = structure_text(params)
            if self.channel is not None:
                pkt = EventPacket(rank=self.rank, kind=EventKind.STRUCTURE.value, ts=time.time(),
                                  message=text[:STRUCTURE_MESSAGE_CHARS])
                self.channel.send(pkt.encode())
        except Exception as exc:
            log.warning("[rank %d] weight statistics are off: %s", self.rank, exc)
            self.weight_stats = None
