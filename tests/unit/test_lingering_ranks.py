"""Ranks that live on after their training ended (launcher/supervision.py `_lingering`): every
rank still running is named and ended together, and only once each is past
`monitor.exit_timeout_s` (a fresh-clone run named rank 0 as lingering a moment after its
training ended, with no stacks dumped for it: it had ended its training after rank 1)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from mindpulse.launcher.supervision import AttemptWatch


def _watch(world_size: int, limit: float, outcomes: dict | None = None) -> SimpleNamespace:
    cfg = SimpleNamespace(world=SimpleNamespace(world_size=world_size), monitor=SimpleNamespace(exit_timeout_s=limit))
    return SimpleNamespace(cfg=cfg, outcomes=outcomes or {})


def test_no_rank_is_named_before_every_running_one_is_past_the_limit():
    now = time.time()
    watch = _watch(2, 5.0)
    assert AttemptWatch._lingering(watch, {0: now - 2, 1: now - 9}) == [], \
        "rank 0 ended its training 2 s ago: it is not lingering yet, and neither is the run"
    assert AttemptWatch._lingering(watch, {0: now - 6, 1: now - 9}) == [0, 1]
    assert AttemptWatch._lingering(watch, {1: now - 9}) == [], "rank 0's training has not ended"
    exited = _watch(2, 5.0, outcomes={1: object()})
    assert AttemptWatch._lingering(exited, {0: now - 6, 1: now - 2}) == [0], "a rank that exited is not lingering"
