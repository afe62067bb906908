"""The per-node packet relay: batching, grouped decisions, bad frames, a missing relay."""

from __future__ import annotations

import socket
import struct
import threading
import time

from mindpulse.node.relay import RelayServer
from mindpulse.protocol import Action, Directive, StepPacket
from mindpulse.workers.channel import RelayChannel as RelayClient


class Upstream:
    """A stand-in aggregator that records what the relay forwards."""

    def __init__(self, stop_at: int | None = None):
        self.sent: list[list[bytes]] = []
        self.decides: list[tuple[int, int]] = []
        self.stop_at = stop_at
        self.lock = threading.Lock()

    def send(self, batch):
        with self.lock:
            self.sent.append(list(batch))

    def decide(self, batch, step, timeout):
        with self.lock:
            self.decides.append((step, len(batch)))
        action = Action.STOP if self.stop_at is not None and step >= self.stop_at else Action.CONTINUE
        return Directive(step=step, action=action, reason="test").encode()


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
    deadline = time.time() + 5
    while sum(len(b) for b in up.sent) < 69 and time.time() < deadline:
        time.sleep(0.02)
    assert sum(len(b) for b in up.sent) == 69
    assert len(up.sent) < 69 / 4, "packets were not batched"
    c.close()
    srv.stop()


def test_decisions_of_a_nodes_ranks_go_up_as_one_call_and_fan_out():
    up = Upstream(stop_at=3)
    srv = RelayServer(up.send, up.decide, local_ranks=4)
    port = srv.start()
    clients = [RelayClient("127.0.0.1", port) for _ in range(4)]
    results: dict[int, Directive] = {}

    def rank(r):
        results[r] = clients[r].decide(pkt(r, 3, decision=True), 3)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert {r: d.action for r, d in results.items()} == {r: Action.STOP for r in range(4)}
    assert up.decides == [(3, 4)], "the node's four decide calls were not grouped into one"
    assert srv.stats["decide_calls"] == 1
    srv.stop()


def test_bad_frames_are_counted_and_the_relay_goes_on():
    up = Upstream()
    srv = RelayServer(up.send, up.decide, local_ranks=1)
    port = srv.start()
    s = socket.create_connection(("127.0.0.1", port))
    junk = b"\xc1\xc1not msgpack"
    s.sendall(struct.pack(">I", len(junk)) + junk)
    time.sleep(0.2)
    c = RelayClient("127.0.0.1", port)
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
