"""The aggregator's state machine, free of Ray (only the actor below imports it, lazily) so it is tested directly.

Each step in one pass (`_on_reduced`): intake (packets validated, stored in
`metrics.msgpack`, reduced per complete step) → reduce (what the aggregator adds: MFU,
straggler scores, goodput, totals) → decide (a `Verdict`: firings, the directive and the lease)
→ views (queued behind the step's lease). `AggregatorCore` composes the parts, each a module of
its own: `intake.py` (packets and node partials in, reduction driven), `decisions.py` (rules,
stops and rollbacks, checkpoint decisions, the lease), `hang_clocks.py` (start-up and running
hang clocks) and `sinks.py` (every `Sink`: the console, TensorBoard, the trackers; and
anomalies.jsonl), with the shared base's `mindpulse/rundir/replay.py` (the state of a restarted
aggregator rebuilt from metrics.msgpack, the same replay the views run).
`AggregatorActor` (below) wraps it as a Ray actor.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mindpulse.config import MonitorConfig
from mindpulse.config.settings import AggregatorSettings, compute_drop_window
from mindpulse.reduction.partial import collect_ranks
from mindpulse.reduction.reducer import ReducedStep, RunTotals, StepReducer, StragglerTracker, straggler_scores
from mindpulse.reporting.card_peaks import peak_dtype
from mindpulse.reporting.goodput import GoodputClock, StepTimes
from mindpulse.rundir.metrics_store import MetricsWriter
from mindpulse.rundir.replay import replay_attempt
from mindpulse.wire.directives import Directive, Lease
from mindpulse.wire.protocol import EventKind, EventPacket, HeartbeatRow, Packet, TelemetryPacket
from mindpulse.wire.stop_decision import RollbackDecision
from mindpulse.wire.uplink import UplinkServer

from .advice import Advice
from .compute import ComputeWatch
from .decisions import Decisions, Verdict
from .hang_clocks import HangClocks
from .intake import STEP_WINDOW, Intake
from .sinks import Sinks

KEEP_HISTORY = 512
"""Reduced steps kept for the automatic hang limit (their step times)."""


class AggregatorCore:
    STEP_WINDOW = STEP_WINDOW

    def __init__(self, run_dir: Path | str, world_size: int, per_print_step: int = MonitorConfig.per_print_step,
                 total_steps: int | None = None, settings: AggregatorSettings | Mapping[str, Any] | None = None,
                 replay: bool = False):
        """`settings`: the launcher's `AggregatorSettings`, or their plain form (tests and
        benchmarks write it by hand: `AggregatorSettings.of`)."""
        settings = AggregatorSettings.of(settings)
        cfg = settings.config
        self.settings = settings
        self.restarts = 0
        self.run_dir = Path(run_dir)
        self.world_size = world_size
        self.per_print_step = max(1, per_print_step)
        self.total_steps = total_steps
        self.ckpt = cfg.checkpoint
        self.straggler_threshold = cfg.monitor.straggler_threshold
        self.collect_freq = cfg.monitor.collect_freq
        self.start_step = settings.start_step
        """The step this attempt starts after (a resumed run): the step window counts from it."""
        self.metrics = MetricsWriter.for_run(self.run_dir, cfg, settings.attempt, restart=replay)
        self.reducer = StepReducer(world_size, ranks_per_node=cfg.world.ranks_per_node)
        self.clocks = HangClocks(world_size, self.reducer.ranks_per_node,
                                 float(cfg.monitor.startup_timeout_s or cfg.msrun.cluster_time_out),
                                 cfg.world.device.value)
        self.intake = Intake(self.reducer, self.metrics, self.clocks, world_size=world_size,
                             start_step=self.start_step, on_event=self._on_event,
                             on_telemetry=self._on_telemetry, on_beats=self._on_beats)
        self.sinks = Sinks(self.run_dir, tensorboard=settings.tensorboard, collect_freq=self.collect_freq,
                           straggler_threshold=self.straggler_threshold, world_size=self.world_size,
                           per_print_step=self.per_print_step, total_steps=total_steps,
                           card_tflops=lambda card: self.compute.card_tflops(card), errors=self.intake.rejected)
        self.sinks.open_outputs(cfg, run=self.run_dir.name, attempt=settings.attempt)
        if settings.config_yaml:
            self.sinks.text("config", "```\n" + settings.config_yaml + "\n```")
        self.sinks.milestone("start", 0)
        self.goodput = GoodputClock()
        self.stragglers = StragglerTracker(cfg.monitor.straggler_window, cfg.world.ranks_per_node)
        self.compute = ComputeWatch(self.run_dir, cfg.world.peak_tflops, settings.peak_dtype or peak_dtype(),
                                    compute_drop_window(cfg.anomalies), say=self.sinks.say)
        self.sinks.watch_progress(self.clocks)  # the endpoint's last-step times per rank and node
        self.decisions = Decisions(self.run_dir, settings, replay=replay, say=self.sinks.say,
                                   milestone=self.sinks.milestone,
                                   next_step=lambda: self.reducer.reduced_through + 1)
        self.advice = Advice(world_size)
        """Ranks without a Monitor, callbacks of several ranks writing one directory (advice.py)."""
        self.rank_info: dict[int, dict[str, Any]] = {}
        self.rank_errors: list[dict[str, Any]] = []
        self.recent: deque[ReducedStep] = deque(maxlen=KEEP_HISTORY)
        self.totals = RunTotals()
        self.steps_reduced = 0
        self.last_reduced: ReducedStep | None = None
        self.fingerprint_mismatches: list[dict[str, Any]] = []
        self.replay_stats: dict[str, int] = {}
        if replay:  # last: every part the packets touch must exist
            self._replay()

    # ---- the parts' state, by the names the actor, the tests and the benchmarks use -------------
    console = property(lambda self: self.sinks.console)
    tb = property(lambda self: self.sinks.tb)
    anomalies = property(lambda self: self.sinks.anomalies)
    replaying = property(lambda self: self.sinks.replaying)
    accepted = property(lambda self: self.intake.accepted)
    rejected = property(lambda self: self.intake.rejected)
    policies = property(lambda self: self.decisions.policies)
    live_rules = property(lambda self: self.decisions.live_rules)
    directives = property(lambda self: self.decisions.directives)
    best = property(lambda self: self.decisions.best)
    best_checkpoint = property(lambda self: self.decisions.best_checkpoint)
    anomalies_total = property(lambda self: self.decisions.anomalies_total)
    heartbeat = property(lambda self: self.clocks.heartbeat)
    last_progress = property(lambda self: self.clocks.last_progress)
    startup_timeout_s = property(lambda self: self.clocks.startup_timeout_s)
    ended_at = property(lambda self: self.clocks.ended_at)

    @property
    def stop(self) -> dict[str, Any] | None:
        """The stop decided (summary.json's form), None while none is."""
        return self.decisions.stop_dict()

    @property
    def defer_sinks(self) -> bool:
        return self.sinks.defer

    @defer_sinks.setter
    def defer_sinks(self, value: bool) -> None:
        self.sinks.defer = value

    def _replay(self) -> None:
        """Rebuild the state of a restarted aggregator from metrics.msgpack — every segment,
        the records of this aggregator's attempt only (another attempt's steps are another
        reducer's) — without writing anything again. A step whose per-rank packets were thinned
        counts through its reduced record; damaged bytes are skipped and counted."""
        self.sinks.replaying = True
        self.restarts += 1
        self.metrics.paused = True

        def packet(pkt: Packet) -> list[ReducedStep]:
            self.intake.accepted += 1
            return self._decide(self.intake.accept_one(pkt))

        def record(red: ReducedStep) -> None:
            self.reducer.reduced_through = max(self.reducer.reduced_through, red.step)
            self.totals.add(red)
            self.steps_reduced += 1

        try:
            stats = replay_attempt(self.metrics.path, self.metrics.attempt, self.reducer, packet, record)
        finally:
            self.sinks.replaying = False
            self.metrics.paused = False
        self.replay_stats = stats.as_dict()
        notes = [f"{stats.read.segments} segment(s)"]
        if stats.steps_from_records:
            notes.append(f"{stats.steps_from_records} thinned step(s) from their reduced records")
        if stats.read.skipped_bytes:
            notes.append(f"{stats.read.skipped_bytes} damaged byte(s) skipped in {stats.read.skipped_stretches} "
                         "stretch(es)")
        self.console.clear()
        self.console.append(f"aggregator restarted: rebuilt from {stats.packets} packets of attempt "
                            f"{self.metrics.attempt} in metrics.msgpack ({'; '.join(notes)}) "
                            f"(through step {self.reducer.reduced_through})")

    # ---- input: the packet path's loop -----------------------------------------------
    def ingest(self, batch: list[bytes]) -> list[ReducedStep]:
        """Accept a batch of encoded packets; returns the steps this batch completed."""
        return self._decide(self.intake.ingest(batch))

    def ingest_nodes(self, batches: list[tuple[Any, dict[str, Any]]]) -> list[ReducedStep]:
        """Several nodes' batches in one call (a group leader's), each `(node or nodes, batch)`."""
        return self._decide(self.intake.ingest_nodes(batches))

    def ingest_node(self, node: int | list[int], batch: dict[str, Any]) -> list[ReducedStep]:
        """A node agent's batch (node/relay.py): see `Intake.ingest_node`."""
        return self._decide(self.intake.ingest_node(node, batch))

    def _decide(self, completed: Iterable[ReducedStep]) -> list[ReducedStep]:
        """Each step the intake completes, as it completes: its decisions (rules, stop,
        checkpoint, the lease they change) and its views are settled here before the intake
        takes the next packet or partial (the intake yields them), in the order they
        complete. A step whose settling fails is counted (`apply_error`) and the batch goes on."""
        done: list[ReducedStep] = []
        for red in completed:
            try:
                self._on_reduced(red)
            except Exception as exc:  # a step's consequences failing must not stop the aggregator: counted, logged
                self.intake.count_error(f"reduced step {red.step} could not be applied", exc)
            done.append(red)
        return done

    def _on_event(self, pkt: EventPacket) -> None:
        info = self.rank_info.setdefault(pkt.rank, {})
        if pkt.kind in (EventKind.START, EventKind.NO_MONITOR, EventKind.ADVICE):
            said = self.advice.on_event(pkt)
            if not self.replaying:
                self.console.extend(said)
        if pkt.kind == EventKind.START:
            info.update(pid=pkt.pid, host=pkt.host, started=pkt.ts)
        elif pkt.kind == EventKind.CHECKPOINT:
            entries, refused = self.decisions.on_checkpoint(pkt)
            self.sinks.checkpoint(pkt.step, entries)
            if refused is not None:
                self.goodput.checkpoint_at(pkt.step)
                if refused:
                    self.rejected["bad_checkpoint_entry"] += refused
        elif pkt.kind == EventKind.STRUCTURE:
            self.sinks.text("model/structure", pkt.message, 0)
        elif pkt.kind == EventKind.HEARTBEAT:
            self.clocks.on_heartbeat(pkt.rank, pkt.step, pkt.rank_state, pkt.state_step)
            info.setdefault("pid", pkt.pid)
        elif pkt.kind == EventKind.END:
            self.clocks.on_end(pkt.rank, pkt.ts)
            info["end"] = pkt.message or True
        elif pkt.kind == EventKind.MONITOR_ERROR:
            if not self.replaying:
                self.console.append(f"rank {pkt.rank}: monitor error (training goes on): {pkt.message}")
        elif pkt.kind == EventKind.ERROR:
            if len(self.rank_errors) < 100:
                self.rank_errors.append({"rank": pkt.rank, "step": pkt.step, "message": pkt.message})
            self.sinks.rank_error(pkt.rank, pkt.step, pkt.message)  # a replay rebuilds the endpoint's series too
            self.decisions.on_rank_error(pkt)
        else:
            info[pkt.kind] = pkt.message or True

    def _on_beats(self, rows: list[HeartbeatRow]) -> None:
        """A node's heartbeats, one record (node/relay.py): what a heartbeat packet does, per row."""
        info, beat = self.rank_info, self.clocks.on_heartbeat
        for rank, step, state, state_step, pid in rows:
            beat(rank, step, state, state_step)
            i = info.get(rank)
            if i is None:
                info[rank] = {"pid": pid}
            elif "pid" not in i:
                i["pid"] = pid

    def _on_telemetry(self, pkt: TelemetryPacket) -> None:
        cards = []
        for card in pkt.cards:
            if isinstance(card, dict):
                cards.append(dict(card, node=pkt.node, ts=pkt.ts))
        self.compute.on_cards(cards)
        step = self.last_reduced.step if self.last_reduced else 0
        self.sinks.telemetry(pkt.node, cards, pkt.ts, step)
        verdict = self.decisions.on_telemetry(cards, time.time(), step)
        self._record(verdict)
        self.sinks.decided(verdict)

    def milestone(self, text: str, step: int) -> None:
        self.sinks.milestone(text, step)

    # ---- one step's pipeline: reduce → decide → views -------------------------------------
    def _on_reduced(self, red: ReducedStep) -> None:
        """Settle one reduced step: its bookkeeping, its decisions (recorded in anomalies.jsonl as
        they fire), then its views, queued until its lease is out (`Sinks.defer`)."""
        also = self._reduce(red)
        verdict = self.decisions.on_reduced(red, self.replaying)
        self._record(verdict)
        self.sinks.reduced(red, also, verdict)

    def _reduce(self, red: ReducedStep) -> list[tuple[str, Any]]:
        """What the aggregator adds to a reduced step (MFU, straggler scores, goodput, the run's
        totals) and keeps of it (metrics.msgpack). Returns the scalars only the aggregator knows."""
        if self.steps_reduced == 1:
            self.milestone("first step", red.step)
        self.steps_reduced += 1
        self.compute.on_step(red)  # MFU, and the compute-drop flags where no node judged the step
        self.last_reduced = red
        self.recent.append(red)
        self.goodput.add(StepTimes.of(red))
        also: list[tuple[str, Any]] = []
        launch = self.settings.launch_started
        if launch and red.ts > launch:
            ettr = (self.settings.productive_before_s + self.goodput.cum["productive"]) / (red.ts - launch)
            also.append(("goodput/ettr", ettr))
        self.totals.add(red)
        self._check_fingerprints(red)
        if red.straggler_inputs:  # merged node partials: the nodes scored their ranks
            red.straggler_scores = straggler_scores(red.straggler_inputs, self.straggler_threshold,
                                                    also=collect_ranks(red.step, self.world_size, self.collect_freq))
        else:
            self.stragglers.update(red)
        self.metrics.append_reduced(red)
        return also

    def _record(self, verdict: Verdict) -> None:
        """anomalies.jsonl, as the rules fire (a replay's were recorded before the restart)."""
        if not self.replaying:
            for rec in verdict.records:
                self.anomalies.append(rec)

    def run_sinks(self) -> None:
        """Draw the views the reduced steps left waiting, oldest first."""
        self.sinks.run()

    def _check_fingerprints(self, red: ReducedStep) -> None:
        fps = red.fingerprints
        if len(fps) < 2:
            return
        counts = Counter(fps.values())
        if len(counts) == 1:
            return
        majority, _ = counts.most_common(1)[0]
        odd = sorted(r for r, fp in fps.items() if fp != majority)
        entry = {"step": red.step, "ranks": odd, "majority": majority}
        if len(self.fingerprint_mismatches) < 100:
            self.fingerprint_mismatches.append(entry)
        # the `desync` rule reports it (once, with the action); this keeps the record

    # ---- decisions ------------------------------------------------------------------
    def directive_for(self, step: int) -> Directive | None:
        return self.decisions.directive_for(step)

    def lease(self) -> Lease:
        """What every rank may do now (pushed to the ranks through their node's relay)."""
        return self.decisions.lease(self.reducer.reduced_through)

    def request_stop(self, reason: str, rule: str = "interrupt", rank: int | None = None,
                     value: float | None = None, save: bool = False, threshold: float | None = None,
                     rollback: RollbackDecision | None = None) -> None:
        """Stop every rank after the next reduced step plus monitor.max_lag_steps (`Decisions.request_stop`)."""
        self.decisions.request_stop(reason, rule=rule, rank=rank, value=value, save=save, threshold=threshold,
                                    rollback=rollback)

    # ---- output ---------------------------------------------------------------------
    def drain_console(self) -> list[str]:
        return self.sinks.drain()

    def progress(self) -> dict[str, Any]:
        red = self.last_reduced
        ended_at = self.clocks.ended_at
        # the ranks whose training ended, when, and their pids (a process that lives on is ended)
        ended = {"ended_at": dict(ended_at),
                 "pids": {r: self.rank_info.get(r, {}).get("pid") for r in ended_at}} if ended_at else {}
        if red is None:
            return {"step": 0, "reduced_through": max(0, self.reducer.reduced_through), **ended}
        return {
            **ended,
            "reduced_through": max(0, self.reducer.reduced_through),
            "step": red.step,
            "epoch": red.epoch,
            "loss": red.loss_mean,
            "samples_per_s": red.samples_per_s,
            "step_time_s": red.step_time_max,
            "ts": red.ts,
        }

    def snapshot(self) -> dict[str, Any]:
        self.run_sinks()
        ranks = []
        for r in range(self.world_size):
            info = self.rank_info.get(r, {})
            ranks.append({"rank": r, "last_step": self.reducer.last_step_of_rank.get(r, 0),
                          "param_fingerprint": self.totals.fingerprints.get(r),  # the newest it sent
                          "pid": info.get("pid"), "host": info.get("host")})
        d = self.decisions
        return {
            "world_size": self.world_size,
            "steps_completed": self.reducer.reduced_through if self.reducer.reduced_through > 0 else 0,
            "ranks": ranks,
            "stop": self.stop,
            **self.totals.as_dict(),
            "anomalies": d.anomalies_total,
            "anomalies_repeated_while_stopping": d.repeats_while_stopping,
            "rule_errors": d.rule_errors,
            "best_checkpoint": d.best_checkpoint,
            "checkpoints": d.checkpoints[-20:],
            "rank_errors": self.rank_errors,
            "fingerprint_mismatches": self.fingerprint_mismatches,
            "packets": {
                "accepted": self.accepted,
                "rejected": sum(self.rejected.values()),
                "rejected_by_reason": dict(self.rejected),
                "duplicates": self.reducer.duplicates,
                "late": self.reducer.late,
                "incomplete_steps_evicted": self.reducer.evicted_incomplete,
                "group_partials": self.intake.group_partials,
            },
            "aggregator_restarts": self.restarts,
            "goodput": self.goodput.to_dict(),
            "compute": self.compute.summary(),
            "rule_changes": list(self.live_rules.changes),
            "advice": self.advice.to_list(),
            "last_step": self.last_reduced.to_record() if self.last_reduced else None,
        }

    # ---- the hang clocks --------------------------------------------------------------
    def hang_limit(self, timeout_s: float | None) -> float:
        """The hang clock's limit: `timeout_s`, or with None (`monitor.hang_timeout_s: auto`) the
        one the recent reduced steps' times give (config.auto_hang_timeout)."""
        return self.clocks.limit(timeout_s, [red.step_time_max for red in self.recent if red.step > self.start_step])

    def hang_check(self, timeout_s: float | None, heartbeat_stale_s: float) -> dict[str, Any] | None:
        """None, or the ranks to blame when no live rank is within its clock (`HangClocks.check`)."""
        return self.clocks.check(self.hang_limit(timeout_s), heartbeat_stale_s, no_monitor=self.advice.no_monitor,
                                 last_step_of_rank=lambda r: self.reducer.last_step_of_rank.get(r, 0),
                                 pid_of=lambda r: self.rank_info.get(r, {}).get("pid"),
                                 started_ranks=[r for r, i in self.rank_info.items() if i.get("started")])

    def missing_for(self, step: int) -> list[int]:
        return self.reducer.missing_ranks(step)

    def close(self) -> None:
        self.run_sinks()
        self.metrics.close()
        self.anomalies.close()
        last = self.last_reduced.step if self.last_reduced else 0
        stop = self.decisions.stop
        self.sinks.close("end" + (f" (stopped: {stop.message})" if stop else ""), last)


# The aggregator as a Ray actor: one per run, named, async so decisions can wait. Node
# agents stream their batches over the node uplink (mindpulse/wire/uplink.py: its server runs in
# this actor's event loop, its address comes from `uplink_address`), which also pushes the
# lease down and answers rank 0's decisions at checkpoint candidates once every rank has
# reported that step (or after the timeout, naming the missing ranks). Ray calls remain for
# the launcher (poll, snapshot, stop) and for a rank outside a launch (`ingest`, `decide`,
# `lease` as a long poll: workers/channel.py's ActorChannel).


def actor_name(run_id: str) -> str:
    return f"mindpulse-aggregator-{run_id}"


GC_GEN0_THRESHOLD = 20_000
"""Container allocations between the cyclic collector's youngest passes in the actor's process
(Python's default: 700). Decoding a group's frame and its heartbeat and telemetry records makes
thousands of containers, and every tenth young pass is an older one that walks the aggregator's
whole state: in place at 32,768 ranks (in-process, 7 December) that was about half of what
decoding the uplink frames cost. Garbage without cycles is freed by reference counts as before;
only cycles wait longer."""


def quiet_gc() -> None:
    """The actor's own process: the state built so far (the replay's included) frozen out of
    the collector's passes, and fewer passes (GC_GEN0_THRESHOLD)."""
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])


