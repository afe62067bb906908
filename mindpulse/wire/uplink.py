"""The node uplink: one TCP stream from each node agent to the aggregator (or to its group
leader), carrying what the node's ranks reported and bringing the lease back.

Why not Ray actor calls: measured on a 2-core machine, one fire-and-forget actor call per
step plus one lease long poll cost ~3.7 ms of the aggregator's CPU and ~2.5 ms of the
caller's per step (Ray's core worker threads, gRPC, the actor's event loop), against
~0.3 ms and ~0.2 ms for the same batch over a socket. On the machine that trains, that CPU
is taken from the ranks: at a 25 ms step it was a fifth of the monitoring overhead. Ray
still starts, restarts and finds the processes; the stream only moves the steps.

Frames are mindpulse/wire/frames.py's (`encode_frame`: a 4-byte big-endian length, then a
msgpack map; no pickle). Client → server:
  {"op": "hello", "token": t, "node": n}                 first frame; a wrong token closes
  {"op": "send", "seq": i, "entries": [[node, batch]]}   a node's `NodeBatch` (or a group
                                                         leader's merged ones: node is then a
                                                         list of node ids)
  {"op": "decide", "seq": i, "entries": [...], "step": s, "timeout": t}
                                                         ingest, then answer with the step's
                                                         directive once it is reduced
Server → client:
  {"ack": i}                        every frame through `seq` i is ingested (in order)
  {"seq": i, "directive": bytes}    the answer to decide `i`
  {"lease": bytes}                  the lease, right after the hello and whenever it changes
                                    (pushed: no node polls)

Delivery: a frame stays in the client's queue until acknowledged. The aggregator
acknowledges a frame once it has ingested it; a group leader (node/group.py) once
everything in it has been acknowledged above it (`UplinkServer(deferred_acks=True)`: the
leader's ingest holds the frame's `Receipt` until the frames it went up in are
acknowledged), so a leader that dies loses nothing its members would not send again.
After a reconnect (the aggregator restarted: Ray restarts it, and `resolve` asks the new
instance for its address) every unacknowledged frame is sent again in order, so no step
is lost. A frame may so arrive twice: the aggregator refuses a node partial of a step it
holds already (the step is reduced once), but stores the raw step packets as they come
(they are never decoded there), so `metrics.msgpack` may hold such a packet twice (the
report, `top` and a replay reduce it once; docs/run_directory.md tells scripts to keep
one per rank and step). At most `max_unacked` frames wait: beyond that a batch is dropped
and its packets counted (`dropped`), so a gone aggregator never grows a node's memory.

The token comes from the server's owner through Ray (`uplink_address()`), whose own
authentication guards it; the server listens on its node's address.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import logging
import secrets
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack

from mindpulse.wire.directives import Directive
from mindpulse.wire.frames import FRAME_HEADER_BYTES, encode_frame, frame_int, frame_length, frame_timeout

log = logging.getLogger(__name__)

MAX_UPLINK_FRAME = 64 << 20
"""Largest uplink frame: a group leader's batch of 64 nodes' raw packets is ~0.2 MB a step."""
HELLO_TIMEOUT_S = 10.0
RECONNECT_S = (0.1, 2.0)
"""First and longest wait between attempts to reach the server."""
DIRECTIVE_GRACE_S = 10.0

Entries = list[tuple[Any, dict[str, Any]]]
"""[(node id or list of node ids, NodeBatch)]."""
Address = tuple[str, int, str]
"""(host, port, token)."""


def decode_uplink(body: bytes) -> dict[str, Any]:
    """A frame body: a msgpack map (raises ValueError on anything else)."""
    obj = msgpack.unpackb(body, raw=False, strict_map_key=False, max_bin_len=MAX_UPLINK_FRAME,
                          max_str_len=1 << 20, max_array_len=1 << 22, max_map_len=1 << 20)
    if not isinstance(obj, dict):
        raise ValueError("frame is not a map")
    return obj


async def _read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    n = frame_length(await reader.readexactly(FRAME_HEADER_BYTES))
    if n > MAX_UPLINK_FRAME:
        raise ValueError(f"a {n}-byte uplink frame (the limit is {MAX_UPLINK_FRAME})")
    return decode_uplink(await reader.readexactly(n))


def _entries(x: Any) -> Entries:
    """The frame's entries, shape-checked (what is inside a batch the receiver validates)."""
    if not isinstance(x, list):
        raise ValueError("entries is not a list")
    out: Entries = []
    for e in x:
        if not (isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[1], dict)):
            raise ValueError("an entry is not [node, batch]")
        node = e[0]
        if not (_node_id(node) or (isinstance(node, list) and node and all(_node_id(n) for n in node))):
            raise ValueError(f"an entry's node is {node!r}, not a node id or a list of them")
        out.append((node, e[1]))
    return out


