"""The per-node packet relay: batching, grouped decisions, bad frames, a missing relay."""

from __future__ import annotations

import socket
import struct
import threading
import time

from mindpulse.node.relay import RelayServer
from mindpulse.wire.directives import Directive, Lease
from mindpulse.wire.frames import decode_frame_body, encode_frame
from mindpulse.wire.protocol import Action, StepPacket, decode
from mindpulse.workers.channel import RelayChannel as RelayClient


class Upstream:
    """A stand-in aggregator that records what the relay forwards."""

    def __init__(self, stop_at: int | None = None):
        self.sent: list[list[bytes]] = []
        self.decides: list[tuple[int, int]] = []
        self.decided_batches: list[list[bytes]] = []
        self.stop_at = stop_at
        self.lock = threading.Lock()

    def send(self, batch):
        with self.lock:
            self.sent.append(list(batch))

    def packets(self) -> int:
        with self.lock:
            return sum(len(b) for b in self.sent)

    def wait_sent(self, n: int, timeout: float = 3.0, flush: RelayServer | None = None) -> None:
        """Until `n` packets went up (or `timeout`); with `flush`, that relay sends what it
        holds at every look (packets that did not complete a step wait for its timer)."""
        deadline = time.time() + timeout
        while self.packets() < n and time.time() < deadline:
            time.sleep(0.01)
            if flush is not None:
                flush.loop.call_soon_threadsafe(flush._flush)

    async def decide(self, batch, step, timeout):
        with self.lock:
            self.decides.append((step, len(batch)))
            self.decided_batches.append(list(batch))
        action = Action.STOP if self.stop_at is not None and step >= self.stop_at else Action.CONTINUE
        return Directive(step=step, action=action, reason="test").encode()


def raw_relay(**kw) -> tuple[Upstream, RelayServer, socket.socket]:
    """A relay for one local rank and a bare socket to it (frames written by hand, as a
    broken or hostile sender would)."""
    up = Upstream()
    srv = RelayServer(up.send, up.decide, local_ranks=1, **kw)
    return up, srv, socket.create_connection(("127.0.0.1", srv.start()))


def pkt(rank, step, decision=False):
    return StepPacket(rank=rank, step=step, loss=1.0, decision=decision).encode()


def test_fire_and_forget_packets_are_batched():
    up = Upstream()
    srv = RelayServer(up.send, up.decide, local_ranks=2)
    port = srv.start()
    c = RelayClient("127.0.0.1", port)
    for s in range(1, 70):
        c.send(pkt(0, s))
    c.flush()
    up.wait_sent(69, timeout=5)
    assert sum(len(b) for b in up.sent) == 69
    assert len(up.sent) < 69 / 4, "packets were not batched"
    c.close()
    srv.stop()


def test_decisions_of_a_nodes_ranks_go_up_as_one_call_and_fan_out():
    up = Upstream(stop_at=3)
    srv = RelayServer(up.send, up.decide, local_ranks=4)
    port = srv.start()
    clients = [RelayClient("127.0.0.1", port) for _ in range(4)]
    for c in clients:
        c._connect()
    # the four ranks' decide frames arrive together, as after the step's all-reduce (written
    # back to back from one thread: started in four threads, a loaded machine can spread them
    # past the relay's 20 ms grouping window, which made this test flaky)
    for r, c in enumerate(clients):
        assert c._write({"op": "decide", "packets": [pkt(r, 3, decision=True)], "step": 3, "timeout": 10.0})
    results = {r: Directive.decode(c._reply()["directive"]) for r, c in enumerate(clients)}
    assert {r: d.action for r, d in results.items()} == {r: Action.STOP for r in range(4)}
    assert up.decides == [(3, 4)], "the node's four decide calls were not grouped into one"
    assert srv.stats["decide_calls"] == 1
    srv.stop()


def test_bad_frames_are_counted_and_the_relay_goes_on():
    up, srv, s = raw_relay()
    junk = b"\xc1\xc1not msgpack"
    s.sendall(struct.pack(">I", len(junk)) + junk)
    time.sleep(0.2)
    c = RelayClient("127.0.0.1", srv.port)
    d = c.decide(pkt(0, 1, decision=True), 1)
    assert d.action is Action.CONTINUE and srv.stats["bad_frames"] == 1
    s.close()
    srv.stop()


