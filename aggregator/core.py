"""The aggregator's state machine, free of Ray (only the actor below imports it, lazily) so it is tested directly.

Packets in → validated, stored in `metrics.msgpack`, reduced per complete step →
decisions (directives) and console tables out. `AggregatorActor` (below) wraps it as a Ray actor.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import re
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mindpulse.config import auto_hang_timeout, sections_of
from mindpulse.partial import collect_ranks
from mindpulse.partial import from_wire as partial_from_wire
from mindpulse.protocol import (
    Action,
    CheckpointKind,
    Directive,
    EventKind,
    EventPacket,
    Lease,
    Packet,
    PacketError,
    StepPacket,
    TelemetryPacket,
    decode,
)
from mindpulse.uplink import UplinkServer

from . import tables
from .advice import Advice
from .anomaly_log import AnomalyLog
from .card_peaks import peak_dtype
from .compute import ComputeWatch, compute_drop_window
from .goodput import GoodputClock, StepTimes
from .metrics_store import MetricsWriter
from .policies import Firing, PolicyEngine, build_rules
from .reducer import ReducedStep, RunTotals, StepReducer, StragglerTracker, straggler_scores
from .rule_changes import LiveRules

log = logging.getLogger(__name__)

_KEEP_DIRECTIVES = 1024
_KEEP_HISTORY = 512
_IN_STEP = re.compile(r"^in step (\d+)$")
_BUSY = re.compile(r"^(saving|evaluating) after step (\d+)$")
"""The heartbeat of a rank writing a checkpoint or evaluating (workers/heartbeat.py): not a hang."""
"""A heartbeat's message while the rank's loop is inside a step (workers/heartbeat.py IN_STEP)."""


class AggregatorCore:
    def __init__(
        self,
        run_dir: Path | str,
        world_size: int,
        per_print_step: int = 10,
        total_steps: int | None = None,
        settings: dict[str, Any] | None = None,
        replay: bool = False,
    ):
        """`settings`: the run config's `anomalies`, `checkpoint` and `eval` sections as dicts."""
        settings = settings or {}
        self.replaying = False
        self.restarts = 0
        self.run_dir = Path(run_dir)
        # typed, with the config's one set of defaults (rules are built from their dicts below)
        cfg = sections_of({k: v for k, v in settings.items() if k != "anomalies"})
        self.ckpt = cfg.checkpoint
        self.straggler_threshold = cfg.monitor.straggler_threshold
        self.device = cfg.world.device.value
        self.max_lag = cfg.monitor.max_lag_steps
        self.start_step = int(settings.get("start_step") or 0)
        self.goodput = GoodputClock()
        base = settings.get("goodput") or {}
        self.launch_started = float(base.get("started") or 0.0)
        self.productive_before = float(base.get("productive_s") or 0.0)
        """Productive seconds of the earlier attempts (the live `goodput/ettr` spans the launch)."""
        self.rollbacks_done: dict[str, int] = dict(settings.get("rollbacks") or {})
        """Rollbacks each rule has made in this launch (the launcher's count, per attempt)."""
        """The step this attempt starts after (a resumed run): the step window counts from it."""
        self.collect_freq = cfg.monitor.collect_freq
        self.stragglers = StragglerTracker(cfg.monitor.straggler_window)
        self.console: deque[str] = deque(maxlen=1000)
        self.compute = ComputeWatch(self.run_dir, cfg.world.peak_tflops,
                                    str(settings.get("peak_dtype") or peak_dtype()),
                                    compute_drop_window(settings.get("anomalies")), say=self.console.append)
        self.policies = PolicyEngine(build_rules([dict(c) for c in settings.get("anomalies") or []],
                                                 extra_kinds=settings.get("extra_rules"),
                                                 straggler_threshold=self.straggler_threshold))
        self.anomalies = AnomalyLog(self.run_dir)  # a restarted attempt (or aggregator) continues it
        self.rule_errors: list[dict[str, Any]] = []
        self.anomalies_total = 0
        self.repeats_while_stopping = 0
        """Firings of the stopping rule between its decision and the stop step, not re-reported."""
        self.best: tuple[float, int] | None = None
        """(metric, step) of the best reduced metric that was saved (or asked to be)."""
        self.checkpoints: list[dict[str, Any]] = []
        self.best_checkpoint: dict[str, Any] | None = None
        seed = settings.get("best")  # the manifest's best when this attempt started (a restart)
        if (isinstance(seed, dict) and seed.get("metric_name") == self.ckpt.best_metric
                and isinstance(seed.get("metric"), (int, float)) and math.isfinite(seed["metric"])):
            self.best = (float(seed["metric"]), int(seed.get("step") or 0))
            self.best_checkpoint = {"path": seed.get("path"), "step": self.best[1], "metric": self.best[0],
                                    "metric_name": seed["metric_name"]}
        self.rank_errors: list[dict[str, Any]] = []
        self.defer_sinks = False
        """Set (the actor): the views of a reduced step (its TensorBoard event, the console
        table) wait in `_sinks` until `run_sinks()`, so the lease and the directive the step
        decided leave first (see `AggregatorActor._moved`); unset: they run as it is reduced."""
        self._sinks: deque[Callable[[], None]] = deque()
        self.tb = None
        if settings.get("tensorboard", True):
            from .tb_sink import TensorBoardSink

            self.tb = TensorBoardSink(self.run_dir, collect_freq=self.collect_freq,
                                      straggler_threshold=self.straggler_threshold)
            if settings.get("config_yaml"):
                self.tb.on_text("config", "```\n" + settings["config_yaml"] + "\n```")
            self.milestone("start", 0)
        self.world_size = world_size
        self.per_print_step = max(1, per_print_step)
        self.total_steps = total_steps
        self.metrics = MetricsWriter.for_run(self.run_dir, cfg, settings, restart=replay)
        self.reducer = StepReducer(world_size, ranks_per_node=cfg.world.ranks_per_node)
        self.accepted = 0
        self.rejected: Counter[str] = Counter()
        self.directives: OrderedDict[int, Directive] = OrderedDict()
        self.recent: deque[ReducedStep] = deque(maxlen=_KEEP_HISTORY)
        self.stop_request: tuple[str, dict[str, Any]] | None = None
        self.stop: dict[str, Any] | None = None
        self.rank_info: dict[int, dict[str, Any]] = {}
        self.totals = RunTotals()
        self.steps_reduced = 0
        self.last_reduced: ReducedStep | None = None
        self.fingerprint_mismatches: list[dict[str, Any]] = []
        self.telemetry_latest: dict[tuple[str, Any], dict[str, Any]] = {}
        self.started = time.time()
        self.last_progress = time.time()
        """When any rank last finished a step it had not reported before."""
        self.heartbeat: dict[int, tuple[float, int]] = {}
        self.ended_at: dict[int, float] = {}
        """When each rank said its training ended (its END: the Monitor's end of training, or its
        script's end): a process still alive `monitor.exit_timeout_s` later is named and ended."""
        # the hang clocks (hang_check): start-up until a rank's first finished step, then per rank
        self.startup_timeout_s = float(cfg.monitor.startup_timeout_s or cfg.msrun.cluster_time_out)
        self.first_step: dict[int, int] = {}
        """Each rank's first reported step (the one it started at: 0, or the resume step)."""
        self.top_step: dict[int, int] = {}
        self.progress_at: dict[int, float] = {}
        self.node_first: dict[int, int] = {}
        self.node_top: dict[int, int] = {}
        self.node_progress_at: dict[int, float] = {}
        """The same clocks per node, from node partials (every rank of the node reached the step)."""
        """When each rank last finished a new step; absent while it is starting up."""
        self.in_step: dict[int, int] = {}
        """The step each rank's loop was inside at its last heartbeat (absent: between steps)."""
        self.advice = Advice(world_size)
        """Ranks without a Monitor, callbacks of several ranks writing one directory (advice.py)."""
        # rules changed on the running job (`mindpulse rules`), kept across restarts: rule_changes.py
        self.live_rules = LiveRules(self.run_dir, self.policies, settings, replay=replay,
                                    straggler_threshold=self.straggler_threshold, say=self.console.append,
                                    next_step=lambda: self.reducer.reduced_through + 1, milestone=self.milestone)
        if replay:  # last: every attribute the packets touch must exist
            self._replay()

    def _replay(self) -> None:
        """Rebuild the state of a restarted aggregator from metrics.msgpack — every segment,
        the records of this aggregator's attempt only (another attempt's steps are another
        reducer's) — without writing anything again. A step whose per-rank packets were thinned
        counts through its reduced record; damaged bytes are skipped and counted."""
        from mindpulse.protocol import PacketError, from_wire

        from . import metrics_store as ms

        self.replaying = True
        self.restarts += 1
        self.metrics.paused = True
        stats = ms.ReadStats()
        mine = self.metrics.attempt
        n = from_records = 0
        completed: set[int] = set()  # steps this replay completed from their packets
        try:
            for attempt, obj in ms.with_attempts(ms.read_records(self.metrics.path, stats)):
                if attempt != mine:
                    continue
                t = obj.get("t")
                if t == ms.REDUCED:
                    red = ms.reduced_from_record(obj)
                    if red is None or red.step in completed:
                        continue
                    ms.drop_pending(self.reducer, red.step)
                    self.reducer.reduced_through = max(self.reducer.reduced_through, red.step)
                    self.totals.add(red)
                    self.steps_reduced += 1
                    from_records += 1
                    continue
                if t in ms.META_TYPES:
                    continue
                try:
                    pkt = from_wire(obj)
                except PacketError:
                    continue
                self.accepted += 1
                n += 1
                completed.update(r.step for r in self._accept_one(pkt))
        finally:
            self.replaying = False
            self.metrics.paused = False
        self.replay_stats = dict(stats.as_dict(), packets=n, steps_from_records=from_records)
        notes = [f"{stats.segments} segment(s)"]
        if from_records:
            notes.append(f"{from_records} thinned step(s) from their reduced records")
        if stats.skipped_bytes:
            notes.append(f"{stats.skipped_bytes} damaged byte(s) skipped in {stats.skipped_stretches} stretch(es)")
        self.console.clear()
        self.console.append(f"aggregator restarted: rebuilt from {n} packets of attempt {mine} in metrics.msgpack "
                            f"({'; '.join(notes)}) (through step {self.reducer.reduced_through})")

    # ---- input ---------------------------------------------------------------------
    def ingest(self, batch: list[bytes]) -> list[ReducedStep]:
        """Accept a batch of encoded packets; returns the steps this batch completed."""
        good_raw: list[bytes] = []
        packets: list[Packet] = []
        for raw in batch if isinstance(batch, (list, tuple)) else [batch]:
            try:
                pkt = decode(raw)
            except PacketError as exc:
                self.rejected[exc.reason] += 1
                continue
            why = self._out_of_bounds(pkt)
            if why:  # before any bookkeeping: a forged rank or step must not move the clocks
                self.rejected[why] += 1
                continue
            good_raw.append(bytes(raw))
            packets.append(pkt)
        self.metrics.append(good_raw)
        self.accepted += len(packets)
        done: list[ReducedStep] = []
        for pkt in packets:
            done.extend(self._accept_one(pkt))
        return done

    STEP_WINDOW = 256
    """How far beyond the newest reduced step (or the start step) a packet's step may be."""

    def _out_of_bounds(self, pkt: Packet) -> str:
        rank = getattr(pkt, "rank", None)
        if rank is not None and rank >= self.world_size:
            return "rank_out_of_world"
        step = getattr(pkt, "step", None)
        if step is not None and step > max(self.reducer.reduced_through, self.start_step) + self.STEP_WINDOW:
            return "step_out_of_window"
        return ""

    def _accept_one(self, pkt: Packet) -> list[ReducedStep]:
        """One packet in isolation: whatever it holds, the batch goes on (counted)."""
        try:
            return self._accept(pkt)
        except Exception as exc:
            self.rejected["apply_error"] += 1
            if self.rejected["apply_error"] <= 5:
                log.exception("a %s packet could not be applied: %s", type(pkt).__name__, exc)
            return []

    group_partials = 0
    """Step partials that came merged over several nodes by a group leader."""

    def ingest_nodes(self, batches: list[tuple[Any, dict[str, Any]]]) -> list[ReducedStep]:
        """Several nodes' batches in one call (a group leader's), each `(node or nodes, batch)`."""
        done: list[ReducedStep] = []
        with self.metrics.held():  # one write to metrics.msgpack per call
            for nodes, batch in batches:
                done.extend(self.ingest_node(nodes, batch))
        return done

    def ingest_node(self, node: int | list[int], batch: dict[str, Any]) -> list[ReducedStep]:
        """A node agent's batch (node/relay.py): its step packets validated there (stored
        as they are, never decoded here), its other packets, and one partial per step its
        ranks completed; the work per step follows nodes, not ranks."""
        steps = batch.get("steps") or []
        if not isinstance(steps, list):
            steps = []
        try:  # the common case costs one join: every item bytes-like
            self.metrics.append(steps)
        except TypeError:  # something else among them: store the bytes, drop the rest
            steps = [bytes(b) for b in steps if isinstance(b, (bytes, bytearray))]
            self.metrics.append(steps)
        self.accepted += len(steps)
        for reason, n in (batch.get("rejected") or {}).items():
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                self.rejected[f"node:{reason}"[:64]] += n
        done = self.ingest(list(batch.get("other") or []))
        for wire in batch.get("partials") or []:
            try:
                part = partial_from_wire(wire)
            except Exception:
                self.rejected["malformed_partial"] += 1
                continue
            if part.step > max(self.reducer.reduced_through, self.start_step) + self.STEP_WINDOW:
                self.rejected["step_out_of_window"] += 1
                continue
            now = time.time()
            for n in [node] if isinstance(node, int) else node:
                first = self.node_first.setdefault(n, part.step)
                if part.step > self.node_top.get(n, first):
                    self.node_top[n] = part.step
                    self.node_progress_at[n] = now
                    self.last_progress = now
            if not isinstance(node, int) and len(node) > 1:
                self.group_partials += 1  # a group leader's merge of several nodes (node/group.py)
            out = self.reducer.add_partial(node, part)
            for red in out:
                self._on_reduced(red)
            done.extend(out)
        return done

    def _accept(self, pkt: Packet) -> list[ReducedStep]:
        if isinstance(pkt, StepPacket):
            now = time.time()
            if pkt.step > self.reducer.last_step_of_rank.get(pkt.rank, -1):
                self.last_progress = now
            self.heartbeat[pkt.rank] = (now, pkt.step)
            self._note_step(pkt.rank, pkt.step, now)
            out = self.reducer.add(pkt)
            for red in out:
                self._on_reduced(red)
            return out
        if isinstance(pkt, EventPacket):
            info = self.rank_info.setdefault(pkt.rank, {})
            if pkt.kind in (EventKind.START, EventKind.NO_MONITOR, EventKind.ADVICE):
                said = self.advice.on_event(pkt)
                if not self.replaying:
                    self.console.extend(said)
            if pkt.kind == EventKind.START:
                info.update(pid=pkt.pid, host=pkt.host, started=pkt.ts)
            elif pkt.kind == EventKind.CHECKPOINT:
                self._on_checkpoint(pkt)
            elif pkt.kind == EventKind.STRUCTURE:
                if self.tb is not None and not self.replaying:
                    self.tb.on_text("model/structure", pkt.message, 0)
            elif pkt.kind == EventKind.HEARTBEAT:
                self.heartbeat[pkt.rank] = (time.time(), pkt.step)
                self._note_step(pkt.rank, pkt.step, time.time(), pkt.message)
                info.setdefault("pid", pkt.pid)
            elif pkt.kind == EventKind.END:
                self.ended_at.setdefault(pkt.rank, pkt.ts or time.time())
                info["end"] = pkt.message or True
            elif pkt.kind == EventKind.MONITOR_ERROR:
                if not self.replaying:
                    self.console.append(f"rank {pkt.rank}: monitor error (training goes on): {pkt.message}")
            elif pkt.kind == EventKind.ERROR:
                if len(self.rank_errors) < 100:
                    self.rank_errors.append({"rank": pkt.rank, "step": pkt.step, "message": pkt.message})
                if not self.replaying:
                    self.console.append(f"rank {pkt.rank}: {pkt.message}")
                if pkt.message.startswith("checkpoint save") and self.ckpt.on_save_error == "stop":
                    self.request_stop(f"{pkt.message} (checkpoint.on_save_error: stop)", rule="checkpoint_save",
                                      rank=pkt.rank)
            else:
                info[pkt.kind] = pkt.message or True
        elif isinstance(pkt, TelemetryPacket):
            cards = []
            for card in pkt.cards:
                if isinstance(card, dict):
                    rec = dict(card, node=pkt.node, ts=pkt.ts)
                    self.telemetry_latest[(pkt.node, card.get("card"))] = rec
                    cards.append(rec)
            self.compute.on_cards(cards)
            step = self.last_reduced.step if self.last_reduced else 0
            if self.tb is not None and not self.replaying:
                self.tb.on_telemetry(pkt.node, cards, pkt.ts, step)
            for f in self.policies.on_telemetry(cards, time.time(), step):
                self._on_firing(f)
            self._on_rule_errors(step)
        return []

    def milestone(self, text: str, step: int) -> None:
        if self.tb is not None and not self.replaying:
            self.tb.on_text("milestones", f"{time.strftime('%Y-%m-%d %H:%M:%S')} step {step}: {text}", step)

    def _on_checkpoint(self, pkt: EventPacket) -> None:
        import json

        try:
            entries = json.loads(pkt.message)
        except ValueError:
            return
        self.goodput.checkpoint_at(pkt.step)
        for e in entries if isinstance(entries, list) else []:
            step = e.get("step") if isinstance(e, dict) else None
            if not (isinstance(step, int) and not isinstance(step, bool) and 0 <= step
                    and isinstance(e.get("path"), str) and isinstance(e.get("kind"), str)):
                self.rejected["bad_checkpoint_entry"] += 1  # checked before it reaches a table
                continue
            self.checkpoints.append(e)
            if e.get("kind") == CheckpointKind.BEST:
                self.best_checkpoint = {"path": e.get("path"), "step": e.get("step"), "metric": e.get("metric"),
                                        "metric_name": e.get("metric_name")}
            self.console.append(f"checkpoint ({e.get('kind')}) step {e.get('step')}: {e.get('path')}")
            self.milestone(f"checkpoint {e.get('kind')} {e.get('path')}", step)
        del self.checkpoints[:-200]

    def _on_rule_errors(self, step: int) -> None:
        """A rule that raised is reported once per rule and cause (it would never fire)."""
        for err in self.policies.take_errors():
            if len(self.rule_errors) < 100:
                self.rule_errors.append(dict(err, step=step))
            if self.replaying:
                continue
            self.anomalies.append({"rule": err["rule"], "kind": "rule_error", "step": step, "rank": None,
                                   "value": None, "threshold": None, "action": "none",
                                   "message": f"rule {err['rule']} failed and is not checking: {err['error']}"})
            self.console.append(f"RULE ERROR {err['rule']} at step {step}: {err['error']} (the rule cannot fire)")
            log.error("rule %s raised at step %d: %s", err["rule"], step, err["error"])

    def _on_firing(self, f: Firing) -> None:
        """Record once (anomalies.jsonl), print once, and stop every rank if the rule says so."""
        if self.stop is not None and f.rule == self.stop.get("rule") and f.step > self.stop.get("decided_at", f.step):
            # the steps run while every rank reaches the stop step repeat its cause (a NaN
            # in the weights stays there): reported once, counted
            self.repeats_while_stopping += 1
            return
        rec = f.to_record()
        self.anomalies_total += 1
        if self.replaying:  # recorded before the restart (anomalies.json was reloaded)
            if f.action.stops:
                self.request_stop(f.message, rule=f.rule, rank=f.rank, value=f.value,
                                  save=f.action is Action.SAVE_AND_STOP, threshold=f.threshold,
                                  rollback=self._rollback_of(f))
            return
        self.anomalies.append(rec)
        where = f" (rank {f.rank})" if f.rank is not None else ""
        self.console.append(f"ANOMALY {f.rule}{where} -> {f.action.value}: {f.message}")
        if self.tb is not None:
            self.tb.on_anomaly(rec)
            self.milestone(f"anomaly {f.rule}: {f.message}", f.step)
        if f.action.stops:
            self.request_stop(f.message, rule=f.rule, rank=f.rank, value=f.value,
                              save=f.action is Action.SAVE_AND_STOP, threshold=f.threshold,
                              rollback=self._rollback_of(f))

    def _rollback_of(self, f: Firing) -> dict[str, Any] | None:
        """What the launcher needs to roll back after `f` (a rollback rule with rollbacks
        left), else None: the rule then stops the job as `stop` does, and says why."""
        if f.action is not Action.ROLLBACK:
            return None
        rule = next((r for r in self.policies.rules if r.name == f.rule), None)
        cfg = rule.cfg if rule is not None else {}
        limit = int(cfg.get("max_rollbacks", 2))
        done = int(self.rollbacks_done.get(f.rule, 0))
        if done >= limit:
            self.console.append(f"ANOMALY {f.rule}: {done} rollback(s) made, max_rollbacks {limit}: stopping the job")
            return None
        return {"rule": f.rule, "anomaly_step": f.step, "skip_batches": bool(cfg.get("skip_batches", True)),
                "lr_factor": float(cfg.get("lr_factor", 0.5)), "lr_steps": int(cfg.get("lr_steps", 100))}

    # ---- reduction → decisions ------------------------------------------------------
    def _on_reduced(self, red: ReducedStep) -> None:
        if self.steps_reduced == 1:
            self.milestone("first step", red.step)
        self.steps_reduced += 1
        self.compute.on_step(red)  # MFU, and the compute-drop flags where no node judged the step
        self.last_reduced = red
        self.recent.append(red)
        self.goodput.add(StepTimes.of(red))
        if self.tb is not None and not self.replaying:
            also = []
            if self.launch_started and red.ts > self.launch_started:
                ettr = (self.productive_before + self.goodput.cum["productive"]) / (red.ts - self.launch_started)
                also.append(("goodput/ettr", ettr))
            self._sink(functools.partial(self._tb_step, red, also))
        self.totals.add(red)
        self._check_fingerprints(red)
        if red.straggler_inputs:  # merged node partials: the nodes scored their ranks
            red.straggler_scores = straggler_scores(red.straggler_inputs, self.straggler_threshold,
                                                    also=collect_ranks(red.step, self.world_size, self.collect_freq))
        else:
            self.stragglers.update(red)
        self.metrics.append_reduced(red)
        self.live_rules.before_step(red.step, self.replaying)  # changes apply between steps
        for f in self.policies.on_step(red):
            self._on_firing(f)
        self._on_rule_errors(red.step)
        decision_step = any(p.decision for p in red.per_rank.values())
        if self.stop_request is not None and self.stop is None:
            # decided now, at step S; ranks may already be running up to S+max_lag (their
            # lease allowed it): every rank stops after that same step
            reason, stop = self.stop_request
            save_last = bool(stop.pop("save", False) and self.ckpt.save_last)
            self.stop = dict(stop, step=red.step + self.max_lag, decided_at=red.step, save_last=save_last)
            self.console.append(f"stopping every rank after step {self.stop['step']}: {reason}"
                                + (f" (decided at step {red.step})" if self.max_lag else ""))
        directive = Directive(step=red.step)
        if decision_step:
            directive = self._save_decision(red, directive)
        if self.stop is not None and red.step >= self.stop["step"]:
            directive.action, directive.reason = Action.STOP, self.stop.get("message", "")
            if self.stop.get("save_last") and CheckpointKind.LAST not in directive.save_kinds:
                directive.save = ",".join([k.value for k in directive.save_kinds] + [CheckpointKind.LAST.value])
        self.directives[red.step] = directive
        while len(self.directives) > _KEEP_DIRECTIVES:
            self.directives.popitem(last=False)
        if (red.step % self.per_print_step == 0 or (self.total_steps and red.step == self.total_steps)
                or any(k.startswith("eval_") for k in red.extra) or directive.action is Action.STOP):
            self._sink(functools.partial(self._table, red))

    # ---- the views of a reduced step: after its lease and directive (see defer_sinks) ---------
    def _sink(self, view: Callable[[], None]) -> None:
        self._sinks.append(view)
        if not self.defer_sinks:
            self.run_sinks()

    def run_sinks(self) -> None:
        """Draw the views the reduced steps left waiting, oldest first."""
        while self._sinks:
            self._sinks.popleft()()

    def _tb_step(self, red: ReducedStep, also: list[tuple[str, Any]]) -> None:
        self.tb.on_reduced(red, also)  # one event holds the step's scalars and histograms
        w = next((p.weights for p in red.per_rank.values() if p.weights), None)
        if w:
            self.tb.on_weights(red.step, w)

    def _table(self, red: ReducedStep) -> None:
        try:  # a table is a view: it must never cost a stop or a save decided above
            text = tables.cluster_table(red, self.total_steps, self.straggler_threshold)
            if self.telemetry_latest:
                text += "\n" + tables.card_table(self.telemetry_latest.values(), self.compute.card_tflops)
        except Exception as exc:
            self.rejected["table_error"] += 1
            text = f"step {red.step}: the cluster table could not be drawn ({type(exc).__name__}: {exc})"
        self.console.append(text)

    def _save_decision(self, red: ReducedStep, d: Directive) -> Directive:
        """Which checkpoints rank 0 writes after this step: periodic and/or best."""
        c = self.ckpt
        kinds: list[CheckpointKind] = []
        if c.periodic_due(red.step):  # the rule rank 0's schedule waits by
            kinds.append(CheckpointKind.PERIODIC)
        if c.best_due(red.step) and not red.nonfinite_ranks:
            name = c.best_metric
            value = red.metric(name)  # None where the step has no such metric (no evaluation)
            if value is not None and math.isfinite(value):
                better = (self.best is None or (value < self.best[0] if c.best_mode.value == "min"
                                                else value > self.best[0]))
                if better:
                    self.best = (value, red.step)
                    kinds.append(CheckpointKind.BEST)
                    d.metric, d.metric_name = value, name
        d.save = ",".join(k.value for k in kinds)
        return d

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

    def directive_for(self, step: int) -> Directive | None:
        return self.directives.get(step)

    def lease(self) -> Lease:
        """What every rank may do now (pushed to the ranks through their node's relay)."""
        stop = self.stop or {}
        return Lease(reduced_through=self.reducer.reduced_through, stop_after=int(stop.get("step", -1)),
                     reason=str(stop.get("message", "")), save_last=bool(stop.get("save_last", False)))

    def request_stop(self, reason: str, rule: str = "interrupt", rank: int | None = None,
                     value: float | None = None, save: bool = False, threshold: float | None = None,
                     rollback: dict[str, Any] | None = None) -> None:
        """Stop every rank after the next reduced step plus monitor.max_lag_steps (first request wins).

        `save`: rank 0 also writes a `last` checkpoint after that step (interrupts and
        save_and_stop rules); `rollback`: the launcher then resumes from a checkpoint before
        the anomaly (`stop.rollback` in summary.json's attempts)."""
        if self.stop_request is None and self.stop is None:
            stop = {"rule": rule, "rank": rank, "value": value, "threshold": threshold, "message": reason,
                    "save": save}
            if rollback is not None:
                stop["rollback"] = rollback
            self.stop_request = (reason, stop)

    # ---- output ---------------------------------------------------------------------
    def drain_console(self) -> list[str]:
        self.run_sinks()  # the tables of the steps reduced so far
        out = list(self.console)
        self.console.clear()
        return out

    def progress(self) -> dict[str, Any]:
        red = self.last_reduced
        # the ranks whose training ended, when, and their pids (a process that lives on is ended)
        ended = {"ended_at": dict(self.ended_at),
                 "pids": {r: self.rank_info.get(r, {}).get("pid") for r in self.ended_at}} if self.ended_at else {}
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
        return {
            "world_size": self.world_size,
            "steps_completed": self.reducer.reduced_through if self.reducer.reduced_through > 0 else 0,
            "ranks": ranks,
            "stop": self.stop,
            **self.totals.as_dict(),
            "anomalies": self.anomalies_total,
            "anomalies_repeated_while_stopping": self.repeats_while_stopping,
            "rule_errors": self.rule_errors,
            "best_checkpoint": self.best_checkpoint,
            "checkpoints": self.checkpoints[-20:],
            "rank_errors": self.rank_errors,
            "fingerprint_mismatches": self.fingerprint_mismatches,
            "packets": {
                "accepted": self.accepted,
                "rejected": sum(self.rejected.values()),
                "rejected_by_reason": dict(self.rejected),
                "duplicates": self.reducer.duplicates,
                "late": self.reducer.late,
                "incomplete_steps_evicted": self.reducer.evicted_incomplete,
                "group_partials": self.group_partials,
            },
            "aggregator_restarts": self.restarts,
            "goodput": self.goodput.to_dict(),
            "compute": self.compute.summary(),
            "rule_changes": list(self.live_rules.changes),
            "advice": self.advice.to_list(),
            "last_step": self.last_reduced.to_record() if self.last_reduced else None,
        }

    def _note_step(self, rank: int, step: int, now: float, heartbeat: str | None = None) -> None:
        """A rank's step (its packet or its heartbeat): the hang clocks' bookkeeping."""
        first = self.first_step.setdefault(rank, step)
        if step > self.top_step.get(rank, first):
            self.top_step[rank] = step
            self.progress_at[rank] = now  # its first finished step ends its start-up
        if heartbeat is not None:
            m = _IN_STEP.match(heartbeat)
            if m:
                self.in_step[rank] = int(m.group(1))
            else:
                self.in_step.pop(rank, None)
            if rank in self.progress_at and _BUSY.match(heartbeat):
                self.progress_at[rank] = now  # saving or evaluating: its clock waits until it is done

    def hang_limit(self, timeout_s: float | None) -> float:
        """The hang clock's limit: `timeout_s`, or with None (`monitor.hang_timeout_s: auto`) the
        one the recent reduced steps' times give (config.auto_hang_timeout)."""
        if timeout_s is not None:
            return timeout_s
        return auto_hang_timeout([red.step_time_max for red in self.recent if red.step > self.start_step],
                                 self.device)

    def hang_check(self, timeout_s: float | None, heartbeat_stale_s: float) -> dict[str, Any] | None:
        """None, or the ranks to blame when no live rank is within its clock.

        A rank's clock starts at its first finished step (the step after the one it started
        at) and runs `timeout_s` from its last new step; until that first step (start-up, the
        first graph compile, the first collective's connection) it runs `startup_timeout_s`
        from the aggregator's start. Blamed: the ranks whose heartbeat went silent (stopped
        processes), else the ranks behind the others' last step, else, all at one step, those
        not inside the next step that others are inside (the others wait for them in its
        collective), else every rank at that step."""
        now = time.time()
        timeout_s = self.hang_limit(timeout_s)
        # a rank that trains without a Monitor reports no steps: not a hang (advice.py names it)
        live = [r for r in range(self.world_size) if r not in self.ended_at and r not in self.advice.no_monitor]
        if not live:
            return None
        rpn = self.reducer.ranks_per_node
        # a rank's clock: its own packets and heartbeats, or its node's partials
        progress = {r: max(self.progress_at.get(r, 0.0), self.node_progress_at.get(r // rpn, 0.0) if rpn else 0.0)
                    for r in live}
        progress = {r: t for r, t in progress.items() if t > 0}
        starting = [r for r in live if r not in progress]
        if any(now - progress[r] < timeout_s for r in live if r in progress):
            return None
        if starting and now - self.started < self.startup_timeout_s:
            return None
        silent = [r for r in live if now - self.heartbeat.get(r, (self.started, 0))[0] > heartbeat_stale_s]
        # packets between decision points may still sit in a client's buffer: the heartbeat's
        # step is as fresh as the rank itself
        steps = {r: max(self.reducer.last_step_of_rank.get(r, 0), self.heartbeat.get(r, (0, 0))[1])
                 for r in range(self.world_size)}
        inside = [r for r in live if self.in_step.get(r) == steps[r] + 1]
        if silent:
            stuck = silent
        else:
            low = min(steps[r] for r in live)
            stuck = [r for r in live if steps[r] == low]
            if len(stuck) == len(live):  # all at one step: the ones the others wait for did not enter the next
                outside = [r for r in stuck if r not in inside]
                if inside and outside:
                    stuck = outside
        last = max(progress.values(), default=self.started)
        return {"stuck": sorted(stuck), "steps": steps, "silent": sorted(silent), "inside": sorted(inside),
                "phase": "startup" if starting else "running",
                "limit_s": self.startup_timeout_s if starting else timeout_s,
                "no_progress_s": now - last,
                "pids": {r: self.rank_info.get(r, {}).get("pid") for r in range(self.world_size)},
                "started": sorted(r for r, i in self.rank_info.items() if i.get("started"))}

    def missing_for(self, step: int) -> list[int]:
        return self.reducer.missing_ranks(step)

    def close(self) -> None:
        self.run_sinks()
        self.metrics.close()
        self.anomalies.close()
        if self.tb is not None:
            last = self.last_reduced.step if self.last_reduced else 0
            self.milestone("end" + (f" (stopped: {self.stop.get('message')})" if self.stop else ""), last)
            self.tb.close()


# The aggregator as a Ray actor: one per run, named, async so decisions can wait. Node
# agents stream their batches over the node uplink (mindpulse/uplink.py: its server runs in
# this actor's event loop, its address comes from `uplink_address`), which also pushes the
# lease down and answers rank 0's decisions at checkpoint candidates once every rank has
# reported that step (or after the timeout, naming the missing ranks). Ray calls remain for
# the launcher (poll, snapshot, stop) and for a rank outside a launch (`ingest`, `decide`,
# `lease` as a long poll: workers/session.py's ActorChannel).


def actor_name(run_id: str) -> str:
    return f"mindpulse-aggregator-{run_id}"


class AggregatorActor:
    def __init__(self, run_dir: str, world_size: int, per_print_step: int = 10, total_steps: int | None = None,
                 settings: dict[str, Any] | None = None):
        # restarted by Ray after a crash: rebuild the state from metrics.msgpack first
        import ray  # the actor runs inside Ray; the core alone (tests, replay) does not need it

        replay = False
        try:
            replay = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        except Exception:
            pass
        self.core = AggregatorCore(Path(run_dir), world_size, per_print_step, total_steps, settings, replay=replay)
        self.core.defer_sinks = True  # drawn once the lease and directive are on their way (`_moved`)
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
            asyncio.get_running_loop().call_soon(self.core.run_sinks)

    async def ingest(self, batch: list[bytes]) -> int:
        done = self.core.ingest(batch)
        await self._moved(done)
        return len(done)

    async def ingest_nodes(self, batches: list[tuple[Any, dict[str, Any]]]) -> int:
        """Node batches (node/relay.py), or a group leader's merged ones (node/group.py)."""
        done = self.core.ingest_nodes(batches)
        await self._moved(done)
        return len(done)

    # ---- the node uplinks (mindpulse/uplink.py): how node agents send their steps -------------
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
                     total_steps: int | None, node_id: str | None = None, settings: dict[str, Any] | None = None):
    """Start the named actor; pinned to the driver's node so it can write the run directory."""
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
