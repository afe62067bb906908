"""Simulated node agents for bench/fanin.py: what every node of a job sends the aggregator,
through the node agents' own group and uplink code.

What a node agent sends (node/agent.py, node/relay.py), and how it is made here:

- **its ranks' steps**: every rank's real `StepPacket` of every step (the fields a rank's
  `RankSession.record` fills; losses, gradient norms, step times and TFLOPS differ by rank
  and step; a fingerprint and parameter norm from every rank every `monitor.collect_freq`
  steps, and rank 0's weight statistics then; rank 0's `decision` flag at checkpoint
  candidates), reduced by the real `NodePreReducer` (with the launcher's `NodeSettings`
  for that node: straggler and compute-drop windows, the collect window) into one batch per
  node and step: raw packets plus the node partial. This is the nodes' own work: it is done
  before the timed run (`node_batches`, two Ray tasks), as on a cluster each node does it on
  its own cores, and kept msgpack-packed until sent;
- **its ranks' heartbeats**: each rank's `Heartbeat.packet()` (workers/heartbeat.py) every
  `monitor.heartbeat_s`, the ranks' phases spread evenly over the interval; the beats of a
  node that fall within the relay's flush window (`relay.FLUSH_S`) go up in one batch, as
  one record of rows (`NodeBatch["beats"]`, `protocol.heartbeat_row`), as the relay sends them;
- **its card telemetry**: one `TelemetryPacket` (`node.telemetry.telemetry_packet` of a
  sample shaped as `NodeSampler` makes it: one `card_record` per card, with its rank, and
  the host with one process entry per rank) every `monitor.telemetry_interval_s`, the
  nodes' phases spread evenly (the launcher starts the nodes' samplers one after the
  other), in a batch of its own as `NodeAgent._ship` sends it. 8 cards a node
  (Atlas 800T A2, 910B3), 16 with 16 ranks a node (an Atlas A3 node: two chips per NPU,
  physical ids, no power reading on the second chip);
- **rank 0's decisions**: at a checkpoint candidate node 0 sends its batch with a decide
  (`node.agent._forward_decide`) and rank 0 waits for the directive before the next step.

The tree: each group's first node leads it. A `SimAgent` is the real `NodeAgent`'s uplink,
group and lease code (`lead`, `_route`, `_on_lease`, `_members_ingest`,
`_forward_decide`) on a stand-in without a relay server, sampler or watchdog: a leader runs
the real `GroupLeader` and `UplinkServer` (deferred acknowledgements) and streams up over a
real `Uplink` to the aggregator's uplink server; a member with a hop of its own streams over
a real `Uplink` to its leader's server, which acknowledges its frames once they are
acknowledged above and pushes the lease down to it. Members of groups without the hop hand
their batches to their leader's `GroupLeader` in-process (what the aggregator receives is
the same; the member's stream, its acknowledgements and the lease pushed to it are not run).
"""

from __future__ import annotations

import asyncio
import bisect
import math
import os
import random
import threading
import time
from collections import Counter
from typing import Any

import msgpack

from mindpulse.node.agent import NodeAgent, _forward_decide
from mindpulse.node.relay import FLUSH_S, NodePreReducer
from mindpulse.node.telemetry import card_record, telemetry_packet
from mindpulse.wire.directives import Lease
from mindpulse.wire.protocol import EventKind, EventPacket, StepPacket, heartbeat_row
from mindpulse.wire.uplink import Uplink
from mindpulse.workers.heartbeat import Heartbeat

LAYERS = 291
"""Parameter tensors whose norms and update ratios rank 0 ships at collect steps: a
LLaMA-7B-shaped model (32 blocks of 9, embedding, final norm, head)."""
HIST_LAYERS = ("model.tok_embeddings.embedding_weight", "lm_head.weight", "model.layers.0.attention.wq.weight")
"""The weight histograms the default `monitor.histogram_regex` picks."""


