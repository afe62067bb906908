"""The aggregator's state machine, free of Ray so it is tested directly.

Packets in → validated, stored in `metrics.msgpack`, reduced per complete step →
decisions (directives) and console tables out. The Ray actor in `actor.py` wraps it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, OrderedDict, deque
from pathlib import Path
from typing import Any

from mindpulse.config import sections_of
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

from . import tables
from .metrics_store import MetricsWriter
from .policies import Firing, PolicyEngine, build_rules
from .reducer import ReducedStep, RunTotals, StepReducer, StragglerTracker

log = logging.getLogger(__name__)

_KEEP_DIRECTIVES = 1024
_KEEP_HISTORY = 512


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
        cfg = sections_of(settings)  # typed, with the config's one set of defaults
        self.ckpt = cfg.checkpoint
        self.straggler_threshold = cfg.monitor.straggler_threshold
        self.max_lag = cfg.monitor.max_lag_steps
        self.stragglers = StragglerTracker(cfg.monitor.straggler_window)
        self.policies = PolicyEngine(build_rules([dict(c) for c in settings.get("anomalies") or []],
                                                 extra_kinds=settings.get("extra_rules"),
                                                 straggler_threshold=self.straggler_threshold))
        self.anomalies: list[dict[str, Any]] = []
        prev = self.run_dir / "anomalies.json"
        if prev.exists():  # a restarted attempt (or aggregator) continues the record
            try:
                import json

                self.anomalies = list(json.loads(prev.read_text()))
            except (ValueError, OSError):
                self.anomalies = []
        self.anomalies_total = 0
        self.best: tuple[float, int] | None = None
        """(metric, step) of the best reduced metric that was saved (or asked to be)."""
        self.checkpoints: list[dict[str, Any]] = []
        self.best_checkpoint: dict[str, Any] | None = None
        self.rank_errors: list[dict[str, Any]] = []
        self.tb = None
        if settings.get("tensorboard", True):
            from .tb_sink import TensorBoardSink

            self.tb = TensorBoardSink(self.run_dir)
            if settings.get("config_yaml"):
                self.tb.on_text("config", "```\n" + settings["config_yaml"] + "\n```")
            self.milestone("start", 0)
        self.world_size = world_size
        self.per_print_step = max(1, per_print_step)
        self.total_steps = total_steps
        self.metrics = MetricsWriter(self.run_dir / "metrics.msgpack")
        self.reducer = StepReducer(world_size)
        self.accepted = 0
        self.rejected: Counter[str] = Counter()
        self.directives: OrderedDict[int, Directive] = OrderedDict()
        self.recent: deque[ReducedStep] = deque(maxlen=_KEEP_HISTORY)
        self.console: deque[str] = deque(maxlen=1000)
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
        self.ended: set[int] = set()
        if replay:  # last: every attribute the packets touch must exist
            self._replay()

    def _replay(self) -> None:
        """Rebuild the state of a restarted aggregator from metrics.msgpack (every packet it
        had accepted), without writing anything again."""
        from mindpulse.protocol import PacketError, from_wire

        from .metrics_store import read_wire

        self.replaying = True
        self.restarts += 1
        n = 0
        try:
            for obj in read_wire(self.metrics.path):
                try:
                    pkt = from_wire(obj)
                except PacketError:
                    continue
                self.accepted += 1
                n += 1
                self._accept(pkt)
        finally:
            self.replaying = False
        self.console.clear()
        self.console.append(f"aggregator restarted: rebuilt from {n} packets in metrics.msgpack "
                            f"(through step {self.reducer.reduced_through})")

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
            good_raw.append(bytes(raw))
            packets.append(pkt)
        self.metrics.append(good_raw)
        self.accepted += len(packets)
        done: list[ReducedStep] = []
        for pkt in packets:
            done.extend(self._accept(pkt))
        return done

    def _accept(self, pkt: Packet) -> list[ReducedStep]:
        if isinstance(pkt, StepPacket):
            now = time.time()
            if pkt.step > self.reducer.last_step_of_rank.get(pkt.rank, -1):
                self.last_progress = now
            self.heartbeat[pkt.rank] = (now, pkt.step)
            out = self.reducer.add(pkt)
            for red in out:
                self._on_reduced(red)
            return out
        if isinstance(pkt, EventPacket):
            info = self.rank_info.setdefault(pkt.rank, {})
            if pkt.kind == EventKind.START:
                info.update(pid=pkt.pid, host=pkt.host, started=pkt.ts)
            elif pkt.kind == EventKind.CHECKPOINT:
                self._on_checkpoint(pkt)
            elif pkt.kind == EventKind.STRUCTURE:
                if self.tb is not None and not self.replaying:
                    self.tb.on_text("model/structure", pkt.message, 0)
            elif pkt.kind == EventKind.HEARTBEAT:
                self.heartbeat[pkt.rank] = (time.time(), pkt.step)
                info.setdefault("pid", pkt.pid)
            elif pkt.kind == EventKind.END:
                self.ended.add(pkt.rank)
                info["end"] = pkt.message or True
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
            step = self.last_reduced.step if self.last_reduced else 0
            if self.tb is not None and not self.replaying:
                self.tb.on_telemetry(pkt.node, cards, pkt.ts, step)
            for f in self.policies.on_telemetry(cards, time.time(), step):
                self._on_firing(f)
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
        for e in entries if isinstance(entries, list) else []:
            if not isinstance(e, dict):
                continue
            self.checkpoints.append(e)
            if e.get("kind") == CheckpointKind.BEST:
                self.best_checkpoint = {"path": e.get("path"), "step": e.get("step"), "metric": e.get("metric"),
                                        "metric_name": e.get("metric_name")}
            self.console.append(f"checkpoint ({e.get('kind')}) step {e.get('step')}: {e.get('path')}")
            self.milestone(f"checkpoint {e.get('kind')} {e.get('path')}", int(e.get("step") or 0))
        del self.checkpoints[:-200]

    def _on_firing(self, f: Firing) -> None:
        """Record once (anomalies.json), print once, and stop every rank if the rule says so."""
        from .rundir_io import write_json_atomic

        rec = f.to_record()
        self.anomalies_total += 1
        if self.replaying:  # recorded before the restart (anomalies.json was reloaded)
            if f.action.stops:
                self.request_stop(f.message, rule=f.rule, rank=f.rank, value=f.value,
                                  save=f.action is Action.SAVE_AND_STOP, threshold=f.threshold)
            return
        if len(self.anomalies) < 10_000:
            self.anomalies.append(rec)
            write_json_atomic(self.run_dir / "anomalies.json", self.anomalies)
        where = f" (rank {f.rank})" if f.rank is not None else ""
        self.console.append(f"ANOMALY {f.rule}{where} -> {f.action.value}: {f.message}")
        if self.tb is not None:
            self.tb.on_anomaly(rec)
            self.milestone(f"anomaly {f.rule}: {f.message}", f.step)
        if f.action.stops:
            self.request_stop(f.message, rule=f.rule, rank=f.rank, value=f.value,
                              save=f.action is Action.SAVE_AND_STOP, threshold=f.threshold)

    # ---- reduction → decisions ------------------------------------------------------
    def _on_reduced(self, red: ReducedStep) -> None:
        if self.steps_reduced == 1:
            self.milestone("first step", red.step)
        self.steps_reduced += 1
        if self.tb is not None and not self.replaying:
            self.tb.on_reduced(red)
            w = next((p.weights for p in red.per_rank.values() if p.weights), None)
            if w:
                self.tb.on_weights(red.step, w)
        self.last_reduced = red
        self.recent.append(red)
        self.totals.add(red)
        self._check_fingerprints(red)
        self.stragglers.update(red)
        for f in self.policies.on_step(red):
            self._on_firing(f)
        decision_step = any(p.decision for p in red.per_rank.values())
        if self.stop_request is not None and self.stop is None and decision_step:
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
            text = tables.cluster_table(red, self.total_steps, self.straggler_threshold)
            if self.telemetry_latest:
                text += "\n" + tables.card_table(self.telemetry_latest.values())
            self.console.append(text)

    def _save_decision(self, red: ReducedStep, d: Directive) -> Directive:
        """Which checkpoints rank 0 writes after this step: periodic and/or best."""
        c = self.ckpt
        kinds: list[CheckpointKind] = []
        every = c.save_checkpoint_steps
        if every and red.step > 0 and red.step % every == 0:
            kinds.append(CheckpointKind.PERIODIC)
        if c.save_best_ckpt and red.step > 0 and not red.nonfinite_ranks:
            name = c.best_metric
            value = red.metric(name)
            is_eval = name.startswith("eval_")
            due = is_eval or red.step % c.best_every_steps == 0
            if value is not None and math.isfinite(value) and due:
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
                     value: float | None = None, save: bool = False, threshold: float | None = None) -> None:
        """Stop every rank after the next reduced step plus monitor.max_lag_steps (first request wins).

        `save`: rank 0 also writes a `last` checkpoint after that step (interrupts and
        save_and_stop rules)."""
        if self.stop_request is None and self.stop is None:
            self.stop_request = (reason, {"rule": rule, "rank": rank, "value": value, "threshold": threshold,
                                          "message": reason, "save": save})

    # ---- output ---------------------------------------------------------------------
    def drain_console(self) -> list[str]:
        out = list(self.console)
        self.console.clear()
        return out

    def progress(self) -> dict[str, Any]:
        red = self.last_reduced
        if red is None:
            return {"step": 0}
        return {
            "step": red.step,
            "epoch": red.epoch,
            "loss": red.loss_mean,
            "samples_per_s": red.samples_per_s,
            "step_time_s": red.step_time_max,
            "ts": red.ts,
        }

    def snapshot(self) -> dict[str, Any]:
        ranks = []
        for r in range(self.world_size):
            last = self.reducer.last_packet_of_rank.get(r)
            info = self.rank_info.get(r, {})
            ranks.append({"rank": r, "last_step": last.step if last else 0,
                          "param_fingerprint": self.totals.fingerprints.get(r),  # the newest it sent
                          "pid": info.get("pid"), "host": info.get("host")})
        return {
            "world_size": self.world_size,
            "steps_completed": self.reducer.reduced_through if self.reducer.reduced_through > 0 else 0,
            "ranks": ranks,
            "stop": self.stop,
            **self.totals.as_dict(),
            "anomalies": self.anomalies_total,
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
            },
            "aggregator_restarts": self.restarts,
            "last_step": self.last_reduced.to_record() if self.last_reduced else None,
        }

    def hang_check(self, timeout_s: float, heartbeat_stale_s: float) -> dict[str, Any] | None:
        """None, or the ranks to blame when no rank has made progress for `timeout_s`:
        those whose heartbeat went silent (stopped processes), else the ones behind."""
        now = time.time()
        if now - self.last_progress < timeout_s or len(self.ended) == self.world_size:
            return None
        live = [r for r in range(self.world_size) if r not in self.ended]
        silent = [r for r in live if now - self.heartbeat.get(r, (self.started, 0))[0] > heartbeat_stale_s]
        # packets between decision points may still sit in a client's buffer: the heartbeat's
        # step is as fresh as the rank itself
        steps = {r: max(self.reducer.last_step_of_rank.get(r, 0), self.heartbeat.get(r, (0, 0))[1])
                 for r in range(self.world_size)}
        if silent:
            stuck = silent
        else:
            low = min(steps[r] for r in live) if live else 0
            stuck = [r for r in live if steps[r] == low]
        return {"stuck": sorted(stuck), "steps": steps, "silent": sorted(silent),
                "no_progress_s": now - self.last_progress,
                "pids": {r: self.rank_info.get(r, {}).get("pid") for r in range(self.world_size)},
                "started": sorted(r for r, i in self.rank_info.items() if i.get("started"))}

    def missing_for(self, step: int) -> list[int]:
        return self.reducer.missing_ranks(step)

    def close(self) -> None:
        self.metrics.close()
        if self.tb is not None:
            last = self.last_reduced.step if self.last_reduced else 0
            self.milestone("end" + (f" (stopped: {self.stop.get('message')})" if self.stop else ""), last)
            self.tb.close()
