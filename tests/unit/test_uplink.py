"""The node uplink (mindpulse/wire/uplink.py): node batches reach a real aggregator core over a
real socket, the lease comes back pushed, nothing is lost across a server restart, and a
peer without the token or speaking garbage is cut off."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from mindpulse.aggregator.core import AggregatorCore
from mindpulse.node.relay import NodePreReducer
from mindpulse.rundir.metrics_store import read_wire
from mindpulse.wire.directives import Directive, Lease
from mindpulse.wire.frames import encode_frame
from mindpulse.wire.protocol import Action, StepPacket
from mindpulse.wire.uplink import Uplink, UplinkServer


class Loop:
    """An event loop in a thread of its own (as the aggregator actor's and a relay's)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout=10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn, *args):
        async def go():
            return fn(*args)
        return self.run(go())

    def close(self):
        if not self.thread.is_alive():  # closed already (a test's process that died)
            return

        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def serve(loop: Loop, core: AggregatorCore, seen: list | None = None) -> UplinkServer:
    def ingest(entries):
        if seen is not None:
            seen.append(entries)
        core.ingest_nodes(entries)
        server.push_lease()  # as the aggregator actor does once it reduced steps

    async def directive(step, timeout):
        deadline = time.monotonic() + timeout
        while core.directive_for(step) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        d = core.directive_for(step)
        return (d or Directive.no_directive(step, "timeout")).encode()

    server = UplinkServer(ingest, directive, lambda: core.lease().encode())
    loop.run(server.start("127.0.0.1"))
    return server


def step_packet(r: int, s: int, **kw) -> StepPacket:
    return StepPacket(rank=r, step=s, loss=1.0 + 0.01 * r, grad_norm=1.0, step_time_s=0.1, samples=4,
                      ts=float(s), **kw)


