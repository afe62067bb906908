"""Per-node packet relay: the node's ranks talk to their NodeAgent over loopback, the
agent sends the aggregator one batch per step over its uplink (mindpulse/wire/uplink.py), so
the aggregator's load grows with nodes, not ranks.

Wire: the relay frames (mindpulse/wire/frames.py), a 4-byte big-endian length and a msgpack map
(no pickle):
  {"op": "send", "packets": [bytes, ...], "step": s?}            no answer
  {"op": "decide", "packets": [...], "step": s, "timeout": t, "expect": n?}
                                                                 answer {"directive": bytes}
  {"op": "lease", "need": n?}                                    answered with {"lease": bytes | None,
                                                                 "board": path | None} once the lease
                                                                 covers step n (at once without n;
                                                                 lease None: no lease service)
A `send` that carries a rank's packet of step s says so; once every rank of the node has
sent step s, the batch goes out at once (the aggregator reduces a step as soon as every
node's part is in). Leases come down to the node (pushed over its uplink) and are written
once to the node's lease board (mindpulse/wire/lease_board.py), a shared-memory page every rank
of the node reads before each step: nothing is sent per rank and step. A rank asks the
relay only at its first lease (the answer names the board) and when the board's lease
does not yet let it start its next step; it then blocks until the answer. At a
decision step the relay groups the decide calls of the `expect` ranks that make one
(rank 0 alone at a checkpoint candidate) into one aggregator call.
The server listens on 127.0.0.1 only: ranks are on the agent's own machine. The rank's
side is `mindpulse.workers.channel.RelayChannel`.

**Pre-reduction on the node**: the agent validates its ranks' packets once and reduces each
step into one node partial, so the aggregator's work per step follows nodes, not ranks.
A rank's packet of a step is held, undecoded, until every rank of the node has sent its
part (or the flush timer, or the decision that needs it, comes first); the step is then
decoded and reduced in one go: on the machine that trains, a wake-up between the ranks'
frames starts cold, so the same work done frame by frame costs more CPU than done at once
(docs/benchmarks.md, "Investigations": "What a step costs the node agent").

What goes up in one call (`NodeBatch`): the raw bytes of the step packets (appended to
`metrics.msgpack` as they are: validated here, never decoded again), the other packets
(events: the aggregator handles them one by one), the partials of the steps every rank of
this node has reported, and counts of what was refused here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from mindpulse.config import MonitorConfig
from mindpulse.config.settings import COMPUTE_DROP_WINDOW
from mindpulse.reduction.baselines import NodeComputeDrops, NodeStragglers
from mindpulse.reduction.partial import collect_ranks, partial_of, to_wire
from mindpulse.wire.directives import Directive, Lease
from mindpulse.wire.frames import MAX_FRAME, FrameReader, decode_frame_body, encode_frame, frame_int, frame_timeout
from mindpulse.wire.lease_board import MAX_BODY as MAX_BOARD_LEASE
from mindpulse.wire.lease_board import LeaseBoard
from mindpulse.wire.protocol import EventKind, EventPacket, PacketError, StepPacket, decode_wire, heartbeat_row

NodeBatch = dict[str, Any]
"""{"steps": [bytes], "other": [bytes], "beats": [heartbeat row], "partials": [wire partial],
"rejected": {reason: n}}; a group leader's (node/group.py) also "steps_n": its steps are then
one bytes, the packets back to back. "beats": the node's ranks' heartbeats as one record
(`protocol.heartbeat_row`: a row per rank, no packet of their own), so the aggregator takes
them in one pass; liveness only, they are not kept in `metrics.msgpack`."""

MAX_PENDING_STEPS = 256
"""Incomplete steps held per node; older ones are dropped (a rank that never reports)."""


def empty_batch() -> NodeBatch:
    return {"steps": [], "other": [], "beats": [], "partials": [], "rejected": {}}


class NodePreReducer:
    """One node's steps: `add(raw)` files a packet; complete steps come out as partials."""

    def __init__(self, node: int, ranks: range, straggler_window: int = MonitorConfig.straggler_window,
                 collect_freq: int = MonitorConfig.collect_freq, world_size: int | None = None,
                 compute_window: int = COMPUTE_DROP_WINDOW):
        """`world_size`: which of this node's ranks a collect step keeps whole follows from
        it (`collect_ranks`); None keeps every rank of the node whole at a collect step."""
        self.node = node
        self.ranks = ranks
        self.world_size = world_size
        self.collect_freq = max(1, collect_freq)
        self.stragglers = NodeStragglers(straggler_window)
        self.compute_drops = NodeComputeDrops(compute_window)
        self._pending: OrderedDict[int, dict[int, StepPacket]] = OrderedDict()
        self._wires: dict[int, dict[int, dict[str, Any]]] = {}
        self._done_through = -1
        self.batch = empty_batch()
        self.rejected: Counter[str] = Counter()
        self.evicted = 0

    def add(self, raw: bytes) -> bool:
        """File one encoded packet; True when it completed a step (a partial is ready)."""
        try:
            pkt, wire = decode_wire(raw)
        except PacketError as exc:
            self._reject(exc.reason)
            return False
        if not isinstance(pkt, StepPacket):
            if type(pkt) is EventPacket and pkt.kind == EventKind.HEARTBEAT and pkt.rank in self.ranks:
                self.batch["beats"].append(heartbeat_row(pkt))  # the node's record of its ranks' beats
            else:
                self.batch["other"].append(bytes(raw))
            return False
        if pkt.rank not in self.ranks:
            self._reject("rank_not_on_node")
            return False
        bucket = self._pending.get(pkt.step)
        if bucket is None:
            if pkt.step <= self._done_through and pkt.step not in self._pending:
                self._reject("late_or_duplicate")
                return False
            bucket = self._pending[pkt.step] = {}
        if pkt.rank in bucket:
            self._reject("duplicate")
            return False
        bucket[pkt.rank] = pkt
        self._wires.setdefault(pkt.step, {})[pkt.rank] = wire
        self.batch["steps"].append(bytes(raw))
        if len(bucket) < len(self.ranks):
            while len(self._pending) > MAX_PENDING_STEPS:
                old, _ = self._pending.popitem(last=False)
                self._wires.pop(old, None)
                self.evicted += 1
            return False
        del self._pending[pkt.step]
        wires = self._wires.pop(pkt.step, {})
        self._done_through = max(self._done_through, pkt.step)
        self.batch["partials"].append(self._partial(pkt.step, bucket, wires))
        return True

    def _partial(self, step: int, packets: dict[int, StepPacket], wires: dict[int, dict]) -> dict[str, Any]:
        # a collect step keeps whole the packets of its window of ranks (per-rank TensorBoard
        # detail; every rank of a world up to RANKS_PER_COLLECT); every step keeps the
        # extremes, the non-finite ranks and the weight statistics
        collect = collect_ranks(step, self.world_size, self.collect_freq) if self.world_size is not None else (
            self.ranks if step % self.collect_freq == 0 else ())
        part = partial_of(step, packets, wires=wires, collect=collect)
        part.stragglers = [x] if (x := self.stragglers.update(step, packets)) else []
        part.compute_drops = self.compute_drops.update(step, packets)  # only the ranks whose TFLOPS fell
        return to_wire(part)

    def _reject(self, reason: str) -> None:
        self.rejected[reason] += 1
        self.batch["rejected"][reason] = self.batch["rejected"].get(reason, 0) + 1

    def take(self) -> NodeBatch:
        """What is ready to go up (and a fresh batch for what comes next)."""
        batch, self.batch = self.batch, empty_batch()
        return batch

    def has_data(self) -> bool:
        return any(self.batch[k] for k in ("steps", "other", "beats", "partials", "rejected"))


