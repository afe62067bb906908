"""A check several launches share: the offline straggler scores are the live ones."""

from __future__ import annotations

from pathlib import Path

from mindpulse.metrics_store import read_packets
from mindpulse.protocol import StepPacket


def assert_offline_straggler_scores_are_the_live_ones(run_dir: Path, slow_rank: bool = True) -> None:
    """One straggler scorer: the views' offline scores (report, `top`: every rank's packets
    replayed through StragglerTracker, which runs the nodes' scorer per node) equal the live
    rule's (the node agents' medians, scored by the aggregator) at every step the live run scored."""
    from mindpulse.config import load_config
    from mindpulse.metrics_store import REDUCED, read_records
    from mindpulse.reducer import StragglerTracker, reduce_all

    cfg, _ = load_config(run_dir / "config.yaml")
    packets = [p for p in read_packets(run_dir / "metrics.msgpack") if isinstance(p, StepPacket)]
    tracker = StragglerTracker(cfg.monitor.straggler_window, cfg.world.ranks_per_node)
    offline = {}
    for red in reduce_all(packets, cfg.world.nodes * cfg.world.ranks_per_node):
        offline[red.step] = tracker.update(red)
    live = {rec["step"]: rec["straggler_scores"] for rec in read_records(run_dir / "metrics.msgpack")
            if rec.get("t") == REDUCED and rec.get("straggler_scores")}
    assert live, "the live run scored no step"
    if slow_rank:
        assert any(s < 0.7 for x in live.values() for s in x.values()), live
    for step, scores in live.items():
        assert {int(k): v for k, v in scores.items()} == {k: offline[step][k] for k in map(int, scores)}, step
