"""A check several launches share: the offline straggler scores are the live ones."""

from __future__ import annotations

from pathlib import Path

from mindpulse.rundir.metrics_store import REDUCED, read_records
from mindpulse.views.run_reader import RunReader


def assert_offline_straggler_scores_are_the_live_ones(run_dir: Path, slow_rank: bool = True) -> None:
    """One straggler scorer: the views' offline scores (report and `top` read the run through
    RunReader, which replays every rank's packets through the base's StragglerTracker, the
    nodes' scorer run per node) equal the live rule's (the node agents' medians, scored by the
    aggregator) at every step the live run scored."""
    reader = RunReader(run_dir, history=True)
    reader.poll()
    # every step rebuilt from the ranks' packets: a step the reader took from the aggregator's
    # own reduced record would carry the live scores and compare them with themselves
    assert all(a.from_records == 0 for a in reader.attempts.values()), reader.attempts
    offline = {red.step: red.straggler_scores for red in reader.reduced}
    live = {rec["step"]: rec["straggler_scores"] for rec in read_records(run_dir / "metrics.msgpack")
            if rec.get("t") == REDUCED and rec.get("straggler_scores")}
    assert live, "the live run scored no step"
    if slow_rank:
        assert any(s < 0.7 for x in live.values() for s in x.values()), live
    for step, scores in live.items():
        assert step in offline, f"step {step}: the live run scored it, the views did not reduce it"
        assert {int(k): v for k, v in scores.items()} == {k: offline[step].get(k) for k in map(int, scores)}, (
            step, scores, offline[step])
