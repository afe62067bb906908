"""The verdict and the headline figures of a run: did it succeed and why did it end (the stop
rule and its message, or the failure's root-cause rank and first error line), wall time,
steps, loss first → best → last, throughput, world and cards, the best and latest
checkpoints, the anomalies by rule, and (when `summary.json` holds `goodput`) the effective
training time ratio with its largest badput causes.

`headline` computes them once; the page (`html`) and the console text (`text`) show the
same `Headline` in the same order.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mindpulse.common import formatting as fmt
from mindpulse.views.run_reader import SUMMARY

from .data import RunData, as_int, card_kinds, card_series


@dataclass
class Checkpoint:
    """One checkpoint file as the page links it."""

    name: str
    file: Path
    step: int | None
    kind: str
    metric: float | None
    metric_name: str
    size: int | None
    exists: bool

    def describe(self) -> str:
        parts = [f"step {self.step}" if self.step is not None else "step ?"]
        if self.metric is not None:
            parts.append(f"{self.metric_name or 'metric'} {fmt.metric(self.metric)}")
        if self.size is not None:
            parts.append(fmt.size(self.size))
        return ", ".join(parts)


@dataclass
class LossPoint:
    """One loss figure of the headline and the step it was reached at (None: not known)."""

    value: Any
    step: int | None


@dataclass
class Headline:
    """The figures that matter, in the order the page and the console show them."""

    name: str
    status: str
    why: str
    """One sentence: what ended the run."""
    detail: str = ""
    """The stop rule's message or the failure's first error line."""
    started: float | None = None
    ended: float | None = None
    wall_s: float | None = None
    wall_source: str = ""
    steps_done: int | None = None
    steps_total: int | None = None
    epoch: int | None = None
    loss_first: LossPoint | None = None
    loss_best: LossPoint | None = None
    loss_last: LossPoint | None = None
    samples_per_s: float | None = None
    step_time_s: float | None = None
    world_size: int = 0
    world_shape: str = ""
    cards: list[str] = field(default_factory=list)
    card_kinds: str = ""
    best: Checkpoint | None = None
    latest: Checkpoint | None = None
    goodput: dict[str, Any] | None = None
    anomaly_counts: list[tuple[str, int, str]] = field(default_factory=list)
    """(rule, firings, actions) by rule, most frequent first."""
    anomalies: int = 0
    attempts: int = 1

    @property
    def status_class(self) -> str:
        if self.status == "succeeded":
            return "ok"
        if self.status in ("failed", "anomaly_stop"):
            return "bad"
        return "other"

    def steps_text(self) -> str:
        if self.steps_done is None:
            return "-"
        if self.steps_total:
            return f"{self.steps_done:,} / {self.steps_total:,}"
        return f"{self.steps_done:,}"

    def loss_text(self) -> str:
        """`2.1669 (step 1) → best 2.0508 (step 27) → last 2.1351 (step 30)`."""
        def at(p: LossPoint | None) -> str:
            if p is None:
                return "-"
            return fmt.metric(p.value) + (f" (step {p.step})" if p.step is not None else "")
        if not (self.loss_first or self.loss_best or self.loss_last):
            return "not reported"
        return f"{at(self.loss_first)} → best {at(self.loss_best)} → last {at(self.loss_last)}"

    def throughput_text(self) -> str:
        if self.samples_per_s is None and self.step_time_s is None:
            return "not reported"
        parts = []
        if self.samples_per_s is not None:
            parts.append(f"{fmt.rate(self.samples_per_s)} samples/s")
        if self.step_time_s is not None:
            parts.append(f"{fmt.duration(self.step_time_s)} per step")
        return ", ".join(parts) + " (median over steps; step time of the slowest rank)"

    def cards_text(self, limit: int = 4) -> str:
        if not self.cards:
            return "cards not reported"
        shown = ", ".join(self.cards[:limit])
        more = f" … (+{len(self.cards) - limit})" if len(self.cards) > limit else ""
        kinds = f" ({self.card_kinds})" if self.card_kinds else ""
        return f"{fmt.plural(len(self.cards), 'card')}{kinds}: {shown}{more}"

    def wall_text(self) -> str:
        return fmt.duration(self.wall_s)

    def anomalies_text(self) -> str:
        if not self.anomalies:
            return "none"
        rules = ", ".join(f"{rule} ×{n} ({actions})" for rule, n, actions in self.anomaly_counts[:4])
        more = f", {len(self.anomaly_counts) - 4} more rules" if len(self.anomaly_counts) > 4 else ""
        return f"{self.anomalies}: {rules}{more}"


def first_line(text: Any) -> str:
    """The first line of a text that is not blank, stripped."""
    for ln in str(text or "").splitlines():
        if ln.strip():
            return ln.strip()
    return ""


def _exception_line(tb: Any) -> str:
    """The exception line that ends a Python traceback ('' when there is none)."""
    lines = [ln for ln in str(tb or "").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if not ln.startswith((" ", "\t")) and not ln.startswith("Traceback"):
            return ln.strip()
    return ""


def failure_error(f: dict[str, Any]) -> str:
    """A failure's first error line: its error's, else its traceback's exception line."""
    return first_line(f.get("error")) or _exception_line(f.get("traceback"))


