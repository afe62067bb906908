"""Coverage-guided fuzzing of the aggregator's input (atheris): random and mutated packets
through decode and AggregatorCore.ingest must never raise; rejects are counted.

Run: python tests/fuzz/fuzz_aggregator.py -runs=20000 (the unit test does)."""

import sys
import tempfile

import atheris

with atheris.instrument_imports():
    from mindpulse.aggregator.core import AggregatorCore
    from mindpulse.wire import protocol as packets
    from mindpulse.wire.protocol import EventKind, EventPacket, PacketError, StepPacket, TelemetryPacket


def seeds() -> list[bytes]:
    """One of every packet kind, and a sequence mixing them (a step completed by two ranks
    with an event and a telemetry sample in between)."""
    one = [StepPacket(rank=0, step=1, loss=1.0, decision=True, extra={"a": 1.0}).encode(),
           TelemetryPacket(node="n0", ts=1.0, source="psutil", cards=[{"card": 0, "util_pct": 50.0, "ranks": [0]}],
                           host={"cpu_pct": 10.0, "processes": [{"rank": 0, "pid": 1}]}).encode()]
    one += [EventPacket(rank=1, kind=k.value, step=1, message='[{"step": 1, "path": "a", "kind": "best"}]').encode()
            for k in EventKind]
    seq = SEQ + SPLIT.join([StepPacket(rank=0, step=2, loss=1.0).encode(), one[1], one[2],
                            StepPacket(rank=1, step=2, loss=float("nan")).encode()])
    return one + [seq]

SEQ = b"SEQ"
"""An input starting with this is a sequence of packets (split at SPLIT), ingested as one batch."""
SPLIT = b"\x00\xff\x00"
SEEDS = seeds()
CORE = AggregatorCore(tempfile.mkdtemp(prefix="mp-fuzz-"), world_size=2, settings={"tensorboard": False})
SEEN = {"n": 0}


def one(data: bytes) -> None:
    batch = data[len(SEQ):].split(SPLIT) if data.startswith(SEQ) else [data]
    for raw in batch:
        try:
            packets.decode(raw)
        except PacketError:
            pass
    before = CORE.accepted + sum(CORE.rejected.values())
    CORE.ingest(batch)
    after = CORE.accepted + sum(CORE.rejected.values())
    # each packet is accepted or rejected once (a packet applied with an error is counted twice)
    assert after >= before + len(batch), "a packet was neither accepted nor rejected"
    SEEN["n"] += 1
    if SEEN["n"] % 5000 == 0:  # memory stays bounded
        assert len(CORE.reducer.pending_steps()) <= CORE.reducer.max_pending


if __name__ == "__main__":
    atheris.Setup(sys.argv, one)
    atheris.Fuzz()
