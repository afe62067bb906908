"""Anomaly rules: small classes that read a reduced step (or telemetry) and return a
firing whose message quotes the numbers. Policies decide; the aggregator acts.

Each rule gets its typed config, a `mindpulse.config.AnomalyRuleConfig` (the `anomalies`
list of the run config) with every placeholder replaced by the rule's default
(`RULE_DEFAULTS`, filled in by `resolve_rule` when the rule is built: `rule_config`, in the
base's `mindpulse/rules/configs.py`, which names rules and chooses them as the driver does). A plain
dict of its fields is taken too (rules.json's entries, hand-written rules).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from mindpulse.common.formatting import general
from mindpulse.reduction.baselines import MAD_SIGMA, RECENT_STEPS, START_WARMUP_STEPS, Baseline, Phase
from mindpulse.reduction.reducer import ReducedStep
from mindpulse.rules.configs import RuleInput, chosen_configs, name_of, plain_rule, rule_config
from mindpulse.wire.protocol import Action


@dataclass
class Firing:
    rule: str
    step: int
    rank: int | None
    value: float | None
    threshold: float | None
    action: Action
    message: str

    def to_record(self) -> dict[str, Any]:
        d = asdict(self)
        d["action"] = self.action.value
        return d


class Rule:
    kind = "rule"

    def __init__(self, cfg: RuleInput):
        self.config = rule_config(cfg, self.kind)
        """The rule's typed config, every default filled in."""
        self.name = name_of(self.config, self.kind)
        self.action = self.config.action or Action.WARN

    @property
    def cfg(self) -> dict[str, Any]:
        """The config as a plain dict (rules.json's form), its `rule` this rule's kind."""
        return dict(plain_rule(self.config), rule=self.kind)

    def check(self, red: ReducedStep) -> Firing | None:
        return None

    def check_telemetry(self, cards: Iterable[dict[str, Any]], now: float, step: int) -> list[Firing]:
        return []

    def fire(self, red_step: int, rank: int | None, value: float | None, threshold: float | None,
             message: str) -> Firing:
        return Firing(self.name, red_step, rank, value, threshold, self.action, message)


class NonFiniteRule(Rule):
    """Loss or gradients NaN/Inf on any rank; names the rank from its local values."""

    kind = "nonfinite"

    def check(self, red: ReducedStep) -> Firing | None:
        if red.step == 0:
            return None
        bad = red.nonfinite_ranks
        global_bad = red.grad_norm is not None and not math.isfinite(red.grad_norm)
        if not bad and not global_bad:
            return None
        if bad:
            r = bad[0]
            p = red.per_rank[r]
            what = []
            if p.loss is not None and not math.isfinite(p.loss):
                what.append(f"loss {general(p.loss)}")
            if p.nan_count:
                what.append(f"{p.nan_count} NaN gradient values")
            if p.inf_count:
                what.append(f"{p.inf_count} Inf gradient values")
            if p.grad_norm_local is not None and not math.isfinite(p.grad_norm_local) and not what:
                what.append(f"local grad norm {general(p.grad_norm_local)}")
            value = p.loss if (p.loss is not None and not math.isfinite(p.loss)) else p.grad_norm_local
            others = f" (also ranks {bad[1:]})" if len(bad) > 1 else ""
            msg = f"non-finite values on rank {r} at step {red.step}: {', '.join(what)}{others}"
            return self.fire(red.step, r, value, None, msg)
        return self.fire(red.step, None, red.grad_norm, None, f"global grad norm is {general(red.grad_norm)} at step "
                         f"{red.step} (no rank reported it locally)")


