"""Coverage-guided fuzzing of the aggregator's input (atheris): random and mutated packets
through decode and AggregatorCore.ingest must never raise; rejects are counted.

Run: python tests/fuzz/fuzz_aggregator.py -runs=20000 (the unit test does)."""

import sys
import tempfile

import atheris

with atheris.instrument_imports():
    from mindpulse import protocol as packets
    from mindpulse.aggregator.core import AggregatorCore
    from mindpulse.protocol import PacketError, StepPacket

SEEDS = [StepPacket(rank=0, step=1, loss=1.0, decision=True, extra={"a": 1.0}).encode()]
CORE = AggregatorCore(tempfile.mkdtemp(prefix="mp-fuzz-"), world_size=2, settings={"tensorboard": False})
SEEN = {"n": 0}


def one(data: bytes) -> None:
    try:
        packets.decode(data)
    except PacketError:
        pass
    before = CORE.accepted + sum(CORE.rejected.values())
    CORE.ingest([data])
    assert CORE.accepted + sum(CORE.rejected.values()) == before + 1, "a packet was neither accepted nor rejected"
    SEEN["n"] += 1
    if SEEN["n"] % 5000 == 0:  # memory stays bounded
        assert len(CORE.reducer.pending_steps()) <= CORE.reducer.max_pending


if __name__ == "__main__":
    atheris.Setup(sys.argv, one)
    atheris.Fuzz()