def _why(data: RunData, steps_done: int | None, steps_total: int | None, last_step: int | None) -> tuple[str, str]:
    """(what ended the run, the message behind it)."""
    s = data.summary
    restarts = max(len(data.summary_attempts), len(data.attempts)) - 1
    after = f" after {fmt.plural(restarts, 'restart')}" if restarts > 0 else ""
    if not s:
        if not data.has_steps and not data.reduced:
            return "no data: the run left no step in its metrics", ""
        last = f"; its last complete step is {last_step}" if last_step is not None else ""
        return (f"did not finish: {SUMMARY} is missing (crashed, killed or still running){last}", "")
    status = str(s.get("status") or "")
    stop = s.get("stop") if isinstance(s.get("stop"), dict) else None
    if status == "succeeded":
        if steps_total and steps_done is not None and steps_done >= steps_total:
            return f"completed all {steps_total:,} steps{after}", first_line(s.get("message"))
        return (f"completed {fmt.plural(steps_done or 0, 'step')}{after}",
                first_line(s.get("no_steps_reason") or s.get("message")))
    if status == "anomaly_stop" and stop:
        rank = stop.get("rank")
        who = f" on rank {rank}" if rank is not None else ""
        at = stop.get("decided_at", stop.get("step"))
        after_step = f"; every rank stopped after step {stop['step']}" if stop.get("step") is not None else ""
        return (f"stopped by rule {stop.get('rule')}{who} at step {at}{after_step}{after}",
                first_line(stop.get("message")))
    if status == "interrupted":
        after_step = f"; every rank stopped after step {stop['step']}" if stop and stop.get("step") is not None else ""
        saved = ", a last checkpoint was saved" if stop and stop.get("save_last") else ""
        return f"interrupted (Ctrl-C or a signal){after_step}{saved}", first_line(s.get("message"))
    if status == "preflight_failed":  # launcher/card_check.py: refused before any step
        return "refused by the pre-flight card check (preflight.json): no step ran", first_line(s.get("message"))
    if status == "failed":
        f = s.get("failure") if isinstance(s.get("failure"), dict) else None
        if f is None:
            return f"failed{after}", first_line(s.get("message"))
        root, step = f.get("root_cause_rank"), f.get("step")
        at = f" at step {step}" if step is not None else ""
        how = "".join([f", exit code {f['exit_code']}" if f.get("exit_code") is not None else "",
                       f", signal {f['signal']}" if f.get("signal") else ""])
        tries = f" (after {fmt.plural(restarts, 'restart')})" if restarts > 0 else ""
        if f.get("kind") == "hang":
            ranks = f.get("ranks") or ([root] if root is not None else [])
            return (f"hung: no progress from rank(s) {', '.join(str(r) for r in ranks)}{at}; "
                    f"root cause rank {root}{tries}", failure_error(f) or first_line(s.get("message")))
        if f.get("kind") == "launcher" or root is None:
            return f"the launcher failed{tries}", failure_error(f) or first_line(s.get("message"))
        return (f"rank {root} failed{at} (the root cause){how}{tries}",
                failure_error(f) or first_line(s.get("message")))
    return status or "unknown", first_line(s.get("message"))