class GradExplosionRule(Rule):
    """Global grad norm above `threshold` (from the first step), or above `factor` x its
    rolling median once that baseline is established: `warmup` steps after the start, a
    restore or a rollback left out, then a full `window` (mindpulse/reduction/baselines.py). An
    evaluation or a checkpoint write changes no gradient, so it needs no new warm-up."""

    kind = "grad_explosion"

    def __init__(self, cfg: RuleInput):
        super().__init__(cfg)
        c = self.config
        self.limit = c.threshold
        self.factor = c.factor
        self.window = c.window
        self.warmup = c.warmup
        self.baseline = Baseline(self.window, self.warmup)

    @property
    def history(self) -> deque[float]:
        """The baseline's window."""
        return self.baseline.values

    def check(self, red: ReducedStep) -> Firing | None:
        g = red.grad_norm
        if red.step == 0 or g is None or not math.isfinite(g):
            return None
        phase = self.baseline.observe(red.step)
        firing = None
        culprit = red.grad_norm_local_max_rank
        if self.limit is not None and g > self.limit:
            firing = self.fire(red.step, culprit, g, self.limit,
                               f"gradient explosion at step {red.step}: global grad norm {general(g)} > limit "
                               f"{general(self.limit)} (largest local norm on rank {culprit}: "
                               f"{general(red.grad_norm_local_max)})")
        elif phase is Phase.JUDGING:
            med, _ = self.baseline.stats()
            if med > 0 and g > self.factor * med:
                firing = self.fire(red.step, culprit, g, self.factor * med,
                                   f"gradient explosion at step {red.step}: global grad norm {general(g)} is "
                                   f"{g / med:.1f}x its baseline (limit {self.factor:g}x; baseline: "
                                   f"{self.baseline.describe()}, after a {self.warmup}-step warm-up); "
                                   f"largest local norm on rank {culprit}: {general(red.grad_norm_local_max)}")
        if firing is None and phase is not Phase.WARMING:
            self.baseline.add(g)  # spikes stay out of the baseline
        return firing


class LossSpikeRule(Rule):
    """Robust z-score of the reduced loss against its baseline (median and MAD over a full
    `window`, after `warmup` steps that follow the start, a restore or a rollback: an
    evaluation or a checkpoint write changes no loss, so it needs no new warm-up)."""

    kind = "loss_spike"

    def __init__(self, cfg: RuleInput):
        super().__init__(cfg)
        c = self.config
        self.z = c.z
        self.window = c.window
        self.warmup = c.warmup
        self.patience = c.patience
        self.baseline = Baseline(self.window, self.warmup)
        self.hits = 0

    @property
    def history(self) -> deque[float]:
        """The baseline's window."""
        return self.baseline.values

    def check(self, red: ReducedStep) -> Firing | None:
        loss = red.loss_mean
        if red.step == 0 or loss is None or not math.isfinite(loss):
            return None
        phase = self.baseline.observe(red.step)
        if phase is Phase.WARMING:
            return None
        firing = None
        if phase is Phase.JUDGING:
            med, mad = self.baseline.stats()
            scale = MAD_SIGMA * mad if mad > 0 else max(abs(med) * 1e-3, 1e-12)
            zs = (loss - med) / scale
            if zs > self.z:
                self.hits += 1
                if self.hits >= self.patience:
                    rank = red.loss_max_rank
                    firing = self.fire(red.step, rank, loss, med + self.z * scale,
                                       f"loss spike at step {red.step}: mean loss {general(loss)} is {zs:.1f} robust "
                                       f"z-scores above its baseline (limit z={self.z:g}, {self.hits} consecutive; "
                                       f"baseline: {self.baseline.describe()}, after a {self.warmup}-step "
                                       f"warm-up); highest on rank {rank}: {general(red.loss_max)}")
                return firing  # spikes stay out of the baseline
            self.hits = 0
        self.baseline.add(loss)
        return firing


_OPS = {">": lambda a, b: a > b, ">=": lambda a, b: a >= b, "<": lambda a, b: a < b, "<=": lambda a, b: a <= b}


