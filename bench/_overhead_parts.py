"""The rank's CPU per part of the monitor's path (bench/overhead.py's profiled run): which
functions make up each part, and the clocks wrapped around them for one run."""

from __future__ import annotations

import threading
import time
from typing import Any

VERDICT = "verdict (rank 0, every 10th step: asking and reading it, its CPU, not the wait)"
WEIGHTS_COPY = "candidate's weights copied to the host (rank 0, every 10th step)"
CALLBACKS_ALONE = "callback total, in a run with the callbacks alone clocked (the target's figure)"
"""The training thread's CPU in the callbacks, from a run of its own that wraps them alone."""
OUTBOX = "outbox thread: "
"""Prefix of a part's CPU on the rank's outbox thread (workers/outbox.py), beside the training
thread's: the packet's encoding and sending and the verdict's question run there."""
PARTS = {
    # part: the functions (module, class or None, name) whose time it is, on whichever thread runs them
    "reading the step's outputs (loss, statistics, learning rate)": [
        ("mindpulse.workers.monitor", "Monitor", "_split"), ("mindpulse.workers.monitor", "Monitor", "_probe_stats"),
        ("mindpulse.workers.monitor", None, "lr_of_step")],
    "collect steps: fingerprint and weight statistics": [
        ("mindpulse.workers.rank_weights", "RankWeights", "fingerprint"),
        ("mindpulse.workers.rank_weights", "RankWeights", "collect_later"),
        ("mindpulse.workers.weight_stats", "WeightStats", "collect"),
        ("mindpulse.workers.weight_stats", "WeightStats", "keep_previous")],
    "packet encode": [("mindpulse.wire.protocol", "StepPacket", "encode")],
    "channel send": [("mindpulse.workers.channel", "RelayChannel", "send_step")],
    VERDICT: [("mindpulse.workers.channel", "RelayChannel", "decide"),
              ("mindpulse.workers.channel", "RelayChannel", "decide_later"),
              ("mindpulse.workers.channel", "RelayChannel", "verdict")],
    WEIGHTS_COPY: [("mindpulse.workers.weights_copy", "WeightsCopy", "take")],
    "lease check": [("mindpulse.workers.session", "RankSession", "_check_lease")],
    "checkpoint saves a verdict asked for (rank 0; the file's write is left out here)": [
        ("mindpulse.workers.session", "RankSession", "_save")],
    "step hooks (faults, profiler)": [("mindpulse.workers.session", "RankSession", "before_step"),
                                      ("mindpulse.workers.session", "RankSession", "after_step")],
}
PART_TOTAL = [("mindpulse.workers.monitor", "Monitor", "on_train_step_begin"),
              ("mindpulse.workers.monitor", "Monitor", "on_train_step_end")]
PART_RECORD = ("mindpulse.workers.session", "RankSession", "_record")


class PartClocks:
    """The rank's CPU time in each part of the monitor's path, by thread: every function a part
    names is wrapped (for one run) to add its `time.thread_time()` span to the part, on the
    training thread (the one that enters the clocks: it runs `Model.train`) or on another (the
    rank's outbox). A wrapper costs well under a microsecond, so unlike a profiler the figures
    are the path's own. Nested functions are named once each (their spans are cumulative)."""

    def __init__(self, only_total: bool = False):
        """`only_total`: clock the callbacks alone (`PART_TOTAL`), so that the total carries no
        wrapper of the parts inside it (each costs ~2 us of thread clock reads a call)."""
        import importlib

        self.only_total = only_total
        self.spent: dict[tuple, float] = {}
        self.wall: dict[tuple, float] = {}
        self.calls: dict[tuple, int] = {}
        self.spent_elsewhere: dict[tuple, float] = {}
        """CPU of the same functions on threads other than the training thread."""
        self.spent_in_record: dict[tuple, float] = {}
        """The training thread's CPU of each function while `record` ran (the packet's build is
        `record` less these: the run's start and end also run some of them, outside `record`)."""
        self._record_depth = 0
        self.training = threading.get_ident()
        self._undo: list[tuple[Any, str, Any]] = []
        self._importlib = importlib

    def __enter__(self) -> PartClocks:
        keys = set(PART_TOTAL) if self.only_total else (
            {k for ks in PARTS.values() for k in ks} | set(PART_TOTAL) | {PART_RECORD})
        for key in keys:
            mod, cls, name = key
            owner = self._importlib.import_module(mod)
            if cls is not None:
                owner = getattr(owner, cls)
            own = name in vars(owner)  # else inherited: the wrapper goes on this class, then is removed
            orig = getattr(owner, name)
            self.spent[key], self.calls[key], self.spent_elsewhere[key] = 0.0, 0, 0.0

            def wrapped(*a, _orig=orig, _key=key, **kw):
                training = threading.get_ident() == self.training
                inside = training and self._record_depth > 0
                if training and _key == PART_RECORD:
                    self._record_depth += 1
                t, w = time.thread_time(), time.perf_counter()
                try:
                    return _orig(*a, **kw)
                finally:
                    spent = time.thread_time() - t
                    if training:
                        if _key == PART_RECORD:
                            self._record_depth -= 1
                        self.spent[_key] += spent
                        self.wall[_key] = self.wall.get(_key, 0.0) + time.perf_counter() - w
                        self.calls[_key] += 1
                        if inside:
                            self.spent_in_record[_key] = self.spent_in_record.get(_key, 0.0) + spent
                    else:
                        self.spent_elsewhere[_key] += spent

            setattr(owner, name, wrapped)
            self._undo.append((owner, name, orig if own else None))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, orig in reversed(self._undo):
            if orig is None:
                delattr(owner, name)
            else:
                setattr(owner, name, orig)

    def per_step(self, steps: int) -> dict[str, float]:
        """CPU seconds per step by part (parts do not overlap: the packet's build is `record`
        less what it calls that has a part of its own)."""

        def cum(keys) -> float:
            return sum(self.spent.get(k, 0.0) for k in keys)

        out = {part: cum(keys) for part, keys in PARTS.items()}
        # what the parts spent while `record` ran (inside `_ship`, or before it: a collect step that
        # is also a candidate copies and follows the last verdict before its packet), not at the
        # run's start (its fingerprint, its first lease) or end (the last verdict's save)
        inside = sum(self.spent_in_record.get(k, 0.0) for keys in PARTS.values() for k in keys)
        out["packet build (RankSession.record less the parts above)"] = max(0.0, cum([PART_RECORD]) - inside)
        total = cum(PART_TOTAL)
        out["rest of the callback"] = max(0.0, total - sum(out.values()))
        out["callback total"] = total
        # what the rank waited for (wall clock less its own CPU: blocked, not working)
        for name, keys in (("wait: the verdict (wall, less its CPU)", PARTS[VERDICT]),
                           ("wait: the lease (wall, less its CPU)", PARTS["lease check"])):
            out[name] = max(0.0, sum(self.wall.get(k, 0.0) - self.spent.get(k, 0.0) for k in keys))
        out["callback wall total"] = sum(self.wall.get(k, 0.0) for k in PART_TOTAL)
        # the outbox thread's share of each part (the packet build is the training thread's)
        for part, keys in PARTS.items():
            elsewhere = sum(self.spent_elsewhere.get(k, 0.0) for k in keys)
            if elsewhere:
                out[OUTBOX + part] = elsewhere
        return {k: v / steps for k, v in out.items()}
