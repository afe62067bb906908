"""Per-node packet relay: the node's ranks talk to their NodeAgent over loopback, the
agent talks to the aggregator in batches, so the aggregator's load grows with nodes,
not ranks (one actor drains ~2,000 calls/s; batched records reach ~50,000/s).

Wire: frames of a 4-byte big-endian length and a msgpack map (no pickle):
  {"op": "send", "packets": [bytes, ...]}                       no answer
  {"op": "decide", "packets": [...], "step": s, "timeout": t}   answer {"directive": bytes}
At a decision step the relay waits (a few ms) for the node's other ranks' decide calls
for the same step and forwards them as one aggregator call; the directive fans out.
The server listens on 127.0.0.1 only: ranks are on the agent's own machine.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
import time
from typing import Any, Awaitable, Callable

import msgpack

from .packets import Directive

log = logging.getLogger(__name__)

MAX_FRAME = 8 << 20
_LEN = struct.Struct(">I")
FLUSH_S = 0.05
FLUSH_PACKETS = 256
GROUP_WAIT_S = 0.02


def encode_frame(obj: dict[str, Any]) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def decode_body(body: bytes) -> dict[str, Any]:
    obj = msgpack.unpackb(body, raw=False, max_bin_len=MAX_FRAME, max_array_len=1 << 16, max_map_len=64,
                          max_str_len=1 << 16)
    if not isinstance(obj, dict):
        raise ValueError("frame is not a map")
    return obj


class RelayServer:
    """Runs an asyncio loop in a daemon thread. `forward_send(batch)` is called with
    batches of packets (fire-and-forget); `forward_decide(batch, step, timeout)` must
    return the directive bytes (it may block: it runs in a worker thread)."""

    def __init__(self, forward_send: Callable[[list[bytes]], None],
                 forward_decide: Callable[[list[bytes], int, float], bytes], local_ranks: int,
                 host: str = "127.0.0.1"):
        self.forward_send = forward_send
        self.forward_decide = forward_decide
        self.local_ranks = max(1, local_ranks)
        self.host = host
        self.port = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._buffer: list[bytes] = []
        self._groups: dict[int, dict[str, Any]] = {}
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mindpulse-relay", daemon=True)
        self.stats = {"frames": 0, "packets": 0, "forward_calls": 0, "decide_calls": 0, "bad_frames": 0,
                      "forward_errors": 0}

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
        except Exception:
            pass
        self._thread.join(5)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(self._client, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        self._stop = asyncio.Event()
        flusher = asyncio.ensure_future(self._flusher())
        self._ready.set()
        await self._stop.wait()
        flusher.cancel()
        await self._flush()
        self._server.close()
        clients = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in clients:
            t.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        await asyncio.get_running_loop().shutdown_default_executor()

    async def _shutdown(self) -> None:
        self._stop.set()

    # ---- traffic ---------------------------------------------------------------------------
    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readexactly(_LEN.size)
                (n,) = _LEN.unpack(head)
                if n > MAX_FRAME:
                    self.stats["bad_frames"] += 1
                    break
                body = await reader.readexactly(n)
                try:
                    msg = decode_body(body)
                    packets = [bytes(p) for p in msg.get("packets") or [] if isinstance(p, (bytes, bytearray))]
                except Exception:
                    self.stats["bad_frames"] += 1
                    continue
                self.stats["frames"] += 1
                self.stats["packets"] += len(packets)
                if msg.get("op") == "decide":
                    step, timeout = int(msg.get("step", 0)), float(msg.get("timeout", 60.0))
                    directive = await self._decide(packets, step, timeout)
                    writer.write(encode_frame({"directive": directive}))
                    await writer.drain()
                else:
                    self._buffer.extend(packets)
                    if len(self._buffer) >= FLUSH_PACKETS:
                        await self._flush()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _flusher(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            await self._flush()

    async def _flush(self) -> None:
        if not self._buffer:
            return
        batch, self._buffer = self._buffer, []
        self.stats["forward_calls"] += 1
        try:
            self.forward_send(batch)
        except Exception as exc:
            self.stats["forward_errors"] += 1
            log.warning("relay could not forward %d packets: %s", len(batch), exc)

    async def _decide(self, packets: list[bytes], step: int, timeout: float) -> bytes:
        """Group this node's decide calls for `step` into one aggregator call."""
        group = self._groups.get(step)
        if group is None:
            group = self._groups[step] = {"packets": [], "count": 0, "done": asyncio.get_running_loop().create_future(),
                                          "full": asyncio.Event()}
            asyncio.ensure_future(self._send_group(step, group, timeout))
        group["packets"].extend(packets)
        group["count"] += 1
        if group["count"] >= self.local_ranks:
            group["full"].set()
        return await group["done"]

    async def _send_group(self, step: int, group: dict[str, Any], timeout: float) -> None:
        try:
            await asyncio.wait_for(group["full"].wait(), GROUP_WAIT_S)
        except asyncio.TimeoutError:
            pass
        self._groups.pop(step, None)
        # everything buffered goes first, in the same call, so the aggregator sees it before deciding
        batch = self._buffer + group["packets"]
        self._buffer = []
        self.stats["decide_calls"] += 1
        try:
            directive = await asyncio.get_running_loop().run_in_executor(
                None, self.forward_decide, batch, step, timeout)
        except Exception as exc:
            self.stats["forward_errors"] += 1
            directive = Directive(step=step, reason=f"no directive: {exc}").encode()
        if not group["done"].done():
            group["done"].set_result(directive)