class ThresholdRule(Rule):
    """A user rule on any reduced metric: `metric op threshold` for `for_steps` steps."""

    kind = "threshold"

    def __init__(self, cfg: RuleInput):
        super().__init__(cfg)
        c = self.config
        self.metric = c.metric
        self.op = c.op
        self.threshold = float(c.threshold)  # type: ignore[arg-type]  # a threshold rule has one (config checks)
        self.for_steps = c.for_steps
        self.count = 0

    def check(self, red: ReducedStep) -> Firing | None:
        v = red.metric(self.metric)
        if v is None or red.step == 0:
            return None  # metric absent at this step (e.g. eval_loss between evaluations)
        if math.isfinite(v) and _OPS[self.op](v, self.threshold):
            self.count += 1
            if self.count == self.for_steps:  # fires once per excursion
                return self.fire(red.step, None, v, self.threshold,
                                 f"{self.metric} = {general(v)} {self.op} {general(self.threshold)} for "
                                 f"{self.for_steps} step(s) at step {red.step}")
        else:
            self.count = 0
        return None


class CardOverloadRule(Rule):
    """A card's temperature, HBM use (%) or power above a limit for `for_s` seconds."""

    kind = "card_overload"
    def __init__(self, cfg: RuleInput):
        super().__init__(cfg)
        c = self.config
        self.metric = c.metric
        self.threshold = c.threshold
        self.for_s = c.for_s
        self.since: dict[tuple[Any, Any], float] = {}
        self.fired: set[tuple[Any, Any]] = set()

    @staticmethod
    def value_of(card: dict[str, Any], metric: str) -> float | None:
        if metric == "memory_pct":
            used, total = card.get("memory_used_mb"), card.get("memory_total_mb")
            return 100.0 * used / total if used is not None and total else None
        v = card.get(metric)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    def check_telemetry(self, cards: Iterable[dict[str, Any]], now: float, step: int) -> list[Firing]:
        if self.threshold is None:
            return []
        out = []
        for card in cards:
            key = (card.get("node"), card.get("card"))
            v = self.value_of(card, self.metric)
            if v is None or v <= self.threshold:
                self.since.pop(key, None)
                self.fired.discard(key)
                continue
            start = self.since.setdefault(key, now)  # one clock: the nodes' clocks may differ
            if now - start >= self.for_s and key not in self.fired:
                self.fired.add(key)
                ranks = card.get("ranks") or []
                out.append(self.fire(step, ranks[0] if ranks else None, v, self.threshold,
                                     f"card overload: node {key[0]} card {key[1]} (ranks {ranks}) {self.metric} "
                                     f"{general(v)} > {general(self.threshold)} for {now - start:.0f}s "
                                     f"(limit {self.for_s:g}s)"))
        return out


class DesyncRule(Rule):
    """Ranks whose parameter fingerprints differ from the majority (data parallel must keep
    every rank's weights identical). With `tolerance` > 0 the parameter norms are compared
    with that relative tolerance instead of the bit-exact hashes."""

    kind = "desync"
    CAUSES = ("ranks initialised without a common seed or a broadcast of the weights; "
              "a rank loaded another checkpoint; silent data corruption on a card")

    def __init__(self, cfg: RuleInput):
        super().__init__(cfg)
        self.tolerance = float(self.config.tolerance)

    def check(self, red: ReducedStep) -> Firing | None:
        fps = red.fingerprints
        if len(fps) < 2:
            return None
        if self.tolerance > 0:
            norms = red.param_norms
            if len(norms) < 2:
                return None
            ref = statistics.median(norms.values())
            odd = sorted(r for r, n in norms.items()
                         if not math.isfinite(n) or abs(n - ref) > self.tolerance * max(abs(ref), 1e-12))
            if not odd:
                return None
            detail = ", ".join(f"rank {r} norm {general(norms[r])}" for r in odd) + f" vs median {general(ref)}"
        else:
            groups: dict[str, list[int]] = {}
            for r, fp in sorted(fps.items()):
                groups.setdefault(fp, []).append(r)
            if len(groups) == 1:
                return None
            # the majority; on a tie, the group holding the lowest rank (rank 0) is the reference
            majority = max(groups.values(), key=lambda rs: (len(rs), -rs[0]))
            odd = sorted(r for r in fps if r not in majority)
            detail = f"ranks {odd} differ from the majority {majority} (fingerprint {fps[majority[0]]})"
        return self.fire(red.step, odd[0], None, self.tolerance or None,
                         f"parameters out of sync at step {red.step}: {detail}. Likely causes: {self.CAUSES}")


