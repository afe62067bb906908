"""Is every node of the attempt still there? A lost host, and a lost link, told apart from
a rank's crash.

When a host dies, its node agent, its raylet and its ranks go together, and Ray reports the
ranks' actors as dead ("RpcError … Socket closed"): taken alone, that reads as one rank's
crash. So the driver asks each node's raylet directly (a TCP connect to its node manager
port, every node at once, without blocking for more than `PROBE_TIMEOUT_S`):

- refused: nothing listens on the host any more (its processes are gone, the host
  answers): the node is **lost**; Ray's own node table saying `Alive: false` means the same;
- no answer (a timeout, no route): the host cannot be reached, a **lost link** or network
  partition (a host that lost its power looks the same from here). Declared once it lasts
  `LINK_LOST_AFTER_S`, so a dropped packet is not a lost host.

The watch probes every `CHECK_EVERY_S` while the ranks run (a link cut leaves every rank
blocked in a collective, and no Ray call fails for a while), and again at once when a rank
failed, to name the cause.
"""

from __future__ import annotations

import enum
import errno
import selectors
import socket
import time
from dataclasses import dataclass
from typing import Any

PROBE_TIMEOUT_S = 0.5
CHECK_EVERY_S = 1.0
LINK_LOST_AFTER_S = 4.0
"""How long a node must stay unreachable before its link is declared lost."""
PROBE_BATCH = 256
"""Sockets open at once (well under a process's usual 1,024 files); a periodic check of a
larger job probes this many nodes in turn, a check at a failure probes them all, batch by batch."""


class Reach(str, enum.Enum):
    UP = "up"
    REFUSED = "refused"
    UNREACHABLE = "unreachable"


class LossKind(str, enum.Enum):
    NODE = "node_lost"
    LINK = "link_lost"


@dataclass
class NodeEndpoint:
    node: int
    host: str
    address: str
    node_id: str
    port: int
    """The raylet's node manager port (0: unknown, not probed)."""
    ranks: list[int]


def probe_all(targets: list[tuple[str, int]], timeout: float = PROBE_TIMEOUT_S) -> list[Reach]:
    """Connect to every (address, port), `PROBE_BATCH` at once; each one's answer within `timeout`."""
    out: list[Reach] = []
    for first in range(0, len(targets), PROBE_BATCH):
        out += _probe_batch(targets[first:first + PROBE_BATCH], timeout)
    return out


def _probe_batch(targets: list[tuple[str, int]], timeout: float) -> list[Reach]:
    out = [Reach.UNREACHABLE] * len(targets)
    sel = selectors.DefaultSelector()
    socks: list[socket.socket] = []
    try:
        for i, (addr, port) in enumerate(targets):
            s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            socks.append(s)
            err = s.connect_ex((addr, port))
            if err == 0:
                out[i] = Reach.UP
            elif err == errno.ECONNREFUSED:
                out[i] = Reach.REFUSED
            elif err in (errno.EINPROGRESS, errno.EWOULDBLOCK):
                sel.register(s, selectors.EVENT_WRITE, i)
    except OSError:  # no socket to be had (out of files): no verdict this time, every node counts as up
        for s in socks:
            s.close()
        sel.close()
        return [Reach.UP] * len(targets)
    try:
        deadline = time.monotonic() + timeout
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                err = key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)  # type: ignore[union-attr]
                out[key.data] = Reach.UP if err == 0 else Reach.REFUSED if err == errno.ECONNREFUSED \
                    else Reach.UNREACHABLE
                sel.unregister(key.fileobj)
    finally:
        sel.close()
        for s in socks:
            s.close()
    return out


def endpoints(infos: list[dict[str, Any]], ray_nodes: list[dict[str, Any]], ranks_per_node: int) -> list[NodeEndpoint]:
    """Each node of the attempt (its agent's `info`) with its raylet's port from Ray's node table."""
    ports = {n.get("NodeID"): int(n.get("NodeManagerPort") or 0) for n in ray_nodes}
    addresses = {n.get("NodeID"): str(n.get("NodeManagerAddress") or "") for n in ray_nodes}
    out = []
    for i in infos:
        node = int(i["node"])
        address = addresses.get(i.get("node_id")) or str(i.get("ip", ""))
        out.append(NodeEndpoint(node=node, host=str(i.get("host", "?")), address=address,
                                node_id=str(i.get("node_id", "")), port=ports.get(i.get("node_id"), 0),
                                ranks=list(range(node * ranks_per_node, (node + 1) * ranks_per_node))))
    return out