def _node_id(x: Any) -> bool:
    return frame_int(x, -1) >= 0


class Receipt:
    """What one received frame still has on its way further up. The server holds it while
    it files the frame; the receiver `hold`s it once per piece it keeps to send on (a
    partial, a batch of raw packets) and `release`s it when that piece is acknowledged
    above (or dropped there, counted). Once nothing holds it, `on_done` runs (once).
    Thread-safe: pieces are released from the uplink's loop, held from wherever the
    receiver files them."""

    __slots__ = ("_held", "_lock", "_on_done")

    def __init__(self, on_done: Callable[[], None]):
        self._held = 1  # the server's own hold, while it files the frame
        self._lock = threading.Lock()
        self._on_done: Callable[[], None] | None = on_done

    def hold(self) -> None:
        with self._lock:
            if self._on_done is None:
                raise RuntimeError("a receipt already released")
            self._held += 1

    def release(self) -> None:
        with self._lock:
            self._held -= 1
            done, self._on_done = (self._on_done, None) if self._held == 0 else (None, self._on_done)
        if done is not None:
            done()


class _Acks:
    """One connection's acknowledgements, in frame order: frame `seq` is acknowledged once
    it and every frame before it are done (a client drops all it holds up to an ack)."""

    def __init__(self, writer: asyncio.StreamWriter, loop: asyncio.AbstractEventLoop):
        self.writer = writer
        self.loop = loop
        self.pending: deque[list[Any]] = deque()
        """[seq, done] per frame not yet acknowledged, in order."""

    def receipt(self, seq: int) -> Receipt:
        entry = [seq, False]
        self.pending.append(entry)

        def done() -> None:  # from any thread: the ack is written in the loop
            self.loop.call_soon_threadsafe(self._done, entry)

        return Receipt(done)

    def _done(self, entry: list[Any]) -> None:
        entry[1] = True
        last = None
        while self.pending and self.pending[0][1]:
            last = self.pending.popleft()[0]
        if last is not None and not self.writer.is_closing():
            self.writer.write(encode_frame({"ack": last}))


