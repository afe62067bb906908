"""One rank's monitoring session, under the `Monitor` callback (or a hand-written loop).

Per step it builds a `StepPacket` (loss, the learning rate of the step, grad norms,
NaN/Inf counts, step time, samples, user metrics and evaluation results, and every
`collect_freq` steps a parameter fingerprint and rank 0's layer statistics) and ships it
through the rank's channel. At the schedule's decision steps rank 0 asks for the directive
and writes the checkpoint it asks for: from a copy of that step's weights taken before it
trains on (the verdict is read once it came), or, at the last step, after waiting for it.
It owns the rank's parts: the channel, the heartbeat, the fault
injector, the profiler window, the weight statistics and the checkpoint writer.

Outside a launch (no settings: a user script run by hand) it has no channel: it logs
each step and never blocks.

The channel to the node's relay (or the aggregator) is workers/channel.py's; the loop's
values become packet numbers through workers/coerce.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mindpulse.config import RunConfig, monitor_settings_of, schedule_of
from mindpulse.config.rank_settings import RankSettings, Schedule
from mindpulse.registry.metrics import reported
from mindpulse.wire.directives import Directive
from mindpulse.wire.protocol import Action, CheckpointKind, EventKind, EventPacket, RankState, StepPacket

from .channel import Channel, connect
from .checkpoint_writer import CheckpointWriter
from .coerce import as_count, as_extra, as_flag, as_number
from .collect_later import Completion
from .faults import FaultInjector, faults_for
from .flops import achieved_tflops, params_flops_per_token, trainable_parameters
from .heartbeat import BUSY_EVALUATING, BUSY_SAVING, Heartbeat
from .outbox import outbox_for
from .pending_verdict import PendingVerdict
from .profiler import ProfileWindow
from .rank_weights import RankWeights
from .settings import rank_id
from .since_packet import SincePacket
from .weights_copy import CopyOrWait, WeightsCopy

log = logging.getLogger(__name__)

# Outside a launch (a script run by hand, a benchmark): the config's defaults, so a script
# collects, decides and reports weights the same by hand as launched with a default config.
UNLAUNCHED_SCHEDULE = schedule_of(RunConfig())
UNLAUNCHED_MONITOR = monitor_settings_of(RunConfig())  # its heartbeat interval is unused: no heartbeat runs

EVENT_MESSAGE_CHARS = 4000
REPORTED_ERRORS = 20
"""Monitor errors per rank reported one by one (the rest are counted)."""
STRUCTURE_MESSAGE_CHARS = 60000


@dataclass
class StepOutcome:
    """What recording a step tells the loop."""

    step: int
    stop: bool
    reason: str = ""


def schedule_with(base: Schedule, *, collect_freq: int | None = None, max_lag_steps: int | None = None,
                  total_steps: int | None = None, eval_every: int | None = None,
                  eval_per_epoch: bool | None = None) -> Schedule:
    """`base` with a script's explicit overrides (None keeps the run's value; a collect
    period of 0 too: every step modulo 0 is no schedule)."""
    changes: dict[str, Any] = {}
    if collect_freq:
        changes["collect_freq"] = collect_freq
    if max_lag_steps is not None:
        changes["max_lag_steps"] = max_lag_steps
    if total_steps is not None:
        changes["total_steps"] = total_steps
    if eval_every is not None:
        changes["eval_every"] = eval_every
    if eval_per_epoch is not None:
        changes["eval_per_epoch"] = eval_per_epoch
    return dataclasses.replace(base, **changes)


_COERCE: dict[type, Callable[[Any], Any]] = {float: as_number, int: as_count, bool: as_flag, dict: as_extra}
_REPORTED = tuple((m.name, _COERCE[m.type], m.default) for m in reported())
"""(name, coercion by type, default) of each step metric a rank's code reports (the registry's
CALLER and CELL metrics): `_record` builds the packet's share of them from these."""
_REPORTED_NAMES = frozenset(name for name, _, _ in _REPORTED)

_created = 0
"""RankSessions (Monitors) created in this process: a script that trains without one is
named at once (workers/auto_attach.py)."""


def sessions_created() -> int:
    return _created


