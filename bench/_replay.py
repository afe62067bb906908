"""Replayed senders for bench/fanin.py: every group leader's frames built before the run, by
the node agents' own code, and replayed over real uplinks, so that the senders' processes
take as little of the machine's cores as a socket write (on this 2-core machine the live
senders of bench/_node_sim.py took ~55% of a core each at 32,768 ranks, beside the
aggregator's ~50%).

What is built before the run (`group_frames`, two Ray tasks), per group and per step of a
cycle of `CYCLE` steps: every node's batch through the real `NodePreReducer`
(`_node_sim.node_batches`), then those batches through the real `GroupLeader`, whose one
flush is the frame its uplink sends (the merged partial, the group's step packets back to
back in one bytes, `steps_n`). The frame's entries are msgpack-packed once, with every
`step` field at a fixed width (uint32), so a later step of the run is the same bytes with
its step written in (`Template.at`: one 4-byte write per packet and partial, no encoding).
Steps past the cycle repeat its packets' values (a cycle is a multiple of the collect and
candidate periods, so a step keeps its collect, weight-statistics and decide content).

What runs: one real `Uplink` per group leader to the aggregator's uplink server (frames
acknowledged, sent again after a reconnect, the lease pushed down), writing those bytes
(`ReplayUplink.send_packed`); at a checkpoint candidate node 0's leader asks the step's
decision on the same stream (`Uplink.decide`, as `node.agent._forward_decide` does for a
leader). Heartbeats: each node's ranks' beats due in a flush window go up as one record per
node (`NodeBatch["beats"]`, as the relay makes it), the group's nodes in one frame.
Telemetry: each node's sample encoded once (`_node_sim.telemetry_sample`), its timestamp
written in when it is due. Left out: the members' streams to their leaders (what the
aggregator receives is the same frames) and the leaders' merging at run time (done before).
"""

from __future__ import annotations

import asyncio
import io
import struct
import threading
import time
from typing import Any

import msgpack
from _node_sim import FLUSH_S, LeaseWatch, Senders, _Relay, loop_thread, node_batches, telemetry_sample

from mindpulse.node.group import GroupLeader
from mindpulse.wire.uplink import Uplink

CYCLE = 10
"""Steps built before the run; a run's step s > 0 replays built step 1 + (s - 1) % CYCLE (the
default collect period and checkpoint candidates' period, `monitor.collect_freq` and
`checkpoint.best_every_steps`: a step keeps its collect and decide content)."""
_STEP_KEY = msgpack.packb("step")
_TS_KEY = msgpack.packb("ts")
_U32 = struct.Struct(">I")
_F64 = struct.Struct(">d")


class _Capture(GroupLeader):
    """The real `GroupLeader` with no flush thread: its flush, called when the last member's
    partial of a step is in, hands the frame's entries to `send` (captured here)."""

    def _flush_loop(self) -> None:
        return


