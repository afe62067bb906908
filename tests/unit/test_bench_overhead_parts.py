"""The in-rank benchmark's per-part table (bench/_overhead_parts.py): parts never count one
function's time twice, whether a part runs inside the session's `_ship` or before it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from _overhead_parts import PART_RECORD, PART_TOTAL, PARTS, WEIGHTS_COPY, PartClocks  # noqa: E402


def test_the_packet_build_is_record_less_every_part_inside_it():
    """A collect step that is also rank 0's candidate copies the weights in `record` before
    `_ship` (workers/session.py `_copy_candidate_first`): the copy is its own part and must not
    be counted again in the packet's build, which is what `record` did besides its parts; and
    what a part spent outside `record` (the run's first lease, at its start) is not taken off it."""
    clocks = PartClocks()
    collect = "collect steps: fingerprint and weight statistics"
    spent = {PARTS[WEIGHTS_COPY][0]: 0.5, PARTS[collect][0]: 0.25, PARTS["lease check"][0]: 0.125,
             PARTS["reading the step's outputs (loss, statistics, learning rate)"][0]: 1.0}
    clocks.spent = {**spent, PART_RECORD: 2.0, PART_TOTAL[1]: 4.0}
    # inside `record`: all of the copy and the collect step, and the lease check less the run's
    # first lease (taken at the start, outside `record`)
    clocks.spent_in_record = {PARTS[WEIGHTS_COPY][0]: 0.5, PARTS[collect][0]: 0.25, PARTS["lease check"][0]: 0.0625}
    out = clocks.per_step(1)
    assert out["packet build (RankSession.record less the parts above)"] == pytest.approx(2.0 - 0.5 - 0.25 - 0.0625)
    # the rows hold each part's whole run (the start's lease too): the rest is what is left
    assert out["rest of the callback"] == pytest.approx(4.0 - 2.0 - 1.0 - 0.0625)
    assert sum(v for k, v in out.items() if k in PARTS or k.startswith("packet build")) + out["rest of the callback"] \
        == pytest.approx(out["callback total"]), "the parts add up to the callback's total"