class RelayClient:
    """The rank's side: same interface as AggregatorClient (send / flush / decide)."""

    BATCH = 32
    FLUSH_S = 0.5

    def __init__(self, host: str, port: int, decision_timeout_s: float = 120.0):
        self.addr = (host, port)
        self.decision_timeout_s = decision_timeout_s
        self.sock: socket.socket | None = None
        self._buffer: list[bytes] = []
        self._last = time.monotonic()
        self.failures = 0
        self._connect()

    def _connect(self) -> None:
        try:
            self.sock = socket.create_connection(self.addr, timeout=10)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            self.sock = None
            self.failures += 1
            log.warning("cannot reach the node's packet relay at %s:%d: %s", *self.addr, exc)

    def _write(self, obj: dict[str, Any]) -> bool:
        if self.sock is None:
            self._connect()
            if self.sock is None:
                return False
        try:
            self.sock.settimeout(30)
            self.sock.sendall(encode_frame(obj))
            return True
        except OSError as exc:
            self.failures += 1
            log.warning("packet relay write failed: %s", exc)
            self.close()
            return False

    def send(self, packet: bytes) -> None:
        self._buffer.append(packet)
        if len(self._buffer) >= self.BATCH or time.monotonic() - self._last >= self.FLUSH_S:
            self.flush()

    def flush(self) -> None:
        if self._buffer:
            batch, self._buffer = self._buffer, []
            self._last = time.monotonic()
            self._write({"op": "send", "packets": batch})

    def decide(self, packet: bytes, step: int) -> Directive:
        batch, self._buffer = self._buffer + [packet], []
        self._last = time.monotonic()
        if not self._write({"op": "decide", "packets": batch, "step": step, "timeout": self.decision_timeout_s}):
            return Directive(step=step, reason="no directive: relay unreachable")
        try:
            self.sock.settimeout(self.decision_timeout_s + 15)  # type: ignore[union-attr]
            head = _recv_exact(self.sock, _LEN.size)
            (n,) = _LEN.unpack(head)
            body = decode_body(_recv_exact(self.sock, n))
            return Directive.decode(body["directive"])
        except Exception as exc:
            self.failures += 1
            self.close()
            log.warning("no directive for step %d from the relay (%s); continuing", step, exc)
            return Directive(step=step, reason=f"no directive: {exc}")

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("relay closed the connection")
        buf.extend(chunk)
    return bytes(buf)