def _layer_names() -> list[str]:
    per = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
           "feed_forward.w2", "feed_forward.w3", "attention_norm", "ffn_norm")
    names = ["model.tok_embeddings.embedding_weight"]
    names += [f"model.layers.{i}.{p}.weight" for i in range(32) for p in per]
    return names + ["model.norm_out.weight", "lm_head.weight"]


def weight_stats(step: int, rng: random.Random) -> dict[str, Any]:
    """Rank 0's weight statistics at a collect step, shaped as `WeightStats.collect` makes
    them (per-layer norms and update ratios, 64-bin histograms of the default layers)."""
    names = _layer_names()
    norms = {n: 40.0 + 0.01 * i + 1e-4 * step for i, n in enumerate(names)}
    out: dict[str, Any] = {"norms": norms}
    if step > 0:
        out["update_ratio"] = {n: 1e-4 * (1 + rng.random()) for n in names}
    hist = {}
    for n in HIST_LAYERS:
        counts = [float(int(1e5 * math.exp(-((b - 32) / 10) ** 2)) + rng.randrange(50)) for b in range(64)]
        hist[n] = {"edges": [-0.1 + 0.2 * (b + 1) / 64 for b in range(64)], "counts": counts, "min": -0.1,
                   "max": 0.1, "num": int(sum(counts)), "sum": 0.01 * rng.random(), "sum_squares": 3.0 + rng.random()}
    out["hist"] = hist
    return out


def step_packet(rank: int, step: int, rate: float, sched: Any, rng: random.Random) -> StepPacket:
    """Rank `rank`'s packet of `step`, with the fields `RankSession.record` fills; values move
    with the step and differ by rank (step 0: the fingerprint `RankSession.start` ships)."""
    collect = sched.is_collect(step)
    fp = f"{(step * 2654435761) & 0xFFFFFFFFFFFF:012x}" if collect else None
    norm = 1234.5 + 1e-3 * step if collect else None
    if step == 0:
        return StepPacket(rank=rank, step=0, ts=time.time(), fingerprint=fp, param_norm=norm)
    period = 1.0 / rate
    step_time = period * (0.97 + 0.02 * rng.random())
    data_wait = 0.002 * period * (1 + rng.random())
    gnorm = 1.0 + 0.5 * math.exp(-step / 200) + 0.05 * math.sin(step / 7)  # global: one value a step
    return StepPacket(
        rank=rank, step=step, epoch=1 + step // 1000,
        loss=2.0 + math.exp(-step / 300) + 0.03 * rng.gauss(0.0, 1.0), lr=3e-4 * min(1.0, step / 100),
        grad_norm=gnorm, grad_norm_local=gnorm * (0.35 + 0.02 * rng.random()), nan_count=0, inf_count=0,
        step_time_s=step_time, data_wait_s=data_wait, compute_s=step_time - data_wait - 0.0005,
        samples=4, tokens=16384, tflops=180.0 * (0.97 + 0.06 * rng.random()), ts=time.time(),
        fingerprint=fp, param_norm=norm, decision=rank == 0 and sched.is_candidate(step), eval_s=0.0, extra={},
        monitor_errors=0, weights=weight_stats(step, rng) if rank == 0 and collect else {},
        loss_scale=1.0, overflow=False, overflow_steps=0,
        monitor_wait_s=0.0, checkpoint_s=0.0, profile_s=0.0, monitor_self_s=0.0004 * (1 + rng.random()))