def test_a_missing_relay_never_blocks_training():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    c = RelayClient("127.0.0.1", port)
    t0 = time.time()
    d = c.decide(pkt(0, 1, decision=True), 1)
    c.send(pkt(0, 2))
    c.flush()
    assert d.action is Action.CONTINUE and "no directive" in d.reason
    assert time.time() - t0 < 5 and c.failures >= 1


def push(srv: RelayServer, reduced: int, stop_after: int = -1) -> None:
    """The node's uplink handing the relay a new lease (in the relay's loop)."""
    lease = Lease(reduced_through=reduced, stop_after=stop_after, reason="r")
    srv.loop.call_soon_threadsafe(srv.set_lease, lease.encode())


def test_a_lease_at_hand_costs_no_wait_and_a_late_one_is_waited_for():
    up = Upstream()
    srv = RelayServer(up.send, up.decide, local_ranks=2, pushed_leases=True)
    c = RelayClient("127.0.0.1", srv.start(), decision_timeout_s=5.0)
    push(srv, 4)
    time.sleep(0.2)  # the lease of step 4 is at the relay before the rank asks
    lease, waited = c.lease(3)
    assert lease.reduced_through == 4 and waited == 0.0
    lease, waited = c.lease(4)
    assert waited == 0.0 and lease.reduced_through == 4, "the channel's own cache answered"
    threading.Timer(0.3, push, args=(srv, 6)).start()
    lease, waited = c.lease(5)
    assert lease.reduced_through == 6 and waited >= 0.25, (lease, waited)
    assert srv.stats["lease_pushes"] == 2, "one board write per change, not one per rank request"
    assert srv.stats["lease_answers"] == 2, "asked at the first lease and when it had to wait, never else"
    threading.Timer(0.2, push, args=(srv, 6, 8)).start()
    lease, _ = c.lease(7)
    assert lease.stopping and lease.stop_after == 8, "a decided stop grants the lease at once"
    c.close()
    srv.stop()


def test_a_step_goes_up_as_soon_as_every_rank_of_the_node_sent_it():
    up = Upstream()
    srv = RelayServer(up.send, up.decide, local_ranks=2)
    port = srv.start()
    a, b = RelayClient("127.0.0.1", port), RelayClient("127.0.0.1", port)
    a.send_step(pkt(0, 1), 1)
    b.send_step(pkt(1, 1), 1)
    up.wait_sent(1, timeout=2)
    assert [len(batch) for batch in up.sent] == [2], "one call for the node's step"
    a.close()
    b.close()
    srv.stop()


def test_without_an_aggregator_lease_no_rank_is_held():
    up = Upstream()
    srv = RelayServer(up.send, up.decide, local_ranks=1)
    c = RelayClient("127.0.0.1", srv.start(), decision_timeout_s=5.0)
    assert c.lease(10) == (None, 0.0)
    c.close()
    srv.stop()


def test_a_connection_without_the_runs_token_is_refused():
    up = Upstream()
    srv = RelayServer(up.send, up.decide, local_ranks=1, token="s3cret")
    port = srv.start()
    stranger, wrong, rank = (RelayClient("127.0.0.1", port), RelayClient("127.0.0.1", port, token="guess"),
                             RelayClient("127.0.0.1", port, token="s3cret"))
    for c, step in ((stranger, 1), (wrong, 2), (rank, 3)):
        c.send(pkt(0, step))
        c.flush()
    up.wait_sent(1)
    time.sleep(0.2)
    got = [decode(b).step for batch in up.sent for b in batch]
    assert got == [3], f"only the rank with the token gets through: {got}"
    assert srv.stats["refused_connections"] == 2, srv.stats
    assert srv.stats["lease_pushes"] == 0 and rank.lease(0) == (None, 0.0), "no lease service behind this relay"
    for c in (stranger, wrong, rank):
        c.close()
    srv.stop()