class NodeWatch:
    def __init__(self, nodes: list[NodeEndpoint], *, link_lost_after_s: float = LINK_LOST_AFTER_S,
                 probe_timeout_s: float = PROBE_TIMEOUT_S):
        self.nodes = [n for n in nodes if n.port and n.address]
        self.link_lost_after_s = link_lost_after_s
        self.probe_timeout_s = probe_timeout_s
        self._unreachable_since: dict[int, float] = {}
        self._last = 0.0
        self._cursor = 0

    def due(self, now: float) -> bool:
        return bool(self.nodes) and now - self._last >= CHECK_EVERY_S

    def check(self, now: float | None = None, dead_ids: set[str] | None = None,
              at_failure: bool = False) -> list[dict[str, Any]]:
        """The nodes lost now: {node, host, address, node_id, ranks, kind, how}. `dead_ids`:
        the Ray node ids Ray's table reports dead. `at_failure` (a rank failed): an
        unreachable node counts at once, without waiting out `link_lost_after_s`."""
        now = time.monotonic() if now is None else now
        self._last = now
        nodes = self.nodes if at_failure or len(self.nodes) <= PROBE_BATCH else self._next_window()
        reach = probe_all([(n.address, n.port) for n in nodes], self.probe_timeout_s)
        lost = []
        for n, r in zip(nodes, reach):
            if r is Reach.UP and n.node_id not in (dead_ids or set()):
                self._unreachable_since.pop(n.node, None)
                continue
            if r is Reach.REFUSED or n.node_id in (dead_ids or set()):
                how = ("its Ray node is gone (its raylet refuses connections)" if r is Reach.REFUSED
                       else "Ray reports its node dead")
                lost.append(self._entry(n, LossKind.NODE, how))
                continue
            since = self._unreachable_since.setdefault(n.node, now)
            if at_failure or now - since >= self.link_lost_after_s:
                lost.append(self._entry(n, LossKind.LINK, f"unreachable for {now - since:.0f}s (no answer from "
                                                          f"{n.address}: a lost link or a network partition)"))
        return lost

    def _next_window(self) -> list[NodeEndpoint]:
        """The next `PROBE_BATCH` nodes in turn, and every node already unanswered (its clock runs)."""
        start = self._cursor % len(self.nodes)
        self._cursor = start + PROBE_BATCH
        window = (self.nodes + self.nodes)[start:start + PROBE_BATCH]
        seen = {n.node for n in window}
        return window + [n for n in self.nodes if n.node in self._unreachable_since and n.node not in seen]

    @staticmethod
    def _entry(n: NodeEndpoint, kind: LossKind, how: str) -> dict[str, Any]:
        return {"node": n.node, "host": n.host, "address": n.address, "node_id": n.node_id, "ranks": n.ranks,
                "kind": kind.value, "how": how}


def loss_kind(lost: list[dict[str, Any]]) -> LossKind:
    """A job that lost a node and a link at once: the node is the cause named."""
    return LossKind.NODE if any(x["kind"] == LossKind.NODE.value for x in lost) else LossKind.LINK


def describe_loss(lost: list[dict[str, Any]]) -> str:
    """One line: which node (host, address) was lost or cut off, and which ranks went with it."""
    parts = []
    for x in lost:
        what = "lost" if x["kind"] == LossKind.NODE.value else "cut off (link lost)"
        parts.append(f"node {x['node']} ({x['host']}, {x['address']}) {what} with ranks {x['ranks']}: {x['how']}")
    return "; ".join(parts)


def dead_node_ids() -> set[str]:
    """The Ray node ids Ray's node table reports dead (empty when it cannot be read)."""
    import ray

    try:
        return {n["NodeID"] for n in ray.nodes() if not n.get("Alive")}
    except Exception:  # the probe alone decides then
        return set()


def hosts_left(resource: str, ranks_per_node: int, lost_ids: set[str]) -> int:
    """Alive Ray nodes, the lost ones left out, that can hold one node's ranks."""
    import ray

    try:
        nodes = ray.nodes()
    except Exception:  # cannot tell: the restart's placement decides
        return -1
    return sum(1 for n in nodes if n.get("Alive") and n.get("NodeID") not in lost_ids
               and float((n.get("Resources") or {}).get(resource, 0)) >= ranks_per_node)