def _fixed_steps(obj: Any) -> Any:
    """`obj` with every map's int "step" as a uint32 marker to be found after packing (see
    `Template`): msgpack packs ints at their smallest width, which a later step could outgrow."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if k == "step" and type(v) is int:
                out[k] = _Mark(v)
            else:
                out[k] = _fixed_steps(v)
        return out
    if isinstance(obj, (list, tuple)):
        return [_fixed_steps(v) for v in obj]
    return obj


class _Mark:
    __slots__ = ("step",)

    def __init__(self, step: int):
        self.step = step


_MARK_EXT = 77


def _pack_marked(obj: Any) -> bytes:
    """msgpack of `obj` with each `_Mark` as a fixed-width uint32 (0xce + 4 bytes)."""
    def default(x: Any) -> Any:
        if isinstance(x, _Mark):
            return msgpack.ExtType(_MARK_EXT, _U32.pack(x.step))
        raise TypeError(type(x))

    raw = msgpack.packb(obj, default=default, use_bin_type=True)
    # an ext of 4 bytes packs as fixext4: d6 <type> <4 bytes>; a uint32 is ce <4 bytes>: one byte
    # shorter, so the body is rebuilt around each marker, found with its "step" key before it
    # (the two tag bytes alone also turn up inside floats and bins)
    tag = _STEP_KEY + bytes([0xD6, _MARK_EXT])
    out, i = bytearray(), 0
    while True:
        j = raw.find(tag, i)
        if j < 0:
            out += raw[i:]
            return bytes(out)
        k = j + len(_STEP_KEY)
        out += raw[i:k]
        out += b"\xce" + raw[k + 2:k + 6]
        i = k + 6


class Template:
    """One frame's entries, packed once; `at(step)` the same bytes with every step field set
    to `step` (offsets found once)."""

    __slots__ = ("buf", "offsets", "packets")

    def __init__(self, packed: bytes, packets: int):
        self.buf = bytearray(packed)
        self.packets = packets
        key = _STEP_KEY + b"\xce"
        self.offsets = []
        i = self.buf.find(key)
        while i >= 0:
            self.offsets.append(i + len(key))
            i = self.buf.find(key, i + 1)

    def at(self, step: int) -> bytes:
        v = _U32.pack(step)
        buf = self.buf
        for o in self.offsets:
            buf[o:o + 4] = v
        return bytes(buf)


def group_frames(groups: list[list[int]], overrides: list[str], steps: int, rate: float) -> dict[int, list[bytes]]:
    """Each group's packed frame entries of steps 0..`steps` (its leader's one flush a step),
    built by the node agents' code; packed with fixed-width step fields. Run as a Ray task."""
    out: dict[int, list[bytes]] = {}
    for g in groups:
        batches = node_batches(g, overrides, steps, rate)
        sent: list[Any] = []
        lead = _Capture(g[0], g, lambda entries, acked, sent=sent: sent.append(entries))
        frames = []
        for s in range(steps + 1):
            sent.clear()
            for n in g:
                lead.add(n, msgpack.unpackb(batches[n][s], raw=False, strict_map_key=False))
            lead.flush(force=True)
            entries = [e for x in sent for e in x]
            for _, batch in entries:  # the raw packets' own step fields too (they travel as bytes)
                batch["steps"] = [b"".join(_pack_marked(_fixed_steps(p))
                                           for p in msgpack.Unpacker(io.BytesIO(blob), raw=False))
                                  for blob in batch.get("steps") or []]
            packets = sum(b.get("steps_n") or len(b.get("steps") or []) for _, b in entries)
            frames.append(msgpack.packb([packets, _pack_marked(_fixed_steps([list(e) for e in entries]))]))
        lead.close()
        out[g[0]] = frames
    return out


class ReplayUplink(Uplink):
    """The real `Uplink` (its queue of unacknowledged frames, reconnects, acknowledgements,
    leases, decisions), with frames whose entries come packed already."""

    def send_packed(self, entries: bytes, packets: int) -> None:
        """A "send" frame around `entries` (msgpack of the frame's entries) in the loop's thread."""
        if len(self._unacked) >= self.max_unacked:
            self.dropped += packets
            self.stats["dropped_frames"] += 1
            return
        self._seq += 1
        head = msgpack.packb({"op": "send", "seq": self._seq})
        body = b"\x83" + head[1:] + msgpack.packb("entries") + entries
        raw = struct.pack(">I", len(body)) + body
        self._unacked[self._seq] = (raw, packets)
        self._drained.clear()
        self.stats["frames"] += 1
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(raw)