def batch_size(batch: NodeBatch) -> int:
    return len(batch["steps"]) + len(batch["other"]) + len(batch.get("beats") or ())


log = logging.getLogger(__name__)

FLUSH_S = 0.05
FLUSH_PACKETS = 256
GROUP_WAIT_S = 0.02
_KEEP_STEP_COUNTS = 64


class RelayServer:
    """Runs an asyncio loop in a daemon thread. `forward_send(batch)` is called in that
    loop with batches of packets (fire-and-forget: it must not block);
    `forward_decide(batch, step, timeout)`, a coroutine function run in the loop, returns
    the directive bytes. With `pushed_leases` the owner hands each new lease to
    `set_lease` (in the loop, as the node's uplink does) and the relay writes it to the
    node's lease board and answers the ranks waiting for it; without, no lease gates the
    ranks."""

    def __init__(self, forward_send: Callable[[Any], None],
                 forward_decide: Callable[[Any, int, float], Awaitable[bytes]], local_ranks: int,
                 host: str = "127.0.0.1", prereduce: NodePreReducer | None = None, token: str = "",
                 pushed_leases: bool = False):
        self.token = token
        """Set: a connection's first frame must be {"op": "hello", "token": token}."""
        self.prereduce = prereduce
        """Set: packets are validated and steps reduced here, and what goes up is a
        `NodeBatch` (see `NodePreReducer` above); unset: batches of raw packets."""
        self.forward_send = forward_send
        self.forward_decide = forward_decide
        self._lease = Lease()
        self._lease_raw: bytes | None = self._lease.encode() if pushed_leases else None
        self.board: LeaseBoard | None = None
        """The node's lease board, made when the relay starts (None: no lease service, or
        no shared memory: leases then go as answers)."""
        self._waiting: dict[_RankConnection, int] = {}
        """Ranks blocked on a lease: the step each waits to see reduced."""
        self._step_counts: dict[int, int] = {}
        self.local_ranks = max(1, local_ranks)
        self.host = host
        self.port = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._buffer: list[bytes] = []
        self._held: list[bytes] = []
        """Step packets not yet filed with the pre-reducer (see `_on_frame`)."""
        self._groups: dict[int, dict[str, Any]] = {}
        self._conns: set[_RankConnection] = set()
        self._flush_timer: asyncio.TimerHandle | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mindpulse-relay", daemon=True)
        self.stats = {"frames": 0, "packets": 0, "forward_calls": 0, "decide_calls": 0, "bad_frames": 0,
                      "forward_errors": 0, "lease_pushes": 0, "lease_answers": 0, "bad_packets": 0,
                      "refused_connections": 0, "bad_leases": 0}

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> int:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the packet relay did not start")
        return self.port

    def stop(self) -> None:
        if self.loop is None or not self._thread.is_alive():
            return
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop)
        try:
            fut.result(5)
        except Exception:  # best effort at stop: the loop's thread is joined just below
            pass
        self._thread.join(5)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _RankConnection(self), self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        self._stop = asyncio.Event()
        if self._lease_raw is not None:
            try:
                self.board = LeaseBoard()
                self._publish()
            except Exception as exc:  # the board is an optimisation: without it ranks ask the relay for each lease
                log.warning("relay: no shared-memory lease board (%s); ranks ask for each lease", exc)
        self._ready.set()
        await self._stop.wait()
        self._flush()
        self._server.close()
        for conn in list(self._conns):
            conn.close()
        self._drop_board()
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await loop.shutdown_default_executor()

    async def _shutdown(self) -> None:
        self._stop.set()

    # ---- traffic ---------------------------------------------------------------------------
    def _on_frame(self, conn: _RankConnection, msg: dict[str, Any]) -> None:
        """One frame from a rank (in the loop, as it is read)."""
        packets = [bytes(p) for p in msg.get("packets") or [] if isinstance(p, (bytes, bytearray))]
        self.stats["frames"] += 1
        self.stats["packets"] += len(packets)
        op = msg.get("op")
        if op == "decide":
            step, timeout = frame_int(msg.get("step"), 0), frame_timeout(msg.get("timeout"))
            expect = min(self.local_ranks, max(1, frame_int(msg.get("expect"), self.local_ranks)))
            if packets:  # this rank's part of the step: the held parts go up once all are in
                self._step_complete(step)
            conn.answer(self._decide(packets, step, timeout, expect))
        elif op == "lease":
            need = msg.get("need")
            self._waiting.pop(conn, None)  # a later question replaces an earlier one
            if self._lease_raw is None or need is None or self._lease.covers(frame_int(need, 0)):
                self._answer_lease(conn)
            else:
                self._waiting[conn] = frame_int(need, 0)
        else:
            step = msg.get("step")
            if self.prereduce is not None and type(step) is int and packets:
                # a rank's packet of `step`: held, undecoded, until every rank of the node
                # sent its part, then the step is decoded and reduced in one go. Measured on
                # a 2-core machine: the same work done frame by frame as the ranks' packets
                # trickle in costs ~1.4x as much CPU as done at once (each wake-up between
                # them starts cold)
                self._held.extend(packets)
                complete = False
            else:
                complete = self._file(packets)
            if complete or self._queued() >= FLUSH_PACKETS or self._step_complete(step):
                self._flush()
            elif self._flush_timer is None and self._has_data():
                # what a step's last rank did not complete goes up within FLUSH_S anyway
                self._flush_timer = asyncio.get_running_loop().call_later(FLUSH_S, self._flush)

    def authenticated(self, msg: dict[str, Any]) -> bool:
        """The first frame is the hello with this attempt's token (read from job.json, which
        only the run's user can read); anything else closes the connection."""
        import hmac

        token = msg.get("token")
        ok = msg.get("op") == "hello" and isinstance(token, str) and hmac.compare_digest(token, self.token)
        if not ok:
            self.stats["refused_connections"] += 1
            log.warning("relay: refused a connection without this run's token")
        return ok

    def _file(self, packets: list[bytes]) -> bool:
        """Queue packets for the next call up; True when one completed the node's part of a step."""
        if self.prereduce is None:
            self._buffer.extend(packets)
            return False
        complete = False
        for raw in packets:
            try:
                complete = self.prereduce.add(raw) or complete
            except Exception as exc:  # one packet the reduction cannot take costs only itself
                self.stats["bad_packets"] += 1
                log.warning("relay: a packet could not be reduced (%r); the node's others go on", exc)
        return complete

    def _file_held(self) -> None:
        if self._held:
            held, self._held = self._held, []
            self._file(held)

    def _queued(self) -> int:
        return len(self._buffer) if self.prereduce is None else batch_size(self.prereduce.batch) + len(self._held)

    def _has_data(self) -> bool:
        return bool(self._buffer) if self.prereduce is None else bool(self._held) or self.prereduce.has_data()

    def _take(self) -> Any:
        if self.prereduce is None:
            batch, self._buffer = self._buffer, []
            return batch
        self._file_held()
        return self.prereduce.take()

    async def flush(self) -> None:
        """Send what is queued now (in the relay's loop)."""
        self._flush()

    def _flush(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if not self._has_data():
            return
        batch = self._take()
        self.stats["forward_calls"] += 1
        try:
            self.forward_send(batch)
        except Exception as exc:  # a forward that failed must not kill the relay's loop: counted, logged
            self.stats["forward_errors"] += 1
            log.warning("relay could not forward a batch: %s", exc)

    def _step_complete(self, step: Any) -> bool:
        """Count a rank's packet of `step`; True once every rank of the node sent it."""
        if not isinstance(step, int) or isinstance(step, bool):
            return False
        n = self._step_counts[step] = self._step_counts.get(step, 0) + 1
        if n < self.local_ranks:
            while len(self._step_counts) > _KEEP_STEP_COUNTS:  # a rank that never sends its part
                del self._step_counts[min(self._step_counts)]
            return False
        del self._step_counts[step]
        return True

    # ---- leases ------------------------------------------------------------------------------
    def set_lease(self, raw: bytes) -> None:
        """A lease pushed down (call in the relay's loop); a malformed one is counted, not kept."""
        try:
            lease = Lease.decode(raw)
        except Exception:  # a malformed lease is counted and dropped, the old one stays
            self.stats["bad_leases"] += 1
            return
        self._new_lease(lease, raw)

    @property
    def lease(self) -> Lease:
        return self._lease

    def _new_lease(self, lease: Lease, raw: bytes | None = None) -> None:
        """Keep it, write it to the board (once, for every rank) and answer the ranks that
        wait for what it covers."""
        if lease == self._lease:
            return
        self._lease = lease
        self._lease_raw = lease.encode() if raw is None else raw
        self.stats["lease_pushes"] += 1
        self._publish()
        for conn, need in list(self._waiting.items()):
            if lease.covers(need):
                del self._waiting[conn]
                self._answer_lease(conn)

    def _publish(self) -> None:
        """The lease onto the board (a reason too long for it is cut: ranks need the steps)."""
        if self.board is None or self._lease_raw is None:
            return
        raw = self._lease_raw
        if len(raw) > MAX_BOARD_LEASE:
            raw = dataclasses.replace(self._lease, reason=self._lease.reason[:256]).encode()
        try:
            self.board.publish(raw)
        except Exception as exc:  # the ranks' boards stop moving: they ask, and are answered
            log.warning("relay: lease board write failed (%s); ranks ask for each lease from now on", exc)
            self._drop_board()

    def _drop_board(self) -> None:
        if self.board is not None:
            try:
                self.board.close()
            except Exception as exc:  # best effort cleanup at stop: logged
                log.warning("relay: could not remove the lease board %s: %s", self.board.path, exc)
            self.board = None

    def _answer_lease(self, conn: _RankConnection) -> None:
        if not conn.transport.is_closing():
            self.stats["lease_answers"] += 1
            conn.transport.write(encode_frame({"lease": self._lease_raw,
                                               "board": self.board.path if self.board is not None else None}))

    # ---- decisions ---------------------------------------------------------------------------
    async def _decide(self, packets: list[bytes], step: int, timeout: float, expect: int) -> bytes:
        """Group this node's decide calls for `step` (from `expect` ranks) into one aggregator call."""
        group = self._groups.get(step)
        if group is None:
            group = self._groups[step] = {"count": 0, "done": asyncio.get_running_loop().create_future(),
                                          "full": asyncio.Event()}
            asyncio.ensure_future(self._send_group(step, group, timeout))
        self._file(packets)
        group["count"] += 1
        if group["count"] >= expect:
            group["full"].set()
        return await group["done"]

    async def _send_group(self, step: int, group: dict[str, Any], timeout: float) -> None:
        if not group["full"].is_set():  # one rank decides (rank 0 at a candidate): no wait
            try:
                await asyncio.wait_for(group["full"].wait(), GROUP_WAIT_S)
            except TimeoutError:
                pass
        self._groups.pop(step, None)
        # everything queued goes in the same call, so the aggregator sees it before deciding
        batch = self._take()
        self.stats["decide_calls"] += 1
        try:
            directive = await self.forward_decide(batch, step, timeout)
        except Exception as exc:  # the waiting ranks get a no-directive naming the error, never a hung wait
            self.stats["forward_errors"] += 1
            directive = Directive.no_directive(step, str(exc)).encode()
        if not group["done"].done():
            group["done"].set_result(directive)


AUTH_TIMEOUT_S = 10.0
"""How long a new connection has to say hello with the token."""
HELLO_LIMIT = 4096
"""Largest first frame of a connection that must authenticate."""


class _RankConnection(asyncio.Protocol):
    """One rank's connection to the relay: frames are split as the bytes arrive and handled
    in order (no coroutine per frame). While a decision is pending, later frames wait."""

    def __init__(self, relay: RelayServer):
        self.relay = relay
        self.reader = FrameReader(HELLO_LIMIT if relay.token else MAX_FRAME)
        self.authenticated = not relay.token
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self._held: list[bytes] = []
        """Frames read while a decision is pending."""
        self._pending: asyncio.Future | None = None
        self._auth_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.relay._conns.add(self)
        if not self.authenticated:
            self._auth_timer = asyncio.get_running_loop().call_later(AUTH_TIMEOUT_S, self._refuse)

    def connection_lost(self, exc: Exception | None) -> None:
        self.relay._conns.discard(self)
        self.relay._waiting.pop(self, None)
        if self._auth_timer is not None:
            self._auth_timer.cancel()

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
        self.transport.close()

    def _refuse(self) -> None:
        self.relay.stats["refused_connections"] += 1
        log.warning("relay: refused a connection without this run's token")
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        try:
            # before the hello is accepted only it is read (under its small limit): what
            # follows it in the same read waits in the buffer for the full limit
            bodies = self.reader.feed(data, None if self.authenticated else 1)
        except ValueError:  # a frame over the limit: the sender is broken
            self.relay.stats["bad_frames" if self.authenticated else "refused_connections"] += 1
            self.transport.close()
            return
        if self._pending is not None or self._held:
            self._held.extend(bodies)
        else:
            self._handle(bodies)

    def _handle(self, bodies: list[bytes]) -> None:
        for i, body in enumerate(bodies):
            if self.transport.is_closing():
                return
            try:
                msg = decode_frame_body(body)
            except Exception:  # a malformed frame: refused before the hello, counted and skipped after it
                if not self.authenticated:
                    self._refuse()
                    return
                self.relay.stats["bad_frames"] += 1
                continue
            if not self.authenticated:
                if not self.relay.authenticated(msg):
                    self.transport.close()
                    return
                self.authenticated = True
                self.reader.limit = MAX_FRAME
                if self._auth_timer is not None:
                    self._auth_timer.cancel()
                self.data_received(b"")  # what came with the hello
                return
            try:
                self.relay._on_frame(self, msg)
            except Exception as exc:  # a frame of the right shape with wrong insides
                self.relay.stats["bad_frames"] += 1
                log.warning("relay: a bad frame: %r", exc)
                continue
            if self._pending is not None:  # a decision: the rest waits for its answer
                self._held[:0] = bodies[i + 1:]
                return

    def answer(self, decision: Awaitable[bytes]) -> None:
        """Write the directive once `decision` has it, then go on with what waited."""
        self._pending = asyncio.ensure_future(decision)
        self._pending.add_done_callback(self._answered)

    def _answered(self, fut: asyncio.Future) -> None:
        self._pending = None
        if fut.cancelled() or self.transport.is_closing():
            return
        exc = fut.exception()
        if exc is not None:
            log.warning("relay: a decision failed: %r", exc)
            self.transport.close()
            return
        self.transport.write(encode_frame({"directive": fut.result()}))
        held, self._held = self._held, []
        self._handle(held)