def wait_for(cond, what: str, timeout: float = 5.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def loops():
    made: list[Loop] = []

    def make() -> Loop:
        made.append(Loop())
        return made[-1]

    yield make
    for lp in made:
        lp.close()


def test_node_batches_reach_the_core_and_the_lease_comes_back_pushed(tmp_path, loops):
    core = AggregatorCore(tmp_path, world_size=2, settings={"tensorboard": False,
                                                             "world": {"nodes": 1, "ranks_per_node": 2}})
    agg, node = loops(), loops()
    server = serve(agg, core)
    leases: list[Lease] = []
    up = Uplink(0, lambda: server.address, lambda raw: leases.append(Lease.decode(raw)))
    up.start(node.loop)
    pre = NodePreReducer(0, range(2), world_size=2)
    for s in range(1, 6):
        for r in range(2):
            pre.add(step_packet(r, s).encode())
        node.call(up.send, [(0, pre.take())])
        wait_for(lambda s=s: leases and leases[-1].reduced_through >= s, f"the lease of step {s} pushed down")
    assert core.last_reduced.step == 5 and core.last_reduced.ranks_reported == 2
    wait_for(lambda: up.unacked == 0, "every frame acknowledged")
    assert node.run(up.close(1)) == 0, "nothing lost"
    agg.run(server.close())
    core.close()
    stored = sorted((o["rank"], o["step"]) for o in read_wire(tmp_path / "metrics.msgpack") if o.get("t") == "step")
    assert stored == [(r, s) for r in range(2) for s in range(1, 6)], "every raw packet is stored once"


def test_a_decision_is_answered_once_its_step_is_reduced(tmp_path, loops):
    core = AggregatorCore(tmp_path, world_size=1, settings={"tensorboard": False})
    agg, node = loops(), loops()
    server = serve(agg, core)
    up = Uplink(0, lambda: server.address, lambda raw: None)
    up.start(node.loop)
    pre = NodePreReducer(0, range(1), world_size=1)
    core.request_stop("test stop")
    pre.add(step_packet(0, 1, decision=True).encode())
    raw = node.run(up.decide([(0, pre.take())], 1, 5.0))
    d = Directive.decode(raw)
    assert d.step == 1 and d.action is Action.CONTINUE and not d.reason, f"step 1's own directive: {d}"
    assert core.stop is not None and core.stop["step"] == 2, "the stop applies after max_lag_steps"
    pre.add(step_packet(0, 2, decision=True).encode())
    d = Directive.decode(node.run(up.decide([(0, pre.take())], 2, 5.0)))
    assert d.step == 2 and d.action is Action.STOP, d
    node.run(up.close(1))
    agg.run(server.close())
    core.close()


def test_nothing_is_lost_when_the_server_restarts(tmp_path, loops):
    """Frames sent while the server is gone wait, unacknowledged, and go to the new one in
    order; frames the old one acknowledged are not sent again."""
    core = AggregatorCore(tmp_path, world_size=1, settings={"tensorboard": False})
    agg, node = loops(), loops()
    seen: list = []
    servers = [serve(agg, core, seen)]
    up = Uplink(0, lambda: servers[-1].address, lambda raw: None)
    up.start(node.loop)
    pre = NodePreReducer(0, range(1), world_size=1)

    def send(s):
        pre.add(step_packet(0, s).encode())
        node.call(up.send, [(0, pre.take())])

    for s in (1, 2):
        send(s)
    wait_for(lambda: up.unacked == 0, "steps 1-2 acknowledged")
    agg.run(servers[0].close())
    wait_for(lambda: not up.connected, "the uplink to see the server gone")
    for s in (3, 4, 5):
        send(s)
    assert up.unacked == 3, "frames sent while the server is gone wait"
    servers.append(serve(agg, core, seen))
    wait_for(lambda: up.unacked == 0, "the waiting frames acknowledged by the new server", timeout=10)
    steps = [p["step"] for entries in seen for _, b in entries for p in b["partials"]]
    assert steps == [1, 2, 3, 4, 5], f"each step once, in order: {steps}"
    assert core.last_reduced.step == 5
    assert up.stats["connections"] == 2
    node.run(up.close(1))
    agg.run(servers[-1].close())
    core.close()


def test_a_redirect_while_the_first_address_resolves_is_not_lost(tmp_path, loops):
    """A group member is told to follow its leader (`redirect`) while its uplink still resolves
    the aggregator's address (a busy machine: Ray's call takes seconds): it must not stay on the
    aggregator for the rest of the run. Seen in a fresh-clone run: no step of a two-host group
    came merged, the member's batches all went to the aggregator."""
    core = AggregatorCore(tmp_path, world_size=1, settings={"tensorboard": False})
    agg, node = loops(), loops()
    to_aggregator: list = []
    to_leader: list = []
    aggregator, leader = serve(agg, core, to_aggregator), serve(agg, core, to_leader)
    target = [aggregator]
    resolving, go_on = threading.Event(), threading.Event()

    def resolve():
        where = target[0].address  # read as the agent does: before the answer comes back
        resolving.set()
        go_on.wait(10)
        return where

    up = Uplink(0, resolve, lambda raw: None)
    up.start(node.loop)
    assert resolving.wait(5), "the uplink never resolved"
    target[0] = leader  # NodeAgent.follow: the leader first, then the redirect
    up.redirect()
    time.sleep(0.1)  # the redirect lands in the loop while the resolve still waits
    go_on.set()
    pre = NodePreReducer(0, range(1), world_size=1)
    pre.add(step_packet(0, 1).encode())
    node.call(up.send, [(0, pre.take())])
    wait_for(lambda: up.unacked == 0, "step 1 acknowledged")
    assert to_leader and not to_aggregator, \
        f"the step went to the aggregator ({len(to_aggregator)} frames), not the leader ({len(to_leader)})"
    assert up.stats["redirected_while_connecting"] == 1
    assert up.stats["connect_errors"] == 0 and up.last_error == "", "going elsewhere is no connection error"
    node.run(up.close(1))
    agg.run(aggregator.close())
    agg.run(leader.close())
    core.close()


def test_a_group_leader_acknowledges_a_members_frame_once_the_aggregator_has_all_of_it(tmp_path, loops,
                                                                                       monkeypatch):
    """A leader (node/group.py, behind an `UplinkServer(deferred_acks=True)`) holds a
    member's frame unacknowledged while it merges the step the frame carried, and
    acknowledges it once the aggregator acknowledged the merged step. A leader that dies
    holding a step loses nothing: the member sends the frame again, to the aggregator."""
    from mindpulse.node import group as group_mod
    from mindpulse.node.group import GroupLeader

    monkeypatch.setattr(group_mod, "STRAGGLE_S", 60.0)  # a held step stays held (no early solo send)
    core = AggregatorCore(tmp_path, world_size=2, settings={"tensorboard": False,
                                                             "world": {"nodes": 2, "ranks_per_node": 1}})
    agg, lead, member = loops(), loops(), loops()
    agg_server = serve(agg, core)
    up0 = Uplink(0, lambda: agg_server.address, lambda raw: None)  # the leader node's own uplink
    up0.start(lead.loop)
    leader = GroupLeader(0, [0, 1], up0.send_threadsafe)

    def ingest(entries, receipt):
        for node, batch in entries:
            leader.add(node, batch, receipt)

    async def directive(step, timeout):
        return Directive.no_directive(step, "not asked here").encode()

    lead_server = UplinkServer(ingest, directive, lambda: core.lease().encode(), deferred_acks=True)
    lead.run(lead_server.start("127.0.0.1"))
    target = [lead_server.address]
    up1 = Uplink(1, lambda: target[0], lambda raw: None)  # the member's uplink: to the leader
    up1.start(member.loop)
    pre0, pre1 = NodePreReducer(0, range(0, 1), world_size=2), NodePreReducer(1, range(1, 2), world_size=2)
    try:
        # step 1: the member's part waits at the leader for node 0's, unacknowledged
        pre1.add(step_packet(1, 1).encode())
        member.call(up1.send, [(1, pre1.take())])
        wait_for(lambda: lead_server.stats["frames"] >= 1, "the leader to receive the member's frame")
        time.sleep(0.3)
        assert up1.unacked == 1, "the leader acknowledged a frame whose step it still holds"
        pre0.add(step_packet(0, 1).encode())
        leader.add(0, pre0.take())
        wait_for(lambda: core.last_reduced is not None and core.last_reduced.step == 1, "step 1 reduced")
        wait_for(lambda: up1.unacked == 0, "the member's frame acknowledged once the aggregator has its step")

        # step 2: the member's part reaches the leader, which dies before node 0's part comes
        pre1.add(step_packet(1, 2).encode())
        member.call(up1.send, [(1, pre1.take())])
        wait_for(lambda: lead_server.stats["frames"] >= 2, "the leader to receive step 2")
        time.sleep(0.3)  # the raw packets go up (FLUSH_S); the partial stays held
        assert up1.unacked == 1, "the leader acknowledged step 2 while it still merges it"
        target[0] = agg_server.address  # where the member resolves once its leader is gone
        lead.close()  # the leader dies: its connections drop, its held step with it
        wait_for(lambda: up1.stats["connections"] >= 2, "the member to reach the aggregator", timeout=10)
        up0b = Uplink(0, lambda: agg_server.address, lambda raw: None)  # node 0, now on its own
        up0b.start(member.loop)
        pre0.add(step_packet(0, 2).encode())
        member.call(up0b.send, [(0, pre0.take())])
        wait_for(lambda: core.last_reduced.step == 2, "step 2 reduced from the member's frame sent again", timeout=10)
        assert core.last_reduced.ranks_reported == 2
        wait_for(lambda: up1.unacked == 0, "the member's step 2 acknowledged by the aggregator")
        member.run(up0b.close(1))
        member.run(up1.close(1))
    finally:
        leader._stopped.set()  # a dead leader sends nothing more
    agg.run(agg_server.close())
    core.close()


def test_a_full_queue_drops_and_counts_instead_of_growing(loops):
    node = loops()
    up = Uplink(0, lambda: ("127.0.0.1", 1, "x"), lambda raw: None, max_unacked=3)  # nothing listens there
    up.start(node.loop)
    batch = {"steps": [b"a", b"b"], "other": [b"c"], "partials": [], "rejected": {}}
    for _ in range(5):
        node.call(up.send, [(0, batch)])
    assert up.unacked == 3 and up.dropped == 6, (up.unacked, up.dropped)
    assert node.run(up.close(0.2)) == 9, "the unacknowledged packets are reported lost at close"


def test_a_peer_without_the_token_or_speaking_garbage_is_cut_off(tmp_path, loops):
    core = AggregatorCore(tmp_path, world_size=1, settings={"tensorboard": False})
    agg = loops()
    server = serve(agg, core)
    host, port, token = server.address

    def closed(sock: socket.socket) -> bool:
        sock.settimeout(5)
        try:
            while True:
                data = sock.recv(4096)
                if not data:
                    return True
        except OSError:
            return True

    with socket.create_connection((host, port)) as s:
        s.sendall(encode_frame({"op": "hello", "token": "wrong", "node": 0}))
        assert closed(s), "a wrong token must close the connection"
    with socket.create_connection((host, port)) as s:
        s.sendall(encode_frame({"op": "hello", "token": token, "node": 0}))
        s.sendall(encode_frame({"op": "send", "seq": "one", "entries": []}))
        assert closed(s), "a malformed frame must close the connection"
    with socket.create_connection((host, port)) as s:
        s.sendall(encode_frame({"op": "hello", "token": token, "node": 0}))
        s.sendall(b"\xff\xff\xff\xff")  # a frame longer than the limit
        assert closed(s), "an oversized frame must close the connection"
    with socket.create_connection((host, port)) as s:
        s.sendall(encode_frame({"op": "hello", "token": token, "node": 0}))
        s.sendall(encode_frame({"op": "send", "seq": 1, "entries": [["node0", {"steps": []}]]}))
        assert closed(s), "an entry whose node is not a node id must close the connection"
    wait_for(lambda: server.stats["refused_connections"] == 1 and server.stats["bad_frames"] == 3,
             f"the refusals counted: {dict(server.stats)}")
    assert core.accepted == 0
    agg.run(server.close())
    core.close()


def test_what_one_turn_of_the_loop_sends_a_connection_leaves_in_one_write():
    """The lease a node's frame completed and that frame's ack go out in one write (the node
    wakes once for both), in the order they were made; a closed connection gets nothing."""

    class Writer:
        def __init__(self, closing=False):
            self.writes: list[bytes] = []
            self.closing = closing

        def write(self, data):
            self.writes.append(data)

        def is_closing(self):
            return self.closing

    async def go():
        server = UplinkServer(lambda entries: None, None, lambda: b"lease")
        w, gone = Writer(), Writer(closing=True)
        lease, ack = encode_frame({"lease": b"x"}), encode_frame({"ack": 3})
        server._write(w, lease)
        server._write(w, ack)
        server._write(gone, ack)
        assert w.writes == [], "written before the turn of the loop ended"
        await asyncio.sleep(0)
        assert w.writes == [lease + ack]
        assert gone.writes == []
        server._write(w, ack)  # the next turn: a write of its own
        await asyncio.sleep(0)
        assert w.writes == [lease + ack, ack]

    asyncio.run(go())


class _StreamWriter:
    """What `UplinkServer` writes to a connection, kept (an asyncio.StreamWriter's surface)."""

    def __init__(self):
        self.writes: list[bytes] = []

    def write(self, data):
        self.writes.append(data)

    def is_closing(self):
        return False

    async def drain(self):
        await asyncio.sleep(0)

    def close(self):
        pass


def frames(data: bytes) -> list[dict]:
    """The frames one write held, decoded."""
    from mindpulse.wire.frames import decode_frame_body

    out, at = [], 0
    while at < len(data):
        n = int.from_bytes(data[at:at + 4], "big")
        out.append(decode_frame_body(data[at + 4:at + 4 + n]))
        at += 4 + n
    return out


def test_a_decide_frame_that_decides_its_step_is_answered_in_the_write_of_its_ack():
    """Rank 0's decision at a checkpoint candidate: when ingesting the frame decided the step,
    the directive leaves with the frame's ack and the lease, in one write, without a task
    waiting for it (each write wakes the node agent, and rank 0 waits for this one)."""

    async def go():
        decided: dict[int, bytes] = {}
        leases = iter([b"lease-0", b"lease-7"])
        lease = {"now": next(leases)}

        def ingest(entries):  # the frame completes step 7: decided, the lease moves
            decided[7] = Directive(step=7, save="best").encode()
            lease["now"] = next(leases)
            server.push_lease()

        async def slow_directive(step, timeout):
            await asyncio.sleep(0.5)
            return Directive.no_directive(step, "asked the slow way").encode()

        server = UplinkServer(ingest, slow_directive, lambda: lease["now"], directive_now=decided.get)
        server._writers = set()
        reader, w = asyncio.StreamReader(), _StreamWriter()
        reader.feed_data(encode_frame({"op": "hello", "token": server.token, "node": 0}))
        client = asyncio.ensure_future(server._client(reader, w))
        for _ in range(5):
            await asyncio.sleep(0)
        assert [frames(x) for x in w.writes] == [[{"lease": b"lease-0"}]], w.writes
        reader.feed_data(encode_frame({"op": "decide", "seq": 1, "entries": [[0, {"steps": []}]], "step": 7,
                                       "timeout": 5.0}))
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(w.writes) == 2, f"the answer came in {len(w.writes) - 1} writes: {w.writes[1:]}"
        got = frames(w.writes[1])
        assert got[0] == {"lease": b"lease-7"} and {"ack": 1} in got, got
        answer = [f for f in got if "directive" in f]
        assert answer and answer[0]["seq"] == 1 and Directive.decode(answer[0]["directive"]).save == "best", got
        reader.feed_eof()
        await client

    asyncio.run(go())


def test_a_decide_that_came_before_its_step_is_answered_with_the_lease_before_the_views():
    """With groups or several nodes, rank 0's decide reaches the aggregator before the step's
    last partial. When that partial completes the step, the verdict leaves in the same turn
    of the loop as the lease (`answer_ready`), before the step's views are drawn, and once
    only: the waiting task, woken later, writes nothing more."""
    order: list[str] = []

    class Writer(_StreamWriter):
        def write(self, data):
            super().write(data)
            if b"directive" in data:
                order.append("verdict")

    async def go():
        decided: dict[int, bytes] = {}
        reduced = asyncio.Condition()

        async def directive(step, timeout):  # as the aggregator actor waits: on its condition
            async with reduced:
                await asyncio.wait_for(reduced.wait_for(lambda: step in decided), timeout)
            return decided[step]

        async def ingest(entries):
            if entries[0][1].get("last"):  # the step's last partial: decided; then as AggregatorActor._moved
                decided[7] = Directive(step=7, save="best").encode()
                async with reduced:
                    reduced.notify_all()
                server.push_lease()
                server.answer_ready()
                asyncio.get_running_loop().call_soon(order.append, "views")

        server = UplinkServer(ingest, directive, lambda: b"lease-7" if 7 in decided else b"lease-6",
                              directive_now=decided.get)
        early, late = (asyncio.StreamReader(), Writer()), (asyncio.StreamReader(), Writer())
        for reader, _ in (early, late):
            reader.feed_data(encode_frame({"op": "hello", "token": server.token, "node": 0}))
        tasks = [asyncio.ensure_future(server._client(r, w)) for r, w in (early, late)]
        for _ in range(5):
            await asyncio.sleep(0)
        early[0].feed_data(encode_frame({"op": "decide", "seq": 1, "entries": [[0, {"steps": []}]], "step": 7,
                                         "timeout": 5.0}))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not any("directive" in f for x in early[1].writes for f in frames(x)), "answered before step 7"
        order.clear()
        late[0].feed_data(encode_frame({"op": "send", "seq": 1, "entries": [[1, {"steps": [], "last": True}]]}))
        for _ in range(10):
            await asyncio.sleep(0)
        answers = [f for x in early[1].writes for f in frames(x) if "directive" in f]
        assert len(answers) == 1 and answers[0]["seq"] == 1, answers
        assert Directive.decode(answers[0]["directive"]).save == "best"
        assert order[:2] == ["verdict", "views"], \
            f"the verdict must leave before the views are drawn: {order}"
        assert server.stats["answered_ready"] == 1
        for reader, _ in (early, late):
            reader.feed_eof()
        await asyncio.gather(*tasks)

    asyncio.run(go())