def node_batches(nodes: list[int], overrides: list[str], steps: int, rate: float) -> dict[int, list[bytes]]:
    """Every given node's batch of steps 0..`steps` (msgpack-packed `NodeBatch`es): its ranks'
    packets through the real `NodePreReducer`, built with the launcher's `NodeSettings`
    for that node (the config of `overrides`). Run as a Ray task, before the timed run."""
    from mindpulse.config import load_config
    from mindpulse.config.derived import schedule_of
    from mindpulse.launcher.spec import node_settings

    cfg, _ = load_config(None, list(overrides))
    sched = schedule_of(cfg)
    out: dict[int, list[bytes]] = {}
    for node in nodes:
        s = node_settings(cfg, node)
        ranks = sorted(s.rank_devices)
        pre = NodePreReducer(node, range(ranks[0], ranks[-1] + 1), straggler_window=s.straggler_window,
                             collect_freq=s.collect_freq, world_size=s.world_size, compute_window=s.compute_window)
        rng = random.Random(node)
        blobs = []
        for step in range(steps + 1):
            for r in ranks:
                pre.add(step_packet(r, step, rate, sched, rng).encode())
            blobs.append(msgpack.packb(pre.take(), use_bin_type=True))
        out[node] = blobs
    return out


def unpack_batch(blob: bytes) -> dict[str, Any]:
    return msgpack.unpackb(blob, raw=False, strict_map_key=False)


# ---- telemetry and heartbeats ----------------------------------------------------------------
def telemetry_sample(node: int, rpn: int, t: float, pid: int) -> bytes:
    """Node `node`'s card sample at `t` as its agent ships it (`NodeAgent._ship`): one card
    per rank (8: Atlas 800T A2 910B3; 16: Atlas A3, two chips an NPU), values that move."""
    a3 = rpn == 16
    cards = []
    for i in range(rpn):
        wobble = math.sin(t / 7.0 + node + i)
        cards.append(card_record(
            node=f"node{node}-host{node}", card=i, chip=i % 2 if a3 else 0, name="Ascend910" if a3 else "910B3",
            health="OK", util_pct=float(round(40 + 10 * wobble)), memory_used_mb=62000.0 + 100 * wobble,
            memory_total_mb=65536.0, power_w=None if a3 and i % 2 else round(160 + 15 * wobble, 1),
            temp_c=float(round(45 + 5 * wobble)), ranks=[node * rpn + i], source="npu-smi"))
    host = {"cpu_pct": 30.0 + 5 * math.sin(t), "mem_used_mb": 400000.0, "mem_total_mb": 1536000.0,
            "processes": [{"rank": node * rpn + i, "pid": pid + i, "cpu_pct": 101.0 + i, "rss_mb": 5200.0}
                          for i in range(rpn)]}
    sample = {"node": f"node{node}-host{node}", "ts": t, "source": "npu-smi", "cards": cards, "host": host,
              "warnings": []}
    return telemetry_packet(sample).encode()


class Beats:
    """The ranks' heartbeats: `Heartbeat.packet()` of each rank (its own thread in a rank),
    at `period` seconds, phases spread evenly; `due(t)` gives the ranks whose beat falls since
    the last call."""

    def __init__(self, ranks: list[int], period: float, t0: float, seed: int):
        rng = random.Random(seed)
        self.period, self.t0 = period, t0
        self.at = sorted((rng.random() * period, r) for r in ranks)
        self.phases = [p for p, _ in self.at]
        self.last = 0.0

    def due(self, t: float) -> list[int]:
        """The ones due in (last, t] (as offsets from t0, wrapped over the period)."""
        lo, hi = self.last, t - self.t0
        self.last = hi
        if hi <= lo or not self.at:
            return []
        out: list[int] = []
        if hi - lo >= self.period:  # a late tick: every one once
            return [r for _, r in self.at]
        a, b = lo % self.period, hi % self.period
        if a < b:
            i, j = bisect.bisect_right(self.phases, a), bisect.bisect_right(self.phases, b)
            out += [r for _, r in self.at[i:j]]
        else:
            i = bisect.bisect_right(self.phases, a)
            out += [r for _, r in self.at[i:]]
            out += [r for _, r in self.at[:bisect.bisect_right(self.phases, b)]]
        return out


