"""The tree's second level: a group leader between the node agents and the aggregator.

One aggregator actor drains about 1,900 calls a second on a 2-core machine, so a job of
4,096 nodes at 2 steps/s cannot make one call per node and step. Nodes are grouped
(`monitor.group_size`; 64-node groups by default once a job has more than 64 nodes) and
each group's first node agent leads it:

- its members send their batches (raw step packets, events, one partial per step) to it
  instead of the aggregator; once every member's partial of a step is in, it merges them
  (merging is exact and associative: the aggregator cannot tell a group's merged partial
  from its nodes' ones) and sends one `ingest_nodes` call with the group's raw packets. A
  step some member is late with goes up node by node after `STRAGGLE_S`, so a slow node
  never holds back its group's other nodes for long (the aggregator merges them as they
  come);
- the lease the aggregator pushes to it, it pushes on to its members.

Members reach their leader, and leaders the aggregator, over the node uplink
(mindpulse/wire/uplink.py: one TCP stream each, frames acknowledged and sent again after a
reconnect); the leader agent (node/agent.py) runs the server its members connect to and
feeds this class. A member's frame is acknowledged only once everything in it has been
acknowledged by the aggregator (each piece holds the frame's `Receipt` until the frame it
went up in is acknowledged): a leader that dies holding a step it was still merging loses
nothing, as its members send the frame again to whoever they reach next. A member whose
rank waits for a verdict asks it through the leader.
We chose leaders, on top of the cheaper stream, because they keep the aggregator's fan-in
bounded across machines and put the merging on the nodes, as MindCluster and DLRover do
at scale.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from mindpulse.reduction.partial import NodePartial, from_wire, merge, to_wire
from mindpulse.wire.uplink import Receipt

log = logging.getLogger(__name__)

STRAGGLE_S = 0.5
"""A step's partials wait this long for the group's last member before they go up apart."""
FLUSH_S = 0.05
"""Events and late partials go up at least this often."""


class GroupLeader:
    """Merges the batches of `members` (node ids, the leader's own included) per step.
    Thread-safe: batches come from the relay's loop, the flush from a thread of its own."""

    def __init__(self, node: int, members: list[int],
                 send: Callable[[list[tuple[Any, dict[str, Any]]], Callable[[], None]], None]):
        """`send(entries, on_acked)`: one frame up (the leader's uplink's `send_threadsafe`),
        fire-and-forget, callable from any thread; `on_acked()` once it is acknowledged
        above (or dropped)."""
        self.node = node
        self.members = frozenset(members)
        self.send = send
        self._lock = threading.Lock()
        self._parts: dict[int, dict[int, NodePartial]] = {}
        self._part_receipts: dict[int, dict[int, list[Receipt]]] = {}
        """step → node → the receipts of the member frames its partial came in (more than one
        when a member sent a frame again, after a reconnect, while the step was held here)."""
        self._since: dict[int, float] = {}
        self._steps: list[bytes] = []
        self._steps_n = 0
        """Step packets in `_steps` (a member's may come joined already: its "steps_n")."""
        self._other: list[bytes] = []
        self._beats: list[list[Any]] = []
        self._raw_receipts: list[Receipt] = []
        """The receipts of the member frames whose raw packets wait in `_steps`/`_other`."""
        self._rejected: Counter[str] = Counter()
        self.calls = 0
        self.merged_steps = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._flush_loop, name="mindpulse-group-flush", daemon=True)
        self._thread.start()

    # ---- packets up ------------------------------------------------------------------------
    def add(self, node: int, batch: dict[str, Any], receipt: Receipt | None = None) -> None:
        """One member's batch (its relay's `NodeBatch`). `receipt`: the member frame's (see
        `Receipt`), held by every piece kept here until the frame it goes up in is
        acknowledged; None for the leader's own node (nothing to acknowledge)."""
        complete = False
        with self._lock:
            if node not in self.members:
                self._rejected["node_not_in_group"] += 1
                return
            steps = [b for b in batch.get("steps") or [] if isinstance(b, (bytes, bytearray))]
            other = [b for b in batch.get("other") or [] if isinstance(b, (bytes, bytearray))]
            beats = [r for r in batch.get("beats") or [] if isinstance(r, list)]
            n = batch.get("steps_n")
            self._steps_n += n if type(n) is int and n >= len(steps) else len(steps)
            self._beats += beats
            counted = [(str(reason), n) for reason, n in (batch.get("rejected") or {}).items()
                       if isinstance(n, int) and not isinstance(n, bool) and n > 0]
            self._steps += steps
            self._other += other
            for reason, n in counted:
                self._rejected[reason] += n
            if receipt is not None and (steps or other or beats or counted):
                receipt.hold()  # raw packets or counts of this frame wait for the next call up
                self._raw_receipts.append(receipt)
            for wire in batch.get("partials") or []:
                try:
                    part = from_wire(wire)
                except Exception:  # a malformed partial from a member is counted and dropped; the group's batch goes on
                    self._rejected["malformed_partial"] += 1
                    continue
                per = self._parts.setdefault(part.step, {})
                if receipt is not None:  # a frame sent again while its partial is held waits with it
                    receipt.hold()
                    self._part_receipts.setdefault(part.step, {}).setdefault(node, []).append(receipt)
                if node in per:
                    self._rejected["duplicate_partial"] += 1
                    continue
                per[node] = part
                self._since.setdefault(part.step, time.monotonic())
                complete = complete or len(per) == len(self.members)
        if complete or self._stopped.is_set():
            self.flush()

    def reject(self, reason: str) -> None:
        """Count something refused before it reached `add` (it goes up with the next batch)."""
        with self._lock:
            self._rejected[reason] += 1

    def flush(self, force: bool = False) -> None:
        """Send what is ready: complete steps merged, late ones node by node, and the
        raw packets and events gathered so far, in one aggregator call."""
        now = time.monotonic()
        entries: list[tuple[Any, dict[str, Any]]] = []
        receipts: list[Receipt] = []
        with self._lock:
            for step in sorted(self._parts):
                per = self._parts[step]
                held = self._part_receipts.get(step, {})
                if len(per) == len(self.members):
                    nodes = sorted(per)
                    part = per[nodes[0]]
                    for n in nodes[1:]:
                        part = merge(part, per[n])
                    entries.append((nodes, _batch(partials=[to_wire(part)])))
                    self.merged_steps += 1
                elif force or self._stopped.is_set() or now - self._since[step] >= STRAGGLE_S:
                    entries += [(n, _batch(partials=[to_wire(p)])) for n, p in sorted(per.items())]
                else:
                    continue
                receipts += (r for rs in held.values() for r in rs)
                del self._parts[step], self._since[step]
                self._part_receipts.pop(step, None)
            if self._steps or self._other or self._beats or self._rejected:
                # the group's step packets go up as one bytes, back to back: the aggregator
                # appends them to metrics.msgpack as they are, with no msgpack object per packet
                # to decode from the frame (docs/architecture.md, "Where the aggregator's time goes")
                raw = _batch(steps=[b"".join(self._steps)] if self._steps else [], other=self._other,
                             beats=self._beats, rejected=dict(self._rejected))
                if self._steps:
                    raw["steps_n"] = self._steps_n
                self._steps, self._steps_n, self._other, self._beats = [], 0, [], []
                self._rejected = Counter()
                receipts += self._raw_receipts
                self._raw_receipts = []
                if entries:  # the raw packets travel with the first entry
                    nodes, first = entries[0]
                    entries[0] = (nodes, dict(raw, partials=first["partials"]))
                else:
                    entries.append((self.node, raw))
        if entries:
            self._send(entries, receipts)

    def _send(self, entries: list[tuple[Any, dict[str, Any]]], receipts: list[Receipt]) -> None:
        def acked() -> None:  # the members' frames these pieces came in may now be acknowledged
            for r in receipts:
                r.release()

        self.send(entries, acked)
        self.calls += 1

    def _flush_loop(self) -> None:
        while not self._stopped.wait(FLUSH_S):
            try:
                self.flush()
            except Exception as exc:  # the monitor never ends a run: log, go on
                log.warning("group leader of node %d: flush failed: %s", self.node, exc)

    # ---- the end ------------------------------------------------------------------------------
    def close(self) -> dict[str, Any]:
        """Send everything left (late steps node by node); later batches go up at once."""
        self._stopped.set()
        self.flush(force=True)
        return {"calls": self.calls, "merged_steps": self.merged_steps}


def _batch(steps: list[bytes] | None = None, other: list[bytes] | None = None,
           partials: list[dict[str, Any]] | None = None, rejected: dict[str, int] | None = None,
           beats: list[list[Any]] | None = None) -> dict[str, Any]:
    return {"steps": steps or [], "other": other or [], "beats": beats or [], "partials": partials or [],
            "rejected": rejected or {}}