def test_frames_after_a_decision_wait_for_its_answer_and_keep_their_order():
    up, srv, s = raw_relay()
    frames = [encode_frame({"op": "decide", "packets": [pkt(0, 1, decision=True)], "step": 1, "timeout": 5,
                            "expect": 1})]
    frames += [encode_frame({"op": "send", "packets": [pkt(0, k)]}) for k in (2, 3)]
    stream = b"".join(frames)
    for i in range(0, len(stream), 7):  # one write cut anywhere: frames are split as they come
        s.sendall(stream[i:i + 7])
    s.settimeout(5)
    head = s.recv(4)
    answer = decode_frame_body(s.recv(struct.unpack(">I", head)[0]))
    assert Directive.decode(answer["directive"]).step == 1
    up.wait_sent(2)
    srv.loop.call_soon_threadsafe(srv._flush)
    time.sleep(0.1)
    assert [decode(b).step for b in up.decided_batches[0]] == [1], "the decision went up with its own packet"
    assert [decode(b).step for batch in up.sent for b in batch] == [2, 3], "later frames, in order, after it"
    s.close()
    srv.stop()


def test_without_a_lease_board_each_lease_is_answered_by_the_relay(monkeypatch):
    import mindpulse.node.relay as relay_mod

    def no_shm(*a, **k):
        raise OSError("no shared memory here")

    monkeypatch.setattr(relay_mod, "LeaseBoard", no_shm)
    up = Upstream()
    srv = RelayServer(up.send, up.decide, local_ranks=1, pushed_leases=True)
    c = RelayClient("127.0.0.1", srv.start(), decision_timeout_s=5.0)
    assert srv.board is None
    push(srv, 2)
    time.sleep(0.1)
    lease, waited = c.lease(2)
    assert lease.reduced_through == 2 and waited == 0.0 and c.board is None
    threading.Timer(0.3, push, args=(srv, 3)).start()
    lease, waited = c.lease(3)
    assert lease.reduced_through == 3 and waited >= 0.25, "still gated, by answers instead of the board"
    assert srv.stats["lease_answers"] == 2
    c.close()
    srv.stop()


def test_a_big_frame_in_the_same_read_as_the_hello_gets_through():
    up, srv, s = raw_relay(token="s3cret")
    big = [StepPacket(rank=0, step=k, loss=1.0, extra={f"m{i}": 1.0 for i in range(60)}).encode() for k in range(1, 6)]
    frame = encode_frame({"op": "send", "packets": big})
    assert len(frame) > 4096, "bigger than a hello may be"
    s.sendall(encode_frame({"op": "hello", "token": "s3cret"}) + frame)  # one write: the reconnect path
    up.wait_sent(5, flush=srv)
    assert sum(len(b) for b in up.sent) == 5 and srv.stats["refused_connections"] == 0, srv.stats
    s.close()
    srv.stop()


def test_a_frame_with_bad_insides_is_counted_and_the_connection_goes_on():
    up, srv, s = raw_relay()
    s.sendall(encode_frame({"op": "send", "packets": 7}) + encode_frame({"op": "send", "packets": [pkt(0, 1)]}))
    up.wait_sent(1, flush=srv)
    assert [decode(b).step for batch in up.sent for b in batch] == [1] and srv.stats["bad_frames"] == 1, srv.stats
    s.close()
    srv.stop()


def test_a_lease_too_long_for_the_board_goes_on_it_with_its_reason_cut():
    from mindpulse.wire.lease_board import LeaseView

    up = Upstream()
    srv = RelayServer(up.send, up.decide, local_ranks=1, pushed_leases=True)
    srv.start()
    view = LeaseView(srv.board.path)
    srv.loop.call_soon_threadsafe(srv.set_lease, Lease(reduced_through=5, stop_after=6, reason="r" * 9000).encode())
    deadline = time.time() + 3
    raw = None
    while time.time() < deadline:
        raw = view.read()
        if raw is not None and Lease.decode(raw).reduced_through == 5:
            break
        time.sleep(0.01)
    lease = Lease.decode(raw)
    assert (lease.reduced_through, lease.stop_after, lease.reason) == (5, 6, "r" * 256) and srv.board is not None
    path = srv.board.path
    view.close()
    srv.stop()
    import os

    assert not os.path.exists(path), "the relay removes its board when it stops"


class _Transport:
    def is_closing(self):
        return False

    def write(self, data):
        pass

    def close(self):
        pass


class NodeUpstream(Upstream):
    """Records the node batches (dicts) a pre-reducing relay sends."""

    def send(self, batch):
        self.sent.append(batch)

    async def decide(self, batch, step, timeout):
        self.decides.append((step, len(batch["steps"])))
        self.decided_batches.append(batch)
        return Directive(step=step, action=Action.CONTINUE, reason="test").encode()