# ---- the node agents ------------------------------------------------------------------------------
class LeaseWatch:
    """When each step's lease reached every watched node (their relays, in the loop)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.through: dict[int, int] = {}
        self.count: Counter[int] = Counter()
        self.seen_at: dict[int, float] = {}
        self.leaders: set[int] = set()
        self.leader_count: Counter[int] = Counter()
        self.leaders_at: dict[int, float] = {}
        """When every watched leader had the step's lease (before they pushed it to their members)."""
        self.node0_at: dict[int, float] = {}
        """When node 0's relay had the lease of each step (rank 0's directive comes down the same stream)."""
        self.all_through = -1
        """Every watched node has the lease of every step up to this one."""
        self.stopping = ""

    def watch(self, node: int, leader: bool) -> None:
        self.through[node] = -1
        if leader:
            self.leaders.add(node)

    def saw(self, node: int, lease: Lease) -> None:
        prev = self.through[node]
        if node == 0:
            for s in range(prev + 1, lease.reduced_through + 1):
                self.node0_at.setdefault(s, time.time())
        if lease.stopping and not self.stopping:
            self.stopping = lease.reason or "stop"
            with self.cond:  # the ranks waiting for a lease are told to stop
                self.cond.notify_all()
        if lease.reduced_through <= prev:
            return
        self.through[node] = lease.reduced_through
        now, n = time.time(), len(self.through)
        for s in range(prev + 1, lease.reduced_through + 1):
            c = self.count[s] = self.count[s] + 1
            if c == n:
                self.seen_at[s] = now
                del self.count[s]
            if node in self.leaders:
                c = self.leader_count[s] = self.leader_count[s] + 1
                if c == len(self.leaders):
                    self.leaders_at[s] = now
                    del self.leader_count[s]
        moved = False
        while self.all_through + 1 in self.seen_at:
            self.all_through += 1
            moved = True
        if moved:
            with self.cond:
                self.cond.notify_all()

    def wait(self, need: int, timeout: float, since: float | None = None) -> float:
        """Seconds the ranks waited for every watched node's lease to cover step `need`: how
        long after `since` (their step's end: its batches handed over; default now) the last
        node had it (`seen_at`), 0 when all had it before. Taken from when the lease came, not
        from how long this call blocked: a rank reads its node's lease board without a lock,
        and the ranks began waiting at their step's end, not when the driver asks."""
        t0 = time.time() if since is None else since
        with self.cond:
            self.cond.wait_for(lambda: self.all_through >= need or self.stopping, timeout)
            held = self.all_through >= need
        at = self.seen_at.get(need)
        if at is None:  # before the first step (0), a stop, or the timeout: the time blocked
            return 0.0 if held and need < 0 else time.time() - t0
        return max(0.0, at - t0)


class _Relay:
    """What a node agent's relay does with a lease pushed down (`RelayServer.set_lease`):
    decode it, keep it (the lease board's write is not simulated) and note when it came."""

    def __init__(self, node: int, loop: asyncio.AbstractEventLoop, watch: LeaseWatch | None):
        self.node, self.loop, self.watch = node, loop, watch
        self._lease = Lease()
        self.bad = 0

    @property
    def lease(self) -> Lease:
        return self._lease

    def set_lease(self, raw: bytes) -> None:
        try:
            lease = Lease.decode(raw)
        except Exception:  # as the relay: a malformed lease is counted, the old one stays
            self.bad += 1
            return
        if lease == self._lease:
            return
        self._lease = lease
        if self.watch is not None:
            self.watch.saw(self.node, lease)


class SimAgent(NodeAgent):
    """A node agent's uplink, group and lease code on a stand-in: `NodeAgent`'s own methods
    (`lead`, `_route`, `_on_lease`, `_members_ingest`) run unchanged, so a node's batch goes
    up the way the relay sends it (`relay.forward_send`, wired by `_route`); `__init__` sets
    only what they use (no relay server, sampler, watchdog or Ray actor)."""

    def __init__(self, node: int, loop: asyncio.AbstractEventLoop, resolve: Any, watch: LeaseWatch | None):
        self.node = node
        self.relay = _Relay(node, loop, watch)  # type: ignore[assignment]
        self.server = None
        self.group = None
        self.leader = None
        self.errors = []
        self.uplink = Uplink(node, resolve, self._on_lease, max_unacked=self.MAX_UNACKED)
        self._route()
        self.uplink.start(loop)