def checkpoint_file(data: RunData, rec: dict[str, Any] | None) -> Checkpoint | None:
    """A manifest record as the file it names (found again where the run directory moved)."""
    if not isinstance(rec, dict) or not isinstance(rec.get("path"), str) or not rec.get("path"):
        return None
    path = Path(rec["path"])
    ckpt_dir = data.run_dir / "checkpoints"
    if path.is_absolute():
        file = path
        if not file.exists() and (ckpt_dir / path.name).exists():  # the run directory was moved
            file = ckpt_dir / path.name
    else:
        candidates = [ckpt_dir / path, data.run_dir / path]
        file = next((c for c in candidates if c.exists()), candidates[0] if len(path.parts) == 1 else candidates[1])
    exists = file.exists()
    size = as_int(rec.get("size"))
    if size is None and exists:
        try:
            size = file.stat().st_size
        except OSError:
            size = None
    metric = rec.get("metric")
    return Checkpoint(name=path.name, file=file, step=as_int(rec.get("step")), kind=str(rec.get("kind") or ""),
                      metric=float(metric) if fmt.is_number(metric) else None,
                      metric_name=str(rec.get("metric_name") or data.config.checkpoint.best_metric or ""),
                      size=size, exists=exists)


def _best_and_latest(data: RunData) -> tuple[Checkpoint | None, Checkpoint | None]:
    """The newest best checkpoint (the manifest's, else the summary's) and the latest one."""
    files = data.checkpoints
    bests = [f for f in files if f.get("kind") == "best"]
    best_rec: dict[str, Any] | None = None
    if bests:
        best_rec = max(bests, key=lambda f: (fmt.is_number(f.get("time")) and f["time"] or 0,
                                             as_int(f.get("step")) or 0))
    elif data.manifest_best:
        best_rec = data.manifest_best
    elif isinstance((data.summary or {}).get("best_checkpoint"), dict):
        best_rec = dict(data.summary["best_checkpoint"], kind="best")  # type: ignore[index]
    latest_rec = max(files, key=lambda f: (as_int(f.get("step")) or 0, fmt.is_number(f.get("time")) and f["time"] or 0),
                     default=None)
    return checkpoint_file(data, best_rec), checkpoint_file(data, latest_rec)


def _goodput(summary: dict[str, Any] | None) -> dict[str, Any] | None:
    g = (summary or {}).get("goodput")
    return g if isinstance(g, dict) else None


def ettr_pct(g: dict[str, Any]) -> float | None:
    """summary.json `goodput`'s effective training time ratio in percent (from its parts when
    the ratio is missing); None when neither is there."""
    e = g.get("ettr")
    if not fmt.is_number(e):
        wall, prod = g.get("wall_s"), g.get("productive_s")
        if fmt.is_number(wall) and fmt.is_number(prod) and wall > 0:
            e = prod / wall
        else:
            return None
    return float(e) * 100.0 if e <= 1.0 else float(e)


def badput(g: dict[str, Any]) -> list[tuple[str, float]]:
    """The badput causes that cost time, largest first: (cause, seconds)."""
    b = g.get("badput_s")
    if not isinstance(b, dict):
        return []
    return sorted(((str(k), float(v)) for k, v in b.items() if fmt.is_number(v) and v > 0), key=lambda kv: -kv[1])


def goodput_text(g: dict[str, Any], top: int = 3) -> str:
    """`ETTR 92.1%: productive 7 h 22 min of 8 h 00 min; badput: restart 20 min (4.2%), ...`."""
    pct = ettr_pct(g)
    parts = [f"ETTR {pct:.1f}%" if pct is not None else "ETTR -"]
    wall, prod = g.get("wall_s"), g.get("productive_s")
    if fmt.is_number(prod) and fmt.is_number(wall):
        parts[0] += f": productive {fmt.duration(prod)} of {fmt.duration(wall)}"
    causes = badput(g)
    if causes:
        def share(s: float) -> str:
            return f" ({100 * s / wall:.1f}%)" if fmt.is_number(wall) and wall > 0 else ""
        shown = [f"{k} {fmt.duration(v)}{share(v)}" for k, v in causes[:top]]
        rest = causes[top:]
        if rest:
            shown.append(f"{len(rest)} more {fmt.duration(sum(v for _, v in rest))}")
        parts.append("badput: " + ", ".join(shown))
    if fmt.is_number(g.get("unaccounted_s")) and g["unaccounted_s"] > 0:
        parts.append(f"unaccounted {fmt.duration(g['unaccounted_s'])}")
    return "; ".join(parts)


