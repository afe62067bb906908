"""Per-node packet relay: the node's ranks talk to their NodeAgent over loopback, the
agent talks to the aggregator in batches, so the aggregator's load grows with nodes,
not ranks (one actor drains ~2,000 calls/s; batched records reach ~50,000/s).

Wire: the protocol's relay frames, a 4-byte big-endian length and a msgpack map (no pickle):
  {"op": "send", "packets": [bytes, ...]}                       no answer
  {"op": "decide", "packets": [...], "step": s, "timeout": t}   answer {"directive": bytes}
At a decision step the relay waits (a few ms) for the node's other ranks' decide calls
for the same step and forwards them as one aggregator call; the directive fans out.
The server listens on 127.0.0.1 only: ranks are on the agent's own machine. The rank's
side is `mindpulse.workers.channel.RelayChannel`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from mindpulse.protocol import (
    FRAME_HEADER_BYTES,
    MAX_FRAME,
    Directive,
    decode_frame_body,
    encode_frame,
    frame_length,
)

log = logging.getLogger(__name__)

FLUSH_S = 0.05
FLUSH_PACKETS = 256
GROUP_WAIT_S = 0.02


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
                n = frame_length(await reader.readexactly(FRAME_HEADER_BYTES))
                if n > MAX_FRAME:
                    self.stats["bad_frames"] += 1
                    break
                body = await reader.readexactly(n)
                try:
                    msg = decode_frame_body(body)
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
        except TimeoutError:
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
            directive = Directive.no_directive(step, str(exc)).encode()
        if not group["done"].done():
            group["done"].set_result(directive)