def loop_thread(name: str) -> asyncio.AbstractEventLoop:
    """An event loop running in a daemon thread (as a node agent's relay loop)."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name=name, daemon=True).start()
    return loop


class Senders:
    """What a sender actor of bench/fanin.py keeps of a run, whichever way it sends (`Nodes`:
    the node agents' code at run time; `_replay.Replay`: frames built before the run), and the
    answers `fanin.run` asks of every sender: the ranks' heartbeat and card-sample clocks, when
    each step was handed over, went up and was decided, the waits before a step, and the record
    of the run. A subclass sets `watch` (its `LeaseWatch`), `nodes` (the nodes it plays) and
    `decides` (node 0's leader is here: rank 0's decide goes up from this sender), then calls
    `_start_clocks`; its `_tick` sends what falls due."""

    watch: LeaseWatch
    nodes: list[int]
    decides: bool

    def _start_clocks(self, rpn: int, heartbeat_s: float, telemetry_s: float, seed: int) -> None:
        """The run's clocks (the beats' phases count from now) and its empty records."""
        self._pid = os.getpid()
        self.t0 = time.time()
        ranks = [n * rpn + i for n in self.nodes for i in range(rpn)]
        self.beats = Beats(ranks, heartbeat_s, self.t0, seed)
        self.samples = Beats(self.nodes, telemetry_s, self.t0, seed + 1) if telemetry_s > 0 else None
        self.step = 0
        self.sent_at: dict[int, float] = {}
        self.up_at: dict[int, float] = {}
        """Step → when its last group partial left a leader for the aggregator."""
        self.decided_at: dict[int, float] = {}
        self.decided = threading.Condition()
        self.counts: Counter[str] = Counter()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def pid(self) -> int:
        return os.getpid()

    def _start_ticker(self) -> None:
        """The heartbeats and card samples begin (`_tick`, in a thread of their own)."""
        self._ticker = threading.Thread(target=self._tick, name="beats", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        raise NotImplementedError

    def stop_traffic(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(5)

    def _decided(self, step: int) -> None:
        """Rank 0 has the directive of `step`: a rank waiting for it (`wait`) goes on."""
        with self.decided:
            self.decided_at[step] = time.time()
            self.decided.notify_all()

    def wait(self, need: int, directive_of: int, timeout: float = 60.0) -> tuple[float, float]:
        """Before the next step: (seconds rank 0 waited for the directive of step
        `directive_of`, where node 0 is here and that step was a candidate (-1: none), then
        seconds the ranks waited for every node's lease to cover step `need`)."""
        t0 = time.time()
        if directive_of >= 0 and self.decides:
            with self.decided:
                self.decided.wait_for(lambda: directive_of in self.decided_at, timeout)
        t1 = time.time()
        # the ranks' wait counts from their step's end (this process's last batch handed over),
        # the directive's wait above included: only rank 0 waits for that, the others for the lease
        return t1 - t0, self.watch.wait(need, timeout, since=self.sent_at.get(self.step))

    def record(self) -> dict[str, Any]:
        return {"sent_at": dict(self.sent_at), "seen_at": dict(self.watch.seen_at),
                "leaders_at": dict(self.watch.leaders_at), "up_at": dict(self.up_at),
                "decided_at": dict(self.decided_at), "lease0_at": dict(self.watch.node0_at),
                "stopping": self.watch.stopping, "watched": len(self.watch.through)}


class Nodes(Senders):
    """The node agents of some groups, in one process (a Ray actor of the benchmark).

    `groups`: lists of node ids, each led by its first; `hop`: the groups whose members
    stream to their leader over an uplink of their own (the others hand their batches to
    the leader in-process). `blobs`: every node's packed batch per step (`node_batches`)."""

    def __init__(self, aggregator: Any, groups: list[list[int]], hop: list[bool], blobs: dict[int, list[bytes]],
                 rpn: int, heartbeat_s: float, telemetry_s: float, decision_timeout_s: float, seed: int):
        import ray

        self.blobs = blobs
        self.rpn = rpn
        self.decision_timeout_s = decision_timeout_s
        self.loop = loop_thread("uplinks")
        self.watch = LeaseWatch()
        resolve_agg = lambda: tuple(ray.get(aggregator.uplink_address.remote(), timeout=60))  # noqa: E731
        self.agents: dict[int, SimAgent] = {}
        """Node → its agent (leaders, and members with their own hop)."""
        self.leader_of: dict[int, SimAgent] = {}
        self.leaders: list[SimAgent] = []
        self.members: list[SimAgent] = []
        for g, stream in zip(groups, hop):  # every watched node is known before the first lease comes
            for n in g if stream else g[:1]:
                self.watch.watch(n, n == g[0])
        for g, stream in zip(groups, hop):
            lead = SimAgent(g[0], self.loop, resolve_agg, self.watch)
            if len(g) > 1:
                lead.lead(g)  # the real GroupLeader and, for its members, the real UplinkServer
                lead.group.send = self._noting(lead.group.send)
            self.leaders.append(lead)
            self.agents[g[0]] = lead
            for m in g:
                self.leader_of[m] = lead
            if stream:
                for m in g[1:]:
                    member = SimAgent(m, self.loop, lambda lead=lead: lead.server.address, self.watch)
                    self.members.append(member)
                    self.agents[m] = member
        self.nodes = sorted(self.leader_of)
        self.decides = 0 in self.agents
        self._start_clocks(rpn, heartbeat_s, telemetry_s, seed)
        self.beat = Heartbeat(None, 0, lambda: self.step, lambda: self.step + 1)  # type: ignore[arg-type]
        self.decision: asyncio.Future | None = None

    # ---- set-up -------------------------------------------------------------------------------
    def agents_count(self) -> int:
        return len(self.agents)

    def connected(self) -> int:
        """How many of the uplinks are connected (to the aggregator or their leader)."""
        return sum(a.uplink.connected for a in self.agents.values())

    def start(self) -> None:
        """The ranks start: every rank's START event, the heartbeats and card samples begin."""
        items = [(n, {"steps": [], "other": [EventPacket(rank=r, kind=EventKind.START.value, ts=time.time(), step=0,
                                                         pid=self._pid + r % self.rpn, host=f"host{n}").encode()
                                             for r in range(n * self.rpn, (n + 1) * self.rpn)],
                      "partials": [], "rejected": {}}) for n in self.nodes]
        self._in_loop(self._deliver, items)
        self._start_ticker()

    # ---- steps --------------------------------------------------------------------------------
    def send_step(self, step: int, decide: bool) -> float:
        """Every node hands its batch of `step` to its uplink or its leader (node 0 with a
        decide at a candidate); returns when the last is handed over."""
        self.step = step
        items = [(n, unpack_batch(self.blobs[n][step])) for n in self.nodes]
        done = threading.Event()

        def go() -> None:
            if decide and self.decides:
                _, b0 = items[0]
                self.decision = asyncio.ensure_future(self._decide(b0, step))
                self._deliver(items[1:])
            else:
                self._deliver(items)
            self.sent_at[step] = time.time()
            done.set()

        self.loop.call_soon_threadsafe(go)
        done.wait(60)
        return self.sent_at.get(step, time.time())

    async def _decide(self, batch: dict[str, Any], step: int) -> None:
        await _forward_decide(self.agents[0], batch, step, self.decision_timeout_s)
        self._decided(step)

    def _deliver(self, items: list[tuple[int, dict[str, Any]]]) -> None:
        """In the loop: each node's batch the way its relay sends it (`relay.forward_send`, as
        `NodeAgent._route` wires it: a leader into its group, a member up its uplink); members
        without a hop of their own into their leader's group."""
        for n, batch in items:
            agent = self.agents.get(n)
            if agent is not None:
                if agent.group is None and self.leader_of[n] is agent:  # a group of one: straight up
                    self._note(batch)
                agent.relay.forward_send(batch)
            else:
                lead = self.leader_of[n]
                if lead.group is not None:
                    lead.group.add(n, batch)
                else:
                    lead.relay.forward_send(batch)

    def _noting(self, send: Any) -> Any:
        """A group leader's `send` that notes when a partial of each step went up."""
        def noted(entries: Any, on_acked: Any) -> None:
            for _, batch in entries:
                self._note(batch)
            send(entries, on_acked)

        return noted

    def _note(self, batch: dict[str, Any]) -> None:
        now = time.time()
        for part in batch.get("partials") or []:
            s = part.get("step") if isinstance(part, dict) else None
            if isinstance(s, int) and now > self.up_at.get(s, 0.0):
                self.up_at[s] = now

    def _in_loop(self, fn: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def _tick(self) -> None:
        """Heartbeats and card samples as they fall due, one batch per node and flush window."""
        while not self._stop.wait(FLUSH_S):
            t = time.time()
            per: dict[int, list[list[Any]]] = {}
            for r in self.beats.due(t):
                self.beat.rank = r
                per.setdefault(r // self.rpn, []).append(heartbeat_row(self.beat.packet()))
            # a node's beats as its relay sends them: one record of rows (`NodeBatch["beats"]`)
            items = [(n, {"steps": [], "other": [], "beats": rows, "partials": [], "rejected": {}})
                     for n, rows in per.items()]
            self.counts["heartbeats"] += sum(len(p) for p in per.values())
            if self.samples is not None:
                for n in self.samples.due(t):
                    items.append((n, {"steps": [], "other": [telemetry_sample(n, self.rpn, t, self._pid)],
                                      "partials": [], "rejected": {}}))
                    self.counts["telemetry"] += 1
            if items:
                self.counts["event_batches"] += len(items)
                self._in_loop(self._deliver, items)

    # ---- the end ------------------------------------------------------------------------------
    def close(self) -> dict[str, Any]:
        """Members first, then leaders (as `NodeAgents` stops them): everything acknowledged."""
        self.stop_traffic()

        def run(coro: Any, timeout: float = 30.0) -> Any:
            return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

        async def closed(agents: list[SimAgent]) -> int:
            return sum(await asyncio.gather(*(a.uplink.close(10) for a in agents)))

        lost = run(closed(self.members))
        calls = 0
        for lead in self.leaders:
            if lead.group is not None:
                calls += lead.group.close()["calls"]
        lost += run(closed(self.leaders))
        for lead in self.leaders:
            if lead.server is not None:
                run(lead.server.close())
        member_frames = sum(ld.server.stats["frames"] for ld in self.leaders if ld.server is not None)
        return {"leader_frames": sum(ld.uplink.stats["frames"] for ld in self.leaders), "member_frames": member_frames,
                "group_calls": calls, "lost": lost, "dropped": sum(a.uplink.dropped for a in self.agents.values()),
                "bad_leases": sum(a.relay.bad for a in self.agents.values()), **self.counts}

    def counters(self) -> dict[str, int]:
        """What went out so far: heartbeats and samples, frames up from members and leaders."""
        return {**self.counts, "member_frames": sum(ld.server.stats["frames"] for ld in self.leaders
                                                    if ld.server is not None),
                "leader_frames": sum(ld.uplink.stats["frames"] for ld in self.leaders)}