class AggregatorActor:
    def __init__(self, run_dir: str, world_size: int, per_print_step: int = MonitorConfig.per_print_step,
                 total_steps: int | None = None,
                 settings: AggregatorSettings | None = None):
        # restarted by Ray after a crash: rebuild the state from metrics.msgpack first
        import ray  # the actor runs inside Ray; the core alone (tests, replay) does not need it

        replay = False
        try:
            replay = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        except Exception:  # outside a Ray actor (tests): never reconstructed
            pass
        self.core = AggregatorCore(Path(run_dir), world_size, per_print_step, total_steps, settings, replay=replay)
        self.core.defer_sinks = True  # drawn once the lease and directive are on their way (`_moved`)
        quiet_gc()
        self._reduced = asyncio.Condition()
        self._uplink: UplinkServer | None = None
        self._uplink_lock: asyncio.Lock | None = None

    async def _moved(self, done: list[ReducedStep]) -> None:
        """Steps were reduced: wake the waiting decisions and long polls, push the lease,
        then draw the steps' views (TensorBoard, the console table). The views come after
        the writes this turn of the loop makes (the lease, the frame's ack, a directive:
        `UplinkServer` sends them at the end of the turn): measured on the 2-core machine,
        drawing them first held rank 0's wait at a checkpoint candidate ~2 ms longer (the
        table and the weight histograms fall on the same steps as the candidates)."""
        if done:
            async with self._reduced:
                self._reduced.notify_all()
        if self._uplink is not None:
            self._uplink.push_lease()
            if done:
                self._uplink.answer_ready()  # verdicts leave with the lease, before the views below
        if done:
            # straight to the sinks: the views' turn is theirs, not the pipeline's (core is
            # entered once a step on the way up and once for the lease on the way down)
            asyncio.get_running_loop().call_soon(self.core.sinks.run)

    async def ingest(self, batch: list[bytes]) -> int:
        done = self.core.ingest(batch)
        await self._moved(done)
        return len(done)

    async def ingest_nodes(self, batches: list[tuple[Any, dict[str, Any]]]) -> int:
        """Node batches (node/relay.py), or a group leader's merged ones (node/group.py)."""
        done = self.core.ingest_nodes(batches)
        await self._moved(done)
        return len(done)

    # ---- the node uplinks (mindpulse/wire/uplink.py): how node agents send their steps -------------
    async def uplink_address(self) -> tuple[str, int, str]:
        """(host, port, token) of this instance's uplink server, started on first ask."""
        if self._uplink_lock is None:
            self._uplink_lock = asyncio.Lock()
        async with self._uplink_lock:
            if self._uplink is None:
                import ray

                server = UplinkServer(self.ingest_nodes, self._directive, lambda: self.core.lease().encode(),
                                      directive_now=self._directive_now)
                await server.start(ray.util.get_node_ip_address())
                self._uplink = server
        return self._uplink.address

    async def decide(self, batch: list[bytes], step: int, timeout_s: float) -> bytes:
        """Ingest `batch` (ending with this rank's packet for `step`) and wait for the directive."""
        await self.ingest(batch)
        return await self._directive(step, timeout_s)

    def _directive_now(self, step: int) -> bytes | None:
        directive = self.core.directive_for(step)
        return directive.encode() if directive is not None else None

    async def _directive(self, step: int, timeout_s: float) -> bytes:
        directive = self.core.directive_for(step)
        if directive is None:
            try:
                async with self._reduced:
                    await asyncio.wait_for(
                        self._reduced.wait_for(lambda: self.core.directive_for(step) is not None), timeout_s
                    )
            except TimeoutError:
                missing = self.core.missing_for(step)
                self.core.console.append(
                    f"WARNING no directive for step {step} after {timeout_s:.0f}s: ranks {missing} have not reported it"
                )
                return Directive(step=step, reason=f"timeout: ranks {missing} missing").encode()
            directive = self.core.directive_for(step)
        return directive.encode()

    async def lease(self, after: int, timeout_s: float) -> bytes:
        """Long poll (one outstanding call per node agent): the lease once a step beyond
        `after` is reduced or a stop is decided, else the current one after `timeout_s`."""

        def moved() -> bool:
            lease = self.core.lease()
            return lease.reduced_through > after or lease.stopping

        if not moved():
            try:
                async with self._reduced:
                    await asyncio.wait_for(self._reduced.wait_for(moved), timeout_s)
            except TimeoutError:
                pass
        return self.core.lease().encode()

    async def request_stop(self, reason: str, rule: str = "interrupt", save: bool = False) -> None:
        self.core.request_stop(reason, rule=rule, save=save)

    async def poll(self) -> dict[str, Any]:
        self.core.live_rules.tick()  # rule changes are picked up between steps too (the launcher polls)
        return {"console": self.core.drain_console(), "progress": self.core.progress()}

    async def snapshot(self) -> dict[str, Any]:
        return self.core.snapshot()

    async def close(self) -> dict[str, Any]:
        if self._uplink is not None:
            await self._uplink.close()
        snap = self.core.snapshot()
        snap["uplink"] = dict(self._uplink.stats) if self._uplink is not None else {}
        self.core.close()
        return snap

    async def hang_check(self, timeout_s: float | None, heartbeat_stale_s: float):
        return self.core.hang_check(timeout_s, heartbeat_stale_s)

    async def ping(self) -> int:
        return os.getpid()


def start_aggregator(run_id: str, namespace: str, run_dir: Path, world_size: int, per_print_step: int,
                     total_steps: int | None, node_id: str | None = None,
                     settings: AggregatorSettings | None = None):
    """Start the named actor; pinned to the driver's node so it can write the run directory.
    `settings`: built by `launcher/spec.py`'s `aggregator_settings` (the benchmarks build them
    the same way)."""
    options: dict[str, Any] = dict(
        name=actor_name(run_id),
        namespace=namespace,
        num_cpus=0,
        max_concurrency=4096,
        lifetime=None,
        # a crashed aggregator is restarted and rebuilds itself from metrics.msgpack; calls
        # made meanwhile wait in their callers and are retried on the new instance
        max_restarts=5,
        max_task_retries=-1,
        # ranks need protobuf's pure-Python implementation to import MindSpore (the job's
        # workers get it); the aggregator imports no MindSpore, and its TensorBoard events
        # encode ~8x faster with the compiled one
        runtime_env={"env_vars": {"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "upb"}},
    )
    if node_id:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    import ray

    cls = ray.remote(AggregatorActor)
    return cls.options(**options).remote(str(run_dir), world_size, per_print_step, total_steps, settings)