def _prereducing_relay(ranks: int):
    from mindpulse.node.relay import NodePreReducer, _RankConnection

    up = NodeUpstream()
    srv = RelayServer(up.send, up.decide, local_ranks=ranks, prereduce=NodePreReducer(0, range(ranks)))
    conns = [_RankConnection(srv) for _ in range(ranks)]
    for c in conns:
        c.transport = _Transport()
    return up, srv, conns


def test_a_nodes_step_is_decoded_in_one_go_once_every_rank_sent_it():
    import asyncio

    async def go():
        up, srv, conns = _prereducing_relay(4)
        for r in range(3):
            srv._on_frame(conns[r], {"op": "send", "packets": [pkt(r, 1)], "step": 1})
            assert not up.sent, f"the step went up before every rank sent it (after rank {r})"
            assert not srv.prereduce.batch["steps"], "a packet was decoded before its step was whole"
        srv._on_frame(conns[3], {"op": "send", "packets": [pkt(3, 1)], "step": 1})
        assert len(up.sent) == 1, "the step did not go up at its last rank's packet"
        batch = up.sent[0]
        assert len(batch["steps"]) == 4 and [p["n"] for p in batch["partials"]] == [4]
        # a frame that does not say its step is filed at once (and a partial goes up when
        # it completes one), as before
        for r in range(4):
            srv._on_frame(conns[r], {"op": "send", "packets": [pkt(r, 2)]})
        assert len(up.sent) == 2 and [p["step"] for p in up.sent[1]["partials"]] == [2]
        srv._flush()  # what a timer would send: nothing is left
        assert len(up.sent) == 2

    asyncio.run(go())


def test_a_decision_sent_before_the_other_ranks_parts_does_not_hold_them_for_the_timer():
    """Rank 0 asks for the verdict of step 5 first; the other ranks' packets of step 5 then
    go up as soon as the last one is in (not after the relay's flush timer)."""
    import asyncio

    async def go():
        up, srv, conns = _prereducing_relay(4)
        srv._on_frame(conns[0], {"op": "decide", "packets": [pkt(0, 5, decision=True)], "step": 5,
                                 "timeout": 5.0, "expect": 1})
        for _ in range(5):  # the decision goes up with what the node has (rank 0's packet)
            await asyncio.sleep(0)
        assert up.decides == [(5, 1)], "the decision did not go up with rank 0's packet alone"
        for r in (1, 2, 3):
            srv._on_frame(conns[r], {"op": "send", "packets": [pkt(r, 5)], "step": 5})
        assert len(up.sent) == 1, "the other ranks' parts of the decided step waited for the timer"
        assert len(up.sent[0]["steps"]) == 3 and [p["n"] for p in up.sent[0]["partials"]] == [4]
        for c in conns:
            c.close()

    asyncio.run(go())


def test_a_packet_the_pre_reducer_chokes_on_costs_only_itself():
    """An error while filing one held packet is counted; the node's other packets still go
    up, and a decision waiting on them is still answered."""
    import asyncio

    async def go():
        up, srv, conns = _prereducing_relay(2)
        real_add = srv.prereduce.add
        bad = pkt(1, 1)

        def add(raw):
            if raw == bad:
                raise OverflowError("a value the reduction cannot take")
            return real_add(raw)

        srv.prereduce.add = add
        srv._on_frame(conns[1], {"op": "send", "packets": [bad], "step": 1})
        srv._on_frame(conns[1], {"op": "send", "packets": [pkt(1, 2)], "step": 2})
        srv._on_frame(conns[0], {"op": "send", "packets": [pkt(0, 1)], "step": 1})
        assert len(up.sent) == 1 and len(up.sent[0]["steps"]) == 2, "packets held with the bad one were lost"
        assert srv.stats["bad_packets"] == 1
        srv._on_frame(conns[0], {"op": "decide", "packets": [pkt(0, 2, decision=True)], "step": 2,
                                 "timeout": 5.0, "expect": 1})
        for _ in range(5):
            await asyncio.sleep(0)
        assert up.decides == [(2, 1)], "the decision did not go up with rank 0's packet"
        assert [(p["step"], p["n"]) for p in up.decided_batches[0]["partials"]] == [(2, 2)], \
            "the decided step's partial lacks a rank's packet filed with the bad one"
        for c in conns:
            c.close()

    asyncio.run(go())