class StragglerRule(Rule):
    """A rank whose straggler score (the fastest rank's median busy time / its own, each over
    a full window after a warm-up: `mindpulse/reduction/baselines.py`) stays below `threshold`
    (monitor.straggler_threshold by default) for `patience` steps. Fires once per excursion."""

    kind = "straggler"

    def __init__(self, cfg: RuleInput):
        super().__init__(cfg)
        self.threshold = float(self.config.threshold)  # type: ignore[arg-type]  # filled in: resolve_rule
        self.patience = int(self.config.patience)
        self.hits: dict[int, int] = {}
        self.flagged: set[int] = set()

    def check(self, red: ReducedStep) -> Firing | None:
        scores = red.straggler_scores
        below = {r for r, s in scores.items() if s < self.threshold}
        self.hits = {r: self.hits.get(r, 0) + 1 for r in below}  # consecutive steps below
        slow = sorted((r for r in below if self.hits[r] >= self.patience), key=lambda r: scores[r])
        self.flagged &= below
        new = [r for r in slow if r not in self.flagged]
        if not new:
            return None
        r = new[0]
        self.flagged.add(r)
        p = red.per_rank.get(r)
        wait = f"; its data wait {p.data_wait_s * 1000:.0f} ms" if p and p.data_wait_s is not None else ""
        inputs = [x for x in red.straggler_inputs or () if isinstance(x, dict) and x.get("fast")]
        base = ""
        if inputs:
            fast = min(float(x["fast"]) for x in inputs)
            n = max(int(x.get("n") or 0) for x in inputs)
            w = max(int(x.get("w") or 0) for x in inputs)
            over = f" over {n} steps" if n else ""
            base = (f"; baseline: the fastest rank's median busy time {fast * 1000:.0f} ms{over}, after a "
                    f"{w}-step warm-up")
        return self.fire(red.step, r, scores[r], self.threshold,
                         f"straggler: rank {r} scores {scores[r]:.2f} against the fastest rank (limit "
                         f"{self.threshold:g}, {self.hits[r]} steps in a row) at step {red.step}{wait}{base}")


class ComputeDropRule(Rule):
    """A rank whose achieved TFLOPS (so its MFU) fall below `factor` x its own baseline while
    the other ranks hold, for `for_steps` consecutive steps: a throttled or failing card, or
    its data path. The baselines are kept where the packets are (`NodeComputeDrops`,
    mindpulse/reduction/baselines.py: on the nodes, or in the aggregator on the flat path): each rank's
    median over a full window after a warm-up, and a drop must also clear that window's noise
    (`NOISE_SIGMAS` x 1.4826 MAD); the step carries only the flagged ranks.

    A drop that every rank shows at once is the host or the job (another process on the
    machine, the data pipeline, a collective), not one card: the rank's level is judged
    against the median level of the others (a rank not flagged holds at least 0.95 of its
    median), so a drop the others share does not count. Fires once per excursion, naming the
    rank and its card."""

    kind = "compute_drop"

    def __init__(self, cfg: RuleInput):
        super().__init__(cfg)
        self.factor = float(self.config.factor)
        self.for_steps = int(self.config.for_steps)
        self.hits: dict[int, int] = {}
        self.flagged: set[int] = set()

    @staticmethod
    def _others_level(r: int, levels: dict[int, float], world: int) -> float:
        """The median level (TFLOPS / own median) of the ranks other than `r`; a rank that was
        not flagged counts as holding (1.0)."""
        others = [q for o, q in levels.items() if o != r]
        others += [1.0] * max(0, world - 1 - len(others))
        return statistics.median(others) if others else 1.0

    def check(self, red: ReducedStep) -> Firing | None:
        flags = {int(x[0]): x for x in red.compute_flags or () if x[2] > 0}
        levels = {r: float(x[1]) / float(x[2]) for r, x in flags.items()}
        world = max(int(red.world_size or 0), len(levels))
        held = {r: self._others_level(r, levels, world) for r in levels}
        below = {r for r, q in levels.items() if world > 1 and q < self.factor * held[r]}
        self.hits = {r: self.hits.get(r, 0) + 1 for r in below}  # consecutive steps below
        self.flagged &= below
        new = sorted((r for r in below if self.hits[r] >= self.for_steps and r not in self.flagged),
                     key=lambda r: levels[r])
        if not new:
            return None
        r = new[0]
        self.flagged.add(r)
        _, v, m, *rest = flags[r]
        mad, n = (float(rest[0]), int(rest[1])) if len(rest) >= 2 else (None, None)
        card = red.rank_cards.get(r)
        on = f" on {card}" if card else ""
        peak = red.peak_tflops
        if peak:
            what, value, limit = "MFU", v / peak, self.factor * m / peak
            nums = (f"MFU {value:.3g} ({v:.3g} TFLOPS, its last {RECENT_STEPS} steps' median) against its median "
                    f"{m / peak:.3g} ({m:.3g} TFLOPS)")
        else:
            what, value, limit = "achieved TFLOPS", v, self.factor * m
            nums = f"{v:.3g} TFLOPS (its last {RECENT_STEPS} steps' median) against its median {m:.3g}"
        base = (f" (baseline: its median over {n} steps after a {START_WARMUP_STEPS}-step warm-up, MAD "
                f"{mad:.3g} TFLOPS)" if n else "")
        others = held[r]
        return self.fire(red.step, r, value, limit,
                         f"compute drop: rank {r}{on}: {nums}{base}, below {self.factor:g} x its median for "
                         f"{self.hits[r]} steps at step {red.step}, while the other ranks hold "
                         f"{others:.2f} x theirs ({what} falls on this rank alone: a throttled or failing card, "
                         "or its data path)")