def headline(data: RunData) -> Headline:
    """The figures that matter, from the summary and the metrics the run left."""
    s = data.summary or {}
    tot = data.totals()
    name = str(s.get("name") or data.run_dir.name)
    red = data.reduced
    last_step = red[-1].step if red else None

    steps_done = as_int(tot.get("steps_completed"))
    if steps_done is None and last_step is not None:
        steps_done = last_step
    steps_total = data.config.train.steps if data.config.train.steps > 0 and not data.config.job.script else None
    why, detail = _why(data, steps_done, steps_total, last_step)

    # loss: the timeline's reduced mean (every attempt, each step from the attempt shown)
    finite = [(r.step, r.loss_mean) for r in red if r.step > 0 and fmt.is_number(r.loss_mean)]
    last = next(((r.step, r.loss_mean) for r in reversed(red) if r.step > 0 and r.loss_mean is not None), None)
    if finite:
        first_p = LossPoint(finite[0][1], finite[0][0])
        b = min(finite, key=lambda sv: sv[1])
        best_p = LossPoint(b[1], b[0])
        last_p = LossPoint(last[1], last[0]) if last else None
    else:
        def pt(key: str, step_key: str | None = None) -> LossPoint | None:
            v = tot.get(key)
            return None if v is None else LossPoint(v, as_int(tot.get(step_key)) if step_key else None)
        first_p, best_p, last_p = pt("first_loss"), pt("best_loss", "best_loss_step"), pt("last_loss")

    sps = [r.samples_per_s for r in red if r.step > 0 and fmt.is_number(r.samples_per_s)]
    stt = [r.step_time_max for r in red if r.step > 0 and fmt.is_number(r.step_time_max)]

    started = s.get("started") if fmt.is_number(s.get("started")) else None
    wall = s.get("wall_time_s") if fmt.is_number(s.get("wall_time_s")) else None
    wall_source = ""
    if started is None or wall is None:  # no summary: the metrics' own clock
        times = [t for t in ([a.started for a in data.attempts] + [r.ts for r in red]) if fmt.is_number(t) and t > 0]
        if times:
            started = started if started is not None else min(times)
            if wall is None:
                wall = max(times) - started
                wall_source = "from the metrics (no summary.json)"
    ended = started + wall if started is not None and wall is not None else None

    ws = data.world_size or as_int(s.get("world_size")) or 0
    w = data.config.world
    device = getattr(w.device, "value", w.device)
    shape = (f"{fmt.plural(w.nodes, 'node')} × {w.ranks_per_node}, {device}"
             if w.nodes * w.ranks_per_node == ws and ws else "")

    by_rule: dict[str, list[str]] = {}
    for a in data.anomalies:
        by_rule.setdefault(str(a.get("rule")), []).append(str(a.get("action") or "-"))
    counts = sorted(((rule, len(acts), "/".join(sorted(set(acts)))) for rule, acts in by_rule.items()),
                    key=lambda x: (-x[1], x[0]))
    best, latest = _best_and_latest(data)
    epoch = red[-1].epoch if red else None
    return Headline(
        name=name, status=data.status, why=why, detail=detail, started=started, ended=ended, wall_s=wall,
        wall_source=wall_source, steps_done=steps_done, steps_total=steps_total, epoch=epoch,
        loss_first=first_p, loss_best=best_p, loss_last=last_p,
        samples_per_s=statistics.median(sps) if sps else None,
        step_time_s=statistics.median(stt) if stt else None,
        world_size=ws, world_shape=shape, cards=sorted(card_series(data)), card_kinds=card_kinds(data),
        best=best, latest=latest, goodput=_goodput(data.summary), anomaly_counts=counts,
        anomalies=len(data.anomalies), attempts=max(len(data.summary_attempts), len(data.attempts), 1),
    )



def compute_text(comp: dict[str, Any] | None) -> str:
    """summary.json's `compute` in one line: `544 tokens/s, 0.000449 TFLOPS per card, MFU 0.015 of a
    0.0299 TFLOPS peak (preflight); medians over steps`; empty when the ranks reported no tokens."""
    if not isinstance(comp, dict) or comp.get("tokens_per_s") is None and comp.get("tflops_per_card") is None:
        return ""
    parts = []
    if comp.get("tokens_per_s") is not None:
        parts.append(f"{fmt.rate(comp['tokens_per_s'])} tokens/s")
    if comp.get("tflops_per_card") is not None:
        parts.append(f"{comp['tflops_per_card']:.3g} TFLOPS per card")
    source = str(comp.get("peak_source") or "")
    if comp.get("mfu") is not None and comp.get("peak_tflops"):
        parts.append(f"MFU {comp['mfu']:.3g} of a {comp['peak_tflops']:.3g} TFLOPS peak ({source.split(' (')[0]})")
    else:
        parts.append("MFU - (no peak: summary.json compute.peak_source)")
    return ", ".join(parts) + "; medians over steps"
