"""What the ranks' own setup tells the user to change (aggregator/advice.py)."""

from __future__ import annotations

import json

from mindpulse.aggregator.advice import Advice
from mindpulse.wire.protocol import EventKind, EventPacket


def _dir_event(rank: int, callback: str, directory: str) -> EventPacket:
    return EventPacket(rank=rank, kind=EventKind.ADVICE.value, message=json.dumps(
        {"kind": "shared_directory", "callback": callback, "directory": directory}))


def test_a_directory_two_ranks_share_is_said_once_naming_the_callback_and_what_to_change():
    a = Advice(world_size=4)
    assert a.on_event(_dir_event(0, "ModelCheckpoint", "/data/ckpt")) == []  # one rank: nothing shared yet
    said = a.on_event(_dir_event(2, "ModelCheckpoint", "/data/ckpt"))
    assert len(said) == 1 and "ModelCheckpoint of ranks 0,2 writes the same directory /data/ckpt" in said[0]
    assert "rank 0 only" in said[0]
    assert a.on_event(_dir_event(3, "ModelCheckpoint", "/data/ckpt")) == []  # said already
    # rank-specific directories never clash
    assert a.on_event(_dir_event(0, "SummaryCollector", "/data/summary/rank_0")) == []
    assert a.on_event(_dir_event(1, "SummaryCollector", "/data/summary/rank_1")) == []
    (rec,) = a.to_list()
    assert rec["kind"] == "shared_directory" and rec["ranks"] == [0, 2, 3] and rec["directory"] == "/data/ckpt"


def test_every_rank_sharing_says_all_and_bad_messages_are_ignored():
    a = Advice(world_size=2)
    a.on_event(_dir_event(0, "SummaryCollector", "/s"))
    (line,) = a.on_event(_dir_event(1, "SummaryCollector", "/s"))
    assert "of all 2 ranks" in line and "summary_dir" in line
    assert a.on_event(EventPacket(rank=0, kind=EventKind.ADVICE.value, message="not json")) == []
    assert a.on_event(EventPacket(rank=0, kind=EventKind.ADVICE.value, message="[1, 2]")) == []


def test_ranks_without_a_monitor_group_by_reason_until_their_monitor_starts():
    a = Advice(world_size=3)
    msg = json.dumps({"why": "the script ended without creating mindpulse's Monitor", "fix": "add it"})
    for r in (2, 0):
        a.on_event(EventPacket(rank=r, kind=EventKind.NO_MONITOR.value, message=msg))
    other = json.dumps({"why": "Model.train runs without mindpulse's Monitor", "fix": "turn auto_monitor on"})
    a.on_event(EventPacket(rank=1, kind=EventKind.NO_MONITOR.value, message=other))
    recs = a.to_list()
    assert [(r["ranks"], r["fix"]) for r in recs] == [([0, 2], "add it"), ([1], "turn auto_monitor on")]
    a.on_event(EventPacket(rank=1, kind=EventKind.START.value))
    assert [r["ranks"] for r in a.to_list()] == [[0, 2]]


def test_checkpoints_with_their_own_file_prefix_in_one_directory_do_not_clash():
    a = Advice(world_size=2)
    for r in (0, 1):
        msg = json.dumps({"kind": "shared_directory", "callback": "ModelCheckpoint", "directory": "/ck",
                          "prefix": f"rank{r}"})
        assert a.on_event(EventPacket(rank=r, kind=EventKind.ADVICE.value, message=msg)) == []
    assert a.to_list() == []