class Replay(Senders):
    """The group leaders of some groups, replaying their built frames (a Ray actor of the
    benchmark; what it keeps of a run and answers, as `_node_sim.Nodes`, is `Senders`')."""

    def __init__(self, aggregator: Any, groups: list[list[int]], frames: dict[int, list[bytes]], rpn: int,
                 heartbeat_s: float, telemetry_s: float, decision_timeout_s: float, seed: int,
                 address: tuple[str, int, str] | None = None):
        """`aggregator`: the actor's handle (its `uplink_address` asked through Ray), or None
        with `address`, the uplink server's (host, port, token) (a test without Ray)."""
        self.rpn = rpn
        self.decision_timeout_s = decision_timeout_s
        self.loop = loop_thread("uplinks")
        self.watch = LeaseWatch()
        self.groups = groups
        self.templates: dict[int, list[Template]] = {}
        for g in groups:
            built = [msgpack.unpackb(f) for f in frames[g[0]]]
            self.templates[g[0]] = [Template(body, n) for n, body in built]
            self.watch.watch(g[0], True)
        if address is not None:
            resolve = lambda: address  # noqa: E731
        else:
            import ray

            resolve = lambda: tuple(ray.get(aggregator.uplink_address.remote(), timeout=60))  # noqa: E731
        self.relays = {g[0]: _Relay(g[0], self.loop, self.watch) for g in groups}
        self.uplinks = {g[0]: ReplayUplink(g[0], resolve, self.relays[g[0]].set_lease) for g in groups}
        for u in self.uplinks.values():
            u.start(self.loop)
        self.group_of = {n: g[0] for g in groups for n in g}
        self.nodes = sorted(self.group_of)
        self.decides = 0 in self.uplinks
        self._start_clocks(rpn, heartbeat_s, telemetry_s, seed)
        self.telemetry = {n: bytearray(telemetry_sample(n, rpn, self.t0, self._pid)) for n in self.nodes}
        self.telemetry_ts = {n: bytes(b).find(_TS_KEY + b"\xcb") + len(_TS_KEY) + 1 for n, b in self.telemetry.items()}

    def agents_count(self) -> int:
        return len(self.uplinks)

    def connected(self) -> int:
        return sum(u.connected for u in self.uplinks.values())

    def start(self) -> None:
        """The ranks start: every rank's START event, then the heartbeats and card samples."""
        from mindpulse.wire.protocol import EventKind, EventPacket

        def go() -> None:
            for g in self.groups:
                entries = [[n, {"steps": [], "other": [
                    EventPacket(rank=r, kind=EventKind.START.value, ts=time.time(), step=0, pid=self._pid + r % self.rpn,
                                host=f"host{n}").encode() for r in range(n * self.rpn, (n + 1) * self.rpn)],
                    "partials": [], "rejected": {}}] for n in g]
                self.uplinks[g[0]].send(entries)

        self.loop.call_soon_threadsafe(go)
        self._start_ticker()

    def frame_of(self, lead: int, step: int) -> tuple[bytes, int]:
        """Group `lead`'s entries of run step `step` (built step 0, or its place in the cycle)."""
        ts = self.templates[lead]
        t = ts[0] if step == 0 else ts[1 + (step - 1) % (len(ts) - 1)]
        return t.at(step), t.packets

    def send_step(self, step: int, decide: bool) -> float:
        """Every group's frame of `step` written to its uplink (node 0's leader then asks the
        decision at a candidate); returns when the last is written."""
        self.step = step
        frames = [(g[0], *self.frame_of(g[0], step)) for g in self.groups]
        done = threading.Event()

        def go() -> None:
            for lead, body, n in frames:
                self.uplinks[lead].send_packed(body, n)
            now = time.time()
            self.up_at[step] = self.sent_at[step] = now
            if decide and self.decides:
                asyncio.ensure_future(self._decide(step))
            done.set()

        self.loop.call_soon_threadsafe(go)
        done.wait(60)
        return self.sent_at.get(step, time.time())

    async def _decide(self, step: int) -> None:
        await self.uplinks[0].decide([], step, self.decision_timeout_s)
        self._decided(step)

    def _tick(self) -> None:
        """Heartbeats (one record per node, a group's nodes in one frame) and card samples
        (their timestamps written in) as they fall due, every relay flush window."""
        while not self._stop.wait(FLUSH_S):
            t = time.time()
            per: dict[int, dict[int, list[list[Any]]]] = {}
            step = self.step
            for r in self.beats.due(t):
                n = r // self.rpn
                per.setdefault(self.group_of[n], {}).setdefault(n, []).append(
                    [r, step, "in_step", step + 1, self._pid + r % self.rpn])  # as `Heartbeat.packet` in a step
            frames: dict[int, list[list[Any]]] = {lead: [[n, {"beats": rows}] for n, rows in nodes.items()]
                                                  for lead, nodes in per.items()}
            self.counts["heartbeats"] += sum(len(rows) for nodes in per.values() for rows in nodes.values())
            if self.samples is not None:
                ts = _F64.pack(t)
                for n in self.samples.due(t):
                    buf, o = self.telemetry[n], self.telemetry_ts[n]
                    buf[o:o + 8] = ts
                    frames.setdefault(self.group_of[n], []).append([n, {"other": [bytes(buf)]}])
                    self.counts["telemetry"] += 1
            if frames:
                self.counts["event_frames"] += len(frames)
                self.loop.call_soon_threadsafe(self._send_events, frames)

    def _send_events(self, frames: dict[int, list[list[Any]]]) -> None:
        for lead, entries in frames.items():
            self.uplinks[lead].send(entries)

    def close(self) -> dict[str, Any]:
        """Every frame acknowledged, then the uplinks closed."""
        self.stop_traffic()

        async def closed() -> int:
            return sum(await asyncio.gather(*(u.close(10) for u in self.uplinks.values())))

        lost = asyncio.run_coroutine_threadsafe(closed(), self.loop).result(30)
        return {"leader_frames": sum(u.stats["frames"] for u in self.uplinks.values()), "member_frames": 0,
                "group_calls": 0, "lost": lost, "dropped": sum(u.dropped for u in self.uplinks.values()),
                "bad_leases": sum(r.bad for r in self.relays.values()), **self.counts}

    def counters(self) -> dict[str, int]:
        return {**self.counts, "member_frames": 0,
                "leader_frames": sum(u.stats["frames"] for u in self.uplinks.values())}


def cycle_steps(steps: int) -> int:
    """Steps to build for a run of `steps`: the cycle (or fewer when the run is shorter)."""
    return min(steps, CYCLE)


__all__ = ["CYCLE", "Replay", "ReplayUplink", "Template", "cycle_steps", "group_frames"]
