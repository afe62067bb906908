"""What the ranks' own setup tells the user to change: ranks that train without a Monitor
(their steps are never reported), and MindSpore callbacks of several ranks that write one
directory. Collected from the ranks' `no_monitor` and `advice` events (workers/auto_attach.py),
said once on the console, kept for `summary.json` `advice`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mindpulse.wire.protocol import EventKind, EventPacket

_FIXES = {
    "ModelCheckpoint": "give each rank its own directory (e.g. directory=f'ckpt/rank_{get_rank()}') or add "
                       "ModelCheckpoint on rank 0 only (data-parallel weights are the same on every rank)",
    "SummaryCollector": "give each rank its own summary_dir (e.g. f'summary/rank_{get_rank()}') or add it on "
                        "rank 0 only",
}


@dataclass
class Advice:
    world_size: int
    no_monitor: dict[int, dict[str, str]] = field(default_factory=dict)
    """rank → {"why", "fix"}: ranks that train without a Monitor (until their Monitor starts)."""
    directories: dict[tuple[str, str, str], set[int]] = field(default_factory=dict)
    """(callback, directory, file prefix) → the ranks whose callback writes there."""
    _said: set[Any] = field(default_factory=set)

    def on_event(self, pkt: EventPacket) -> list[str]:
        """Take a rank's event; returns the console lines to say now (each thing once)."""
        if pkt.kind == EventKind.START:  # its Monitor started after all: its steps come
            self.no_monitor.pop(pkt.rank, None)
            return []
        try:
            msg = json.loads(pkt.message) if pkt.message else {}
        except ValueError:
            msg = {}
        if not isinstance(msg, dict):
            msg = {}
        if pkt.kind == EventKind.NO_MONITOR:
            why, fix = str(msg.get("why") or pkt.message), str(msg.get("fix") or "")
            self.no_monitor[pkt.rank] = {"why": why, "fix": fix}
            if "no_monitor" in self._said:
                return []
            self._said.add("no_monitor")
            return [f"rank {pkt.rank}: {why}: its steps are not reported (no reduced loss, rule or best "
                    f"checkpoint for them; the run is not declared hung for it). To fix: {fix}"]
        if pkt.kind == EventKind.ADVICE and msg.get("kind") == "shared_directory":
            key = (str(msg.get("callback")), str(msg.get("directory")), str(msg.get("prefix") or ""))
            ranks = self.directories.setdefault(key, set())
            ranks.add(pkt.rank)
            if len(ranks) < 2 or key in self._said:
                return []
            self._said.add(key)
            return [f"advice: {self._shared_text(key, ranks)}"]
        return []

    def _shared_text(self, key: tuple[str, str, str], ranks: set[int]) -> str:
        callback, directory, prefix = key
        who = f"ranks {_ranks(ranks)}" if len(ranks) < self.world_size else f"all {self.world_size} ranks"
        files = f" (file prefix {prefix!r})" if prefix else ""
        return (f"{callback} of {who} writes the same directory {directory}{files}: the ranks overwrite or "
                f"rename each other's files; {_FIXES.get(callback, 'give each rank its own directory')}")

    def to_list(self) -> list[dict[str, Any]]:
        """summary.json `advice`: one record per thing to change."""
        out: list[dict[str, Any]] = []
        by_why: dict[tuple[str, str], list[int]] = {}
        for r, m in sorted(self.no_monitor.items()):
            by_why.setdefault((m["why"], m["fix"]), []).append(r)
        for (why, fix), ranks in by_why.items():
            out.append({"kind": "no_monitor", "ranks": ranks, "message": f"rank(s) {_ranks(ranks)}: {why}",
                        "fix": fix})
        for key, ranks in sorted(self.directories.items()):
            if len(ranks) >= 2:
                out.append({"kind": "shared_directory", "callback": key[0], "directory": key[1],
                            **({"prefix": key[2]} if key[2] else {}),
                            "ranks": sorted(ranks), "message": self._shared_text(key, ranks),
                            "fix": _FIXES.get(key[0], "give each rank its own directory")})
        return out


def _ranks(ranks: Any) -> str:
    rs = sorted(ranks)
    return ",".join(map(str, rs[:16])) + (f",… ({len(rs)} in all)" if len(rs) > 16 else "")