# ---- the server: in the aggregator actor's event loop, or a group leader's relay loop ----------
class UplinkServer:
    """Accepts node uplinks in the running event loop.

    `ingest(entries)` files a frame's batches, in frame order (a coroutine function is
    awaited before the next frame is read);
    `directive(step, timeout)` waits for a step's directive bytes; `lease()` is the current
    lease's bytes, sent on every new connection and pushed to all of them when the owner
    calls `push_lease` (after it reduced a step, or received a new lease from above).

    With `deferred_acks` (a group leader) `ingest(entries, receipt)` also gets the frame's
    `Receipt`, and the frame is acknowledged once the receipt is released (see `Receipt`);
    without, a frame is acknowledged as soon as it is ingested."""

    def __init__(self, ingest: Callable[..., Any],
                 directive: Callable[[int, float], Awaitable[bytes]], lease: Callable[[], bytes],
                 deferred_acks: bool = False, directive_now: Callable[[int], bytes | None] | None = None):
        self.ingest = ingest
        self.deferred_acks = deferred_acks
        self.directive = directive
        self.directive_now = directive_now
        """The directive of a step if it is decided already (else None): a decide frame that
        completed its step is answered in the same write as its ack, with no task to wait on."""
        self.lease = lease
        self.token = secrets.token_hex(16)
        self.host = ""
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._pushed: bytes | None = None
        self._out: dict[asyncio.StreamWriter, list[bytes]] = {}
        """Frames written in this turn of the loop, per connection (see `_write`)."""
        self._waiting: dict[tuple[int, int], tuple[asyncio.StreamWriter, int, int]] = {}
        """Decide frames whose step was not yet decided when they came: (connection id, seq)
        → (connection, seq, step); answered by `answer_ready` the moment their step is."""
        self.stats: Counter[str] = Counter()

    async def start(self, host: str) -> Address:
        self._server = await asyncio.start_server(self._client, host, 0, limit=1 << 20)
        self.host, self.port = host, self._server.sockets[0].getsockname()[1]
        return self.address

    @property
    def address(self) -> Address:
        return self.host, self.port, self.token

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        self._writers.clear()

    def push_lease(self) -> None:
        """Send the lease to every connection if it changed since the last push."""
        if not self._writers:
            return
        raw = self.lease()
        if raw == self._pushed:
            return
        self._pushed = raw
        frame = encode_frame({"lease": raw})
        for w in list(self._writers):
            if w.is_closing():
                self._writers.discard(w)
                continue
            self._write(w, frame)
        self.stats["lease_pushes"] += 1

    def _write(self, writer: asyncio.StreamWriter, frame: bytes) -> None:
        """Send `frame` at the end of this turn of the loop, with whatever else this turn
        sends the same connection: the lease a node's frame completed and that frame's ack
        leave in one write, and the node is woken once for both (a wake-up is what costs
        the node agent most: measured, see docs/benchmarks.md, "Investigations")."""
        out = self._out.get(writer)
        if out is None:
            out = self._out[writer] = []
            asyncio.get_running_loop().call_soon(self._flush_out, writer)
        out.append(frame)

    def _flush_out(self, writer: asyncio.StreamWriter) -> None:
        out = self._out.pop(writer, None)
        if out and not writer.is_closing():
            writer.write(b"".join(out))

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            try:
                hello = await asyncio.wait_for(_read_frame(reader), HELLO_TIMEOUT_S)
            except Exception:  # a peer that sends no valid hello is refused just below
                hello = {}
            token = hello.get("token")
            if not (hello.get("op") == "hello" and isinstance(token, str) and hmac.compare_digest(token, self.token)):
                self.stats["refused_connections"] += 1
                log.warning("uplink: refused a connection without this run's token")
                return
            self.stats["connections"] += 1
            self._write(writer, encode_frame({"lease": self.lease()}))
            self._writers.add(writer)
            acks = _Acks(writer, asyncio.get_running_loop()) if self.deferred_acks else None
            while True:
                try:
                    msg = await _read_frame(reader)
                    op, seq = msg.get("op"), msg.get("seq")
                    if not isinstance(seq, int) or op not in ("send", "decide"):
                        raise ValueError(f"a frame with op {op!r} and seq {seq!r}")
                    entries = _entries(msg.get("entries", []))
                except (asyncio.IncompleteReadError, ConnectionError):
                    raise
                except Exception as exc:  # a peer that speaks garbage is cut off, not followed
                    self.stats["bad_frames"] += 1
                    log.warning("uplink: dropping a connection that sent a bad frame: %s", exc)
                    return
                self.stats["frames"] += 1
                receipt = acks.receipt(seq) if acks is not None else None
                if entries:
                    try:
                        done = self.ingest(entries) if receipt is None else self.ingest(entries, receipt)
                        if inspect.isawaitable(done):
                            await done
                    except Exception as exc:  # the monitor never ends a run: log, count, go on
                        self.stats["ingest_errors"] += 1
                        log.warning("uplink: a batch could not be ingested: %s", exc)
                if receipt is None:
                    self._write(writer, encode_frame({"ack": seq}))
                else:
                    receipt.release()  # filed: what it holds now is on its way up
                if op == "decide" and not self._answer_now(writer, seq, msg.get("step")):
                    t = asyncio.ensure_future(self._answer(writer, seq, msg.get("step"), msg.get("timeout")))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            self._flush_out(writer)  # what this turn still had for it (an answer, an ack)
            for t in tasks:
                t.cancel()
            writer.close()

    def _answer_now(self, writer: asyncio.StreamWriter, seq: int, step: Any) -> bool:
        if self.directive_now is None:
            return False
        try:
            raw = self.directive_now(frame_int(step, -1))
        except Exception:  # no directive at hand: the slow path (_answer) asks the aggregator instead
            return False
        if raw is None:
            return False
        self._write(writer, encode_frame({"seq": seq, "directive": raw}))
        return True

    async def _answer(self, writer: asyncio.StreamWriter, seq: int, step: Any, timeout: Any) -> None:
        step, timeout = frame_int(step, -1), frame_timeout(timeout)
        key = (id(writer), seq)
        self._waiting[key] = (writer, seq, step)
        try:
            raw = await self.directive(step, timeout)
        except Exception as exc:  # the rank gets no directive naming the error, never a hung wait
            raw = Directive.no_directive(step, f"aggregator error: {exc}").encode()
        finally:
            waiting = self._waiting.pop(key, None)
        if waiting is not None and not writer.is_closing():  # else answer_ready answered it
            self._write(writer, encode_frame({"seq": seq, "directive": raw}))

    def answer_ready(self) -> None:
        """Answer every waiting decide whose step is now decided, in this turn of the loop:
        the owner calls it right after it reduced steps and before it draws their views, so
        a rank waiting on a verdict never waits for a table or a TensorBoard event (the
        waiting task itself would resume only after what the loop queued before it)."""
        if not self._waiting or self.directive_now is None:
            return
        for key, (writer, seq, step) in list(self._waiting.items()):
            try:
                raw = self.directive_now(step)
            except Exception:  # not decided after all: the waiting task answers when it is
                continue
            if raw is None:
                continue
            del self._waiting[key]
            self.stats["answered_ready"] += 1
            if not writer.is_closing():
                self._write(writer, encode_frame({"seq": seq, "directive": raw}))