RULES: dict[str, type[Rule]] = {
    r.kind: r for r in (NonFiniteRule, GradExplosionRule, LossSpikeRule, ThresholdRule, CardOverloadRule,
                        DesyncRule, StragglerRule, ComputeDropRule)
}


def build_rules(configs: Sequence[RuleInput], extra_kinds: Mapping[str, type[Rule]] | None = None,
                straggler_threshold: float | None = None) -> list[Rule]:
    """Defaults, replaced by user entries of the same built-in kind; threshold rules added
    (`chosen_configs`). A straggler rule without a threshold takes `straggler_threshold`
    (monitor.straggler_threshold)."""
    kinds = dict(RULES, **(extra_kinds or {}))
    return [kinds[c["rule"]](rule_config(c, c["rule"], straggler_threshold))
            for c in chosen_configs(configs, kinds, extra_kinds or ())]


class PolicyEngine:
    def __init__(self, rules: list[Rule]):
        self.rules = rules
        self._errors: list[dict[str, str]] = []
        self._seen: set[tuple[str, str]] = set()

    def _failed(self, rule: Rule, exc: Exception) -> None:
        """A broken rule must not take the aggregator down, nor fail silently: each (rule,
        cause) is handed to the aggregator once to report."""
        rule.errors = getattr(rule, "errors", 0) + 1  # type: ignore[attr-defined]
        cause = f"{type(exc).__name__}: {exc}"[:500]
        if (rule.name, cause) not in self._seen:
            self._seen.add((rule.name, cause))
            self._errors.append({"rule": rule.name, "error": cause})

    def take_errors(self) -> list[dict[str, str]]:
        out, self._errors = self._errors, []
        return out

    def on_step(self, red: ReducedStep) -> list[Firing]:
        out = []
        for rule in self.rules:
            try:
                f = rule.check(red)
            except Exception as exc:  # a failing rule must not stop the others: counted, reported once per cause
                self._failed(rule, exc)
                continue
            if f is not None:
                out.append(f)
        return out

    def on_telemetry(self, cards: list[dict[str, Any]], now: float, step: int) -> list[Firing]:
        out = []
        for rule in self.rules:
            try:
                out.extend(rule.check_telemetry(cards, now, step))
            except Exception as exc:  # a failing rule must not stop the others: counted, reported once per cause
                self._failed(rule, exc)
        return out