class RankSession:
    """Args:
        settings: the run's settings (None outside a launch).
        rank: this rank (default: MindSpore's RANK_ID).
        channel: where packets go (default: the settings' relay or aggregator; none outside a launch).
        schedule: the special steps (default: the settings').
        batch_size: samples per step on this rank (default: the settings' `train.batch_size`).
        step_offset: the global step this run starts after (default: the settings' resume point).
        evaluate: returns this rank's validation metrics at the schedule's evaluation steps.
        epoch_steps: steps per epoch (for evaluation at epoch ends).
        network / train_cell: what is fingerprinted / what rank 0 checkpoints.
    """

    def __init__(
        self,
        settings: RankSettings | None,
        *,
        rank: int | None = None,
        channel: Channel | None = None,
        schedule: Schedule | None = None,
        batch_size: int | None = None,
        step_offset: int | None = None,
        evaluate: Callable[[], dict[str, float]] | None = None,
        epoch_steps: int | None = None,
        network: Any = None,
        train_cell: Any = None,
        metrics: list[str] | None = None,
        tokens_per_step: int | None = None,
        flops_per_token: float | None = None,
    ):
        global _created
        _created += 1
        self.settings = settings
        declared = list(metrics or [])
        if settings is not None:
            declared += list((settings.config.get("eval") or {}).get("metrics") or [])
        self.metrics = frozenset(declared) if metrics is not None else None
        """Metric names the script declared (`Monitor(metrics=[...])`, plus `eval.metrics`): an
        evaluation that reports another name is a monitor error (its rule or best-checkpoint
        judgement would silently never see it)."""
        self.rank = rank if rank is not None else rank_id()
        self.schedule = schedule or (settings.schedule if settings else UNLAUNCHED_SCHEDULE)
        self.monitor_settings = settings.monitor if settings else UNLAUNCHED_MONITOR
        self.batch_size = batch_size or (settings.batch_size if settings else None) or None
        if step_offset is None:
            step_offset = settings.resume.step if settings and settings.resume else 0
        self.step_offset = step_offset
        self.evaluate = evaluate
        self.epoch_steps = epoch_steps
        self.network = network
        self.train_cell = train_cell
        if channel is None and settings is not None:
            channel = connect(settings, self.rank)
        self.channel = channel
        self.outbox = outbox_for(channel, lambda exc: self.monitor_error("shipping to the relay", exc))
        """Where the channel's work runs: a thread of its own for the relay's socket (the
        packet's encoding and writing, the verdict's question and answer), else inline."""
        if self.outbox.background:  # a verdict that came is taken off the socket before each send
            self.outbox.before_job = self._poll_verdict
            self.outbox.awaiting = self._verdict_due
        self.step = step_offset
        """The last step recorded (the offset before the first)."""
        self.injector = FaultInjector(self.rank, faults_for(self.rank, settings.faults if settings else ()))
        self.checkpoints = (CheckpointWriter.for_run(settings, self.send_event, self.injector.before_save)
                            if settings is not None and self.rank == 0 else None)
        self.profile = ProfileWindow.for_rank(settings, self.rank)
        self.in_step: int | None = None
        """The step the loop is inside: its faults let it start, it has not ended (the
        heartbeat says so: a rank blocked before a step that the others are inside is the
        one they wait for)."""
        self.busy: RankState | None = None
        """What the rank does outside its steps right now: `saving` (a checkpoint) or `evaluating`
        (the heartbeat says so: that time is not a hang)."""
        self.heartbeat = Heartbeat(settings, self.rank, lambda: self.step, lambda: self.in_step,
                                   connect=lambda: connect(settings, self.rank),
                                   busy=lambda: self.busy) if settings else None
        self.weights = RankWeights(self.rank, self.outbox)
        """The fingerprint and rank 0's weight statistics, and the copies they are computed from."""
        self.started = False
        self.finished = False
        self.stopped: Directive | None = None
        """The directive that stopped every rank (None while training goes on)."""
        self.since_packet = SincePacket()
        self._self_from = (time.perf_counter(), 0.0)
        """Where `monitor_self_s`'s clock runs from: (perf_counter, `since_packet.outside()` then)."""
        """Seconds spent outside the steps since the last step packet (it carries them)."""
        self.errors = 0
        """Errors inside the monitor on this rank (logged and counted; training went on)."""
        self._errors_lock = threading.Lock()
        self.overflow_steps = 0
        """Steps this rank's loss-scale cell skipped for overflow (every packet carries it)."""
        self.on_directive: Callable[[Directive], None] | None = None
        self._pending: PendingVerdict | None = None
        """Rank 0's checkpoint candidate whose verdict has not been taken yet (`_decide_later`)."""
        self._weights_copy = WeightsCopy()
        """The weights of `_pending`'s step (rank 0), for the checkpoint its verdict may ask for."""
        self._copy_or_wait = CopyOrWait()
        self._unsent: Completion | None = None
        """A collect step's completion not yet handed to the outbox (released if the record fails)."""
        self.tokens_per_step = tokens_per_step
        """Tokens this rank trains on per step (None: not known, no TFLOPS reported)."""
        self.flops_per_token = flops_per_token
        """Model FLOPs per token (None: 6 x the network's trainable parameters, once it is known)."""

    # ---- life cycle ------------------------------------------------------------------------
    def start(self, network: Any = None, train_cell: Any = None, arm_next: bool = True) -> None:
        """Announce the rank and ship the fingerprint of the weights before any update."""
        if train_cell is not None:
            self.train_cell = train_cell
        if self.started:
            return
        self.started = True
        if network is not None and self.network is None:
            self.network = network
        self.injector.bind(self.train_cell, self.network)
        self.send_event(EventKind.START)
        self._watch_layers()
        if self.heartbeat is not None:
            self.heartbeat.start()
        if self.step_offset == 0:
            self.injector.before_step(0)  # desync@R:0 perturbs the weights before step 0's fingerprint
        fp, norm = self.weights.fingerprint(self.network)
        self._ship(StepPacket(rank=self.rank, step=self.step_offset, ts=time.time(), fingerprint=fp,
                              param_norm=norm))
        if arm_next:  # faults and the profiler of the first step (a hand loop's)
            self.before_step(self.step_offset + 1)

    def finish(self, message: str = "") -> None:
        if self.finished:  # once: its END and the channel's close
            return
        self.finished = True
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.profile is not None:
            self.profile.end(self.step, force=True)
        if self.channel is not None:
            if self._pending is not None:
                step = self._pending.pkt.step
                try:
                    self._settle(wait=True)  # the last candidate's checkpoint is written before the end
                except Exception as exc:  # finishing must go on: the verdict's save is lost, said
                    self.monitor_error(f"taking the verdict of step {step}", exc)
        self.send_event(EventKind.END, message)
        if self.channel is not None:
            try:
                self.outbox.call(self.channel.close)  # now, not when the garbage collector gets to the session
            except Exception as exc:  # the end event may be lost: said, finishing goes on
                self.monitor_error("closing the channel", exc)
            self.outbox.close()

    def flush(self) -> None:
        """Send what is queued now and wait until it has gone (a Monitor that outlives its
        `Model.train`)."""
        if self.channel is not None:
            try:
                self.outbox.call(self.channel.flush)
            except Exception as exc:  # the monitor never raises into the training loop
                self.monitor_error("flushing the channel", exc)

    def _verdict_due(self) -> bool:
        pending = getattr(self, "_pending", None)
        return pending is not None and pending.due

    def _poll_verdict(self) -> None:
        pending = getattr(self, "_pending", None)  # (set once __init__ ran)
        if pending is not None:
            pending.poll()

    def before_step(self, step: int) -> float:
        """Around the loop's steps: faults of `step`, and the profiler window's start.
        Returns the seconds the profiler took (goodput: not the data path's)."""
        self.injector.before_step(step)
        self.in_step = step  # after its faults: a rank held there (a hang) is not inside the step
        return self._profiled(self.profile.begin, step) if self.profile is not None else 0.0

    def after_step(self, step: int) -> None:
        self.in_step = None
        self.injector.after_step(step)
        if self.profile is not None:
            self._profiled(self.profile.end, step)

    def _profiled(self, call: Any, step: int) -> float:
        t = time.perf_counter()
        call(step)
        spent = time.perf_counter() - t
        self.since_packet.profile_s += spent
        return spent

    # ---- one step --------------------------------------------------------------------------
    def record(self, loss: Any, *, step: int | None = None, since: float | None = None, **fields: Any) -> StepOutcome:
        """Ship one finished step (the next one unless `step` is given); returns whether to
        stop. Numbers may be Python numbers, numpy scalars or MindSpore tensors. An error
        inside the monitor is logged and counted, never raised into the training loop: only
        a stop ends training. `since`: the `time.perf_counter()` at which mindpulse's code took
        over from the training for this step (a callback's entry), for `monitor_self_s`."""
        self._self_from = (time.perf_counter() if since is None else since, self.since_packet.outside())
        try:
            return self._record(loss, step=step, **fields)
        except Exception as exc:  # the monitor's own error must never end training: logged and counted
            if self._unsent is not None:  # the collect step's copy, never handed to the outbox
                self._unsent.release()
                self._unsent = None
            self.monitor_error(f"recording step {self.step}", exc)
            return self._outcome(self.step)
        finally:
            self._count_self_time()

    def _count_self_time(self, excluded: float = 0.0) -> float:
        """Add the time in mindpulse's code since `_self_from` (less what was waits, checkpoints,
        the profiler, and `excluded`: evaluation) to `monitor_self_s`; the clock starts again. What
        is counted after a packet was built (its encoding and sending, the lease) goes in the next."""
        t, outside = self._self_from
        now = time.perf_counter()
        spent = max(0.0, now - t - excluded - (self.since_packet.outside() - outside))
        self.since_packet.monitor_self_s += spent
        self._self_from = (now, self.since_packet.outside())
        return spent

    def _record(self, loss: Any, *, step: int | None = None, **fields: Any) -> StepOutcome:
        unknown = set(fields) - _REPORTED_NAMES
        if unknown:
            raise TypeError(f"{sorted(unknown)}: not a step metric a rank reports (those are "
                            f"{', '.join(sorted(_REPORTED_NAMES))}; a new one is declared in "
                            "mindpulse/registry/metrics.py)")
        overflow = as_flag(fields.get("overflow"))
        self.step = s = step if step is not None else self.step + 1
        if overflow:
            self.overflow_steps += 1
        fp = norm = None
        weights: dict[str, Any] = {}
        later: Completion | None = None
        evaluates = self.evaluate is not None
        # rank 0 asks for the verdict on a checkpoint candidate (the checkpoint must hold
        # exactly this step's weights: `_decide_later` copies them); nobody else asks
        decision = self.rank == 0 and self.schedule.is_candidate(s, evaluates, self.epoch_steps)
        copied: bool | None = None  # rank 0's candidate copy of this step: None, not tried yet
        if self.schedule.is_collect(s):
            copied = self._copy_candidate_first(s) if decision else None
            later = self._unsent = self.weights.collect_later(self.network, s, self._weights_copy if copied else None)
            if later is None:
                fp, norm, weights = self.weights.measure_now(self.network, s)
        eval_s = 0.0
        if evaluates and self.schedule.eval_due(s, self.epoch_steps):
            t_eval = time.perf_counter()
            self.busy = BUSY_EVALUATING
            try:
                results = self.evaluate()
                undeclared = sorted(set(results) - self.metrics) if self.metrics is not None else []
                if undeclared:
                    self.monitor_error(f"evaluating at step {s}", ValueError(
                        f"evaluate() reported {undeclared}, not among the declared metrics {sorted(self.metrics)}; "
                        "add them to Monitor(metrics=[...]) and eval.metrics"))
                fields["extra"] = dict(fields.get("extra") or {}, **results)
            except Exception as exc:  # the user's evaluate() failing must not end training: logged
                log.error("[rank %d] evaluation at step %d failed: %s", self.rank, s, exc)
            finally:
                self.busy = None
            eval_s = time.perf_counter() - t_eval
        self._count_self_time(excluded=eval_s)
        # what the rank's code reported (the registry's CALLER and CELL metrics, each coerced by
        # its type), then what this session measures (SESSION) and the seconds between packets (SINCE)
        given = {name: coerce(fields.get(name, default)) for name, coerce, default in _REPORTED}
        given["loss"] = as_number(loss)
        given["samples"] = as_count(fields.get("samples") or self.batch_size or 0)
        tokens = fields.get("tokens")
        given["tokens"] = as_count(tokens if tokens is not None else self.tokens_per_step or 0)
        pkt = StepPacket(
            **given,
            rank=self.rank,
            step=s,
            tflops=self._tflops(given["tokens"], given["step_time_s"], given["data_wait_s"], given["compute_s"]),
            ts=time.time(),
            fingerprint=fp,
            param_norm=norm,
            decision=bool(decision),
            eval_s=eval_s,
            monitor_errors=self.errors,
            weights=weights,
            overflow_steps=self.overflow_steps,
            **self.since_packet.take(),
        )
        self._self_from = (self._self_from[0], 0.0)  # the packet took the seconds so far
        self._ship(pkt, later, copied)
        if not self.weights.reserved:  # after the first step, not at the start: see `RankWeights.reserve`
            self.weights.reserve(self.network, self._candidate_bytes)
        if self.schedule.is_collect(s + 1):
            self.weights.keep_previous()  # the next step is a collect step: measure its change
        return self._outcome(s)

    def _tflops(self, tokens: int, step_time_s: Any, data_wait_s: Any, compute_s: Any) -> float | None:
        """This rank's achieved TFLOPS: over its own time of the step, its data wait plus its
        compute up to the gradient all-reduce where measured (a slow card or data path shows
        as its own drop, not as everyone's wait in the collective), else its step time plus
        data wait."""
        if not tokens:
            return None
        if self.flops_per_token is None and self.network is not None:
            try:  # once: 6 x the trainable parameters ("6N")
                self.flops_per_token = params_flops_per_token(trainable_parameters(self.network))
            except Exception as exc:  # no FLOPs count: this rank reports no TFLOPS, it trains on
                self.flops_per_token = 0
                log.warning("[rank %d] cannot count the model's parameters for its FLOPs: %s", self.rank, exc)
        wait, comp = as_number(data_wait_s) or 0.0, as_number(compute_s)
        own = comp if comp is not None else as_number(step_time_s)
        busy = max(wait, 0.0) + own if own else None
        return achieved_tflops(tokens, self.flops_per_token or 0, busy)

    def _outcome(self, s: int) -> StepOutcome:
        if self.stopped is not None:
            return StepOutcome(step=s, stop=True, reason=self.stopped.reason)
        total = self.schedule.total_steps
        if total and s >= total:
            return StepOutcome(step=s, stop=True, reason=f"reached train.steps={total}")
        return StepOutcome(step=s, stop=False)

    def monitor_error(self, where: str, exc: BaseException) -> None:
        """An error inside the monitor: logged, counted (every step packet carries the count
        to summary.json), the first few reported to the aggregator; training goes on."""
        with self._errors_lock:  # both threads count (see Channel._failed)
            self.errors += 1
            n = self.errors
        if n <= REPORTED_ERRORS:
            log.warning("[rank %d] monitor error while %s (training goes on): %s: %s", self.rank, where,
                        type(exc).__name__, exc, exc_info=n <= 3)
            try:
                self.send_event(EventKind.MONITOR_ERROR, f"{where}: {type(exc).__name__}: {exc}")
            except Exception:  # reporting the error failed too: it is logged and counted already
                pass

    # ---- shipping and directives -----------------------------------------------------------
    def send_event(self, kind: EventKind, message: str = "") -> None:
        if self.channel is None:
            return
        pkt = EventPacket(rank=self.rank, kind=kind.value, ts=time.time(), step=self.step, pid=os.getpid(),
                          host=socket.gethostname(), message=message[:EVENT_MESSAGE_CHARS])
        ch = self.channel

        def ship() -> None:
            ch.send(pkt.encode())
            ch.flush()

        self.outbox.submit(ship)

    def _ship(self, pkt: StepPacket, later: Completion | None = None, copied: bool | None = None) -> None:
        """Ship a step, then make sure the next one may start (the lease). `later`: completes
        the packet on the outbox thread (a collect step's statistics from a copy of the weights);
        `copied`: whether rank 0's candidate copy of this step was taken (`_copy_candidate_first`;
        None: not tried yet)."""
        if self.channel is None:
            log.info("[rank %d] step %d loss %s", self.rank, pkt.step, pkt.loss)
            return
        build: Callable[[], StepPacket] = (lambda: later(pkt)) if later is not None else (lambda: pkt)
        if self._pending is not None:
            self._settle(wait=pkt.decision)  # the earlier verdict, if it came (at the next candidate: it must)
        if pkt.decision and self._decide_later(pkt, build, copied):
            self._unsent = None  # the outbox builds it with the question
        elif pkt.decision:
            t0 = time.monotonic()
            ch = self.channel
            try:
                d = self.outbox.call(lambda: ch.decide(build().encode(), pkt.step, expect=1))
            except TimeoutError as exc:  # the outbox is stuck on a relay that stopped reading: go on
                d = ch.no_directive_now(pkt.step, exc)
            finally:
                self._unsent = None  # queued with the question, answered or not
            waited = time.monotonic() - t0
            self.since_packet.monitor_wait_s += waited
            self._copy_or_wait.waited(waited)
            self._follow(d, pkt)
        else:
            ch = self.channel
            self.outbox.submit(lambda: ch.send_step(build().encode(), pkt.step))
            self._unsent = None
        if self.stopped is None:
            self._check_lease(pkt)

    def _decide_later(self, pkt: StepPacket, build: Callable[[], StepPacket], copied: bool | None = None) -> bool:
        """Rank 0 at a checkpoint candidate: ask for the verdict on the weights copied at its
        step (`_take_candidate`; `copied`: taken already, False: tried and failed) and train on;
        the verdict is taken when it has come (`_settle`). False where it must wait instead
        (`_copies_candidate`)."""
        assert self.channel is not None
        if copied is False:  # the copy failed at this step already (logged): no second try
            return False
        if not copied and not (self._copies_candidate(pkt.step) and self._take_candidate(pkt.step)):
            return False
        self._pending = PendingVerdict(pkt, build, self.channel, self.outbox)
        return True

    def _copies_candidate(self, step: int) -> bool:
        """Whether rank 0 copies the candidate of `step` instead of waiting for its verdict. Not
        on the last step (nothing runs after it), a stop the lease already names for this step,
        no train cell, a wait measured cheaper than the copy or weights too large to copy
        (`CopyOrWait`), or a channel that answers at once anyway (`answers_later` False)."""
        assert self.channel is not None
        if not self.channel.answers_later:
            return False
        total = self.schedule.total_steps
        lease = self.channel.cached_lease
        if (self.train_cell is None or self.checkpoints is None or (total and step >= total)
                or (lease is not None and lease.stopping and step >= lease.stop_after)):
            return False
        return self._copy_or_wait.copies(self.train_cell)

    def _take_candidate(self, step: int) -> bool:
        """Copy what a checkpoint of `step` holds; False where it cannot (it then waits)."""
        t0 = time.perf_counter()
        try:
            self._weights_copy.take(self.train_cell, step)
            return True
        except Exception as exc:  # weights numpy cannot hold (a dtype): this candidate waits for its verdict
            log.info("[rank 0] no host copy of the weights at step %d (%s): waiting for the verdict", step, exc)
            return False
        finally:
            # the copy is the checkpoint's (goodput: checkpoint time), not watching's
            took = time.perf_counter() - t0
            self.since_packet.checkpoint_s += took
            self._copy_or_wait.copied(took)

    def _copy_candidate_first(self, step: int) -> bool | None:
        """A collect step that is rank 0's candidate too: the candidate's copy is taken before
        the collect step's would be, and the statistics read its weights (one copy of them, not
        two). The earlier candidate's verdict is followed first: its save reads the copy.
        Whether the copy was taken; None where it is not tried (`_copies_candidate`)."""
        if self.channel is None or not self._copies_candidate(step):
            return None
        if self._pending is not None:
            self._settle(wait=True)
        return self._take_candidate(step)

    def _settle(self, wait: bool) -> None:
        """Follow the pending candidate's verdict if it came (`wait`: until it comes), writing
        the checkpoint it asks for from the weights copied at that step."""
        assert self.channel is not None and self._pending is not None
        d = self._pending.take(wait=False)
        if d is None and wait:  # not here yet: blocked until it comes (the packet says how long)
            t0 = time.monotonic()
            d = self._pending.take(wait=True)
            self.since_packet.monitor_wait_s += time.monotonic() - t0
        if d is None:
            return
        pkt, self._pending = self._pending.pkt, None
        self._follow(d, pkt, weights=self._weights_copy)

    def _check_lease(self, pkt: StepPacket) -> None:
        """Before the step after `pkt`: every rank may run `max_lag_steps` steps ahead of the
        aggregator and stops after the step a stop names (the same on every rank)."""
        assert self.channel is not None
        need = self.schedule.lease_need(pkt.step)
        if need < self.step_offset:
            return  # steps before this attempt's first are never reduced by its aggregator
        lease, waited = self.channel.lease(need)
        self.since_packet.monitor_wait_s += waited
        if lease is None:
            lost = self.channel.lost_for()
            if lost > self.monitor_settings.decision_timeout_s:
                # the node's relay (and with it every decision) is gone: training on unwatched
                # could leave this rank alone in a collective, or outlive its run
                self._follow(Directive(step=pkt.step, action=Action.STOP,
                                       reason=f"no relay for {lost:.0f}s (monitor.decision_timeout_s)"), pkt)
            return
        if lease.stopping and pkt.step >= lease.stop_after:
            if self._pending is not None:  # the last verdict first: its save is of an earlier step
                self._settle(wait=True)
            d = Directive(step=pkt.step, action=Action.STOP, reason=lease.reason,
                          saves=frozenset({CheckpointKind.LAST}) if lease.save_last else frozenset())
            self._follow(d, pkt)
        elif not lease.allows(pkt.step + 1, self.schedule.max_lag_steps):
            log.warning("[rank %d] no lease for step %d after %.0fs (aggregator at step %d); continuing",
                        self.rank, pkt.step + 1, waited, lease.reduced_through)

    def _follow(self, d: Directive, pkt: StepPacket, weights: WeightsCopy | None = None) -> None:
        """`weights`: the copy taken at `pkt`'s step (a verdict taken later); None: the train cell
        still holds that step's weights."""
        if d.save_kinds and self.rank == 0:
            t_save = time.perf_counter()
            self.busy = BUSY_SAVING
            try:
                self._save(d, pkt, weights)
            finally:
                self.busy = None
                self.since_packet.checkpoint_s += time.perf_counter() - t_save
        if d.action.stops:
            self.stopped = d
        if self.on_directive:
            self.on_directive(d)

    def _save(self, d: Directive, pkt: StepPacket, weights: WeightsCopy | None = None) -> None:
        if self.checkpoints is None or self.train_cell is None:
            log.warning("[rank 0] asked to save %s at step %d but no checkpoint folder or train cell is known",
                        d.save, pkt.step)
            return
        if weights is not None and weights.step != pkt.step:
            log.error("[rank 0] the weights copied for step %d are of step %s: not saved", pkt.step, weights.step)
            return
        self.checkpoints.write(d, pkt.step, pkt.epoch, weights.save_list() if weights is not None else self.train_cell)

    def _candidate_bytes(self) -> int | None:
        """The size of rank 0's candidate copy, for the host blocks made ahead (None elsewhere)."""
        if self.rank != 0 or self.checkpoints is None or self.train_cell is None:
            return None
        return self._weights_copy.nbytes_needed(self.train_cell)

    def _watch_layers(self) -> None:
        """Rank 0's per-layer statistics, and the model's structure sent once."""
        text = self.weights.watch_layers(self.network, self.train_cell, self.monitor_settings.weight_stats,
                                         self.monitor_settings.histogram_regex)
        if text is not None and self.channel is not None:
            pkt = EventPacket(rank=self.rank, kind=EventKind.STRUCTURE.value, ts=time.time(),
                              message=text[:STRUCTURE_MESSAGE_CHARS])
            ch = self.channel
            self.outbox.submit(lambda: ch.send(pkt.encode()))