# ---- the client: in a node agent's relay loop -------------------------------------------------
class Uplink:
    """One node's stream up. Runs in an event loop (`start(loop)`); `send` and `decide` are
    called from that loop's thread, `send_threadsafe` from any thread."""

    def __init__(self, node: int, resolve: Callable[[], Address], on_lease: Callable[[bytes], None],
                 max_unacked: int = 2000):
        """`resolve()` (blocking: it runs in a worker thread) returns the server's address;
        `on_lease(raw)` runs in the loop for every lease pushed down."""
        self.node = node
        self.resolve = resolve
        self.on_lease = on_lease
        self.max_unacked = max_unacked
        self.loop: asyncio.AbstractEventLoop | None = None
        self._seq = 0
        self._unacked: OrderedDict[int, tuple[bytes, int]] = OrderedDict()
        """seq → (frame, packets in it), in order."""
        self._on_acked: dict[int, Callable[[], None]] = {}
        """seq → what to call once the frame is acknowledged (a group leader's receipts)."""
        self._decides: dict[int, tuple[int, float, asyncio.Future]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task | None = None
        self._redirect = asyncio.Event()  # (an asyncio primitive binds to the loop that first waits on it)
        self._drained = asyncio.Event()
        """Set while every frame is acknowledged."""
        self._drained.set()
        self.dropped = 0
        """Packets dropped because `max_unacked` frames were waiting."""
        self.stats: Counter[str] = Counter()
        self.last_error = ""

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        loop.call_soon_threadsafe(self._begin)

    def _begin(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def redirect(self) -> None:
        """Drop the connection and resolve the server again (the group's leader changed)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._go_elsewhere)

    def _go_elsewhere(self) -> None:
        self._redirect.set()
        if self._writer is not None:
            self._writer.close()  # the read ends; the loop resolves again without backing off

    async def close(self, timeout: float = 10.0) -> int:
        """Wait up to `timeout` for every frame to be acknowledged, then close; returns the
        number of packets still unacknowledged (lost)."""
        if self._unacked:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), timeout)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        lost = sum(n for _, n in self._unacked.values())
        for _, _, fut in self._decides.values():
            if not fut.done():
                fut.cancel()
        return lost

    @property
    def connected(self) -> bool:
        return self._writer is not None

    @property
    def unacked(self) -> int:
        return len(self._unacked)

    # ---- traffic -------------------------------------------------------------------------------
    def send(self, entries: Entries, on_acked: Callable[[], None] | None = None) -> None:
        """Queue `entries` for the server; `on_acked()` runs (in the loop) once the server
        acknowledged them, or at once if they are dropped (a full queue: counted)."""
        self._queue({"op": "send", "entries": entries}, entries, on_acked=on_acked)

    def send_batch(self, batch: dict[str, Any]) -> None:
        """This node's own batch (its relay's `NodeBatch`), as one entry: the relay calls this
        directly (`NodeAgent._route`)."""
        self.send([(self.node, batch)])

    def send_threadsafe(self, entries: Entries, on_acked: Callable[[], None] | None = None) -> None:
        assert self.loop is not None, "start() the uplink first"
        self.loop.call_soon_threadsafe(self.send, entries, on_acked)

    async def decide(self, entries: Entries, step: int, timeout: float) -> bytes:
        """File `entries` and wait for the directive of `step` (a no-directive after
        `timeout` and a grace: the rank then goes on as told by the lease)."""
        fut = asyncio.get_running_loop().create_future()
        seq = self._queue({"op": "decide", "entries": entries, "step": step, "timeout": timeout}, entries, force=True)
        self._decides[seq] = (step, timeout, fut)
        try:
            return await asyncio.wait_for(fut, timeout + DIRECTIVE_GRACE_S)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError) and not fut.cancelled():
                raise
            why = self.last_error or "timeout"
            return Directive.no_directive(step, f"no directive from the aggregator: {why}").encode()
        finally:
            self._decides.pop(seq, None)

    def _queue(self, frame: dict[str, Any], entries: Entries, force: bool = False,
               on_acked: Callable[[], None] | None = None) -> int:
        packets = sum(_packets(b) for _, b in entries)
        if len(self._unacked) >= self.max_unacked and not force:
            self.dropped += packets
            self.stats["dropped_frames"] += 1
            _call(on_acked)  # nothing more will come of it
            return -1
        self._seq += 1
        raw = encode_frame(dict(frame, seq=self._seq))
        self._unacked[self._seq] = (raw, packets)
        if on_acked is not None:
            self._on_acked[self._seq] = on_acked
        self._drained.clear()
        self.stats["frames"] += 1
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(raw)
        return self._seq

    # ---- the connection --------------------------------------------------------------------------
    async def _run(self) -> None:
        wait = RECONNECT_S[0]
        loop = asyncio.get_running_loop()
        while True:
            writer = None
            # a redirect from here on (the group's leader named while this resolves or
            # connects) must not be lost: it is checked once connected, with no await between
            # the check and `_writer` being set (where a later redirect closes it)
            self._redirect.clear()
            try:
                host, port, token = await loop.run_in_executor(None, self.resolve)
                reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
                if self._redirect.is_set():  # not an error: resolve again at once (`finally` closes this one)
                    self.stats["redirected_while_connecting"] += 1
                    continue
                writer.write(encode_frame({"op": "hello", "token": token, "node": self.node}))
                # everything not acknowledged goes again, in order; decisions already filed
                # are asked again without their batches
                for raw, _ in self._unacked.values():
                    writer.write(raw)
                for seq, (step, timeout, fut) in self._decides.items():
                    if seq not in self._unacked and not fut.done():
                        writer.write(encode_frame({"op": "decide", "seq": seq, "entries": [], "step": step,
                                                   "timeout": timeout}))
                self._writer = writer  # from here on new frames are written as they come
                await writer.drain()
                self.stats["connections"] += 1
                self.last_error = ""  # an earlier connection's error is no reason for a later timeout
                wait = RECONNECT_S[0]
                while True:
                    self._on_frame(await _read_frame(reader))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a lost connection is retried by this loop: recorded, counted
                self.last_error = f"{type(exc).__name__}: {exc}"
                self.stats["connect_errors"] += 1
                log.debug("node %d uplink: %s", self.node, self.last_error)
            finally:
                self._writer = None
                if writer is not None:
                    writer.close()
            try:  # back off, unless told to go elsewhere at once
                await asyncio.wait_for(self._redirect.wait(), wait)
            except TimeoutError:
                pass
            wait = min(wait * 2, RECONNECT_S[1])

    def _on_frame(self, msg: dict[str, Any]) -> None:
        if "ack" in msg:
            ack = msg["ack"]
            while self._unacked and next(iter(self._unacked)) <= ack:
                seq, _ = self._unacked.popitem(last=False)
                _call(self._on_acked.pop(seq, None))
            if not self._unacked:
                self._drained.set()
        if "directive" in msg:
            entry = self._decides.get(msg.get("seq"))  # type: ignore[arg-type]
            if entry is not None and not entry[2].done():
                entry[2].set_result(bytes(msg["directive"]))
        if "lease" in msg:
            self.on_lease(bytes(msg["lease"]))


def _packets(batch: dict[str, Any]) -> int:
    """The packets a `NodeBatch` carries (a group leader's steps come joined, counted in "steps_n";
    a heartbeat row counts as the packet it stands for)."""
    n = batch.get("steps_n")
    steps = n if type(n) is int else len(batch.get("steps") or [])
    return steps + len(batch.get("other") or []) + len(batch.get("beats") or [])


def _call(fn: Callable[[], None] | None) -> None:
    """Run an acknowledgement callback; its error is logged, never raised into the stream."""
    if fn is None:
        return
    try:
        fn()
    except Exception as exc:  # a callback's failure must not break the stream: logged
        log.warning("uplink: an acknowledgement callback failed: %s", exc)
