"""The launcher's contracts with its long-lived actors: what the aggregator and each node
agent are told when an attempt starts.

`RankSettings` (mindpulse/config/rank_settings.py) is the launcher → rank contract; these two are the
launcher → aggregator and launcher → node agent ones. `launcher/spec.py` builds all three
once per attempt from the run's config (the benchmarks build them through the same
functions), so every default comes from the config's dataclasses (mindpulse/config) and
nothing here repeats one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mindpulse.config import RULE_DEFAULTS, AnomalyRuleConfig, MonitorConfig, RuleKind, RunConfig, sections_of

COMPUTE_DROP_WINDOW = int(RULE_DEFAULTS[RuleKind.COMPUTE_DROP]["window"])
"""The compute_drop rule's default window (steps), as the config's rule defaults say."""


def compute_drop_window(rules: Iterable[AnomalyRuleConfig]) -> int:
    """The `compute_drop` rule's window: the nodes keep each rank's TFLOPS median over it."""
    for rc in rules:
        if rc.rule is RuleKind.COMPUTE_DROP and rc.window:
            return int(rc.window)
    return COMPUTE_DROP_WINDOW


@dataclass(frozen=True)
class BestSeed:
    """The best checkpoint the run's manifest lists when an attempt starts: the aggregator's
    starting best, kept until a step beats it."""

    metric: float
    metric_name: str
    step: int = 0
    path: str | None = None

    @staticmethod
    def of(raw: Any) -> BestSeed | None:
        """From the manifest's plain form ({metric, metric_name, step, path}); None when it
        holds no finite metric."""
        if isinstance(raw, BestSeed):
            return raw
        if not isinstance(raw, Mapping):
            return None
        metric = raw.get("metric")
        if not isinstance(metric, (int, float)) or isinstance(metric, bool) or not math.isfinite(metric):
            return None
        path = raw.get("path")
        return BestSeed(metric=float(metric), metric_name=str(raw.get("metric_name") or ""),
                        step=int(raw.get("step") or 0), path=str(path) if path is not None else None)


@dataclass(frozen=True)
class AggregatorSettings:
    """The launcher → aggregator contract of one attempt."""

    config: RunConfig = field(default_factory=RunConfig)
    """The run's resolved config: the aggregator reads its world, monitor, checkpoint, eval,
    anomalies, msrun and output sections."""
    tensorboard: bool = True
    start_step: int = 0
    """The step this attempt starts after (a resumed run): the step window counts from it."""
    attempt: int = 0
    """The launcher attempt (metrics.msgpack's markers, rule changes)."""
    rollbacks: Mapping[str, int] = field(default_factory=dict)
    """Rollbacks each rule has made in this launch (the launcher's count, per attempt)."""
    launch_started: float = 0.0
    """When the launch started (the live `goodput/ettr` spans the launch); 0: not shown."""
    productive_before_s: float = 0.0
    """Productive seconds of the earlier attempts."""
    peak_dtype: str = ""
    """The dtype MFU's peak is taken for (empty: float32, the built-in recipe's: card_peaks.peak_dtype)."""
    config_yaml: str = ""
    """config.yaml as written (TensorBoard's `config` text, the metrics rule changes may name)."""
    best: BestSeed | None = None
    extra_rules: Mapping[str, type] = field(default_factory=dict)
    """Rule classes beyond the built-in kinds, by kind (an extension point: tests)."""

    @staticmethod
    def of(raw: AggregatorSettings | Mapping[str, Any] | None) -> AggregatorSettings:
        """The settings, or their plain form: the config's sections as dicts (`monitor`,
        `checkpoint`, `anomalies`, ...; every field left out takes its default) beside the keys
        named as this class's fields (`goodput`: {started, productive_s}). The launcher sends
        the typed form; the plain one is what tests and benchmarks write by hand."""
        if isinstance(raw, AggregatorSettings):
            return raw
        raw = dict(raw or {})
        extra = dict(raw.get("extra_rules") or {})
        known = {k.value for k in RuleKind}
        sections = {k: v for k, v in raw.items() if k in {f.name for f in dataclasses.fields(RunConfig)}}
        # entries of extra kinds are built from their class alone (no typed config knows them)
        sections["anomalies"] = [c for c in raw.get("anomalies") or [] if not isinstance(c, Mapping)
                                 or c.get("rule", RuleKind.THRESHOLD.value) in known]
        goodput = raw.get("goodput") or {}
        return AggregatorSettings(
            config=sections_of(sections), tensorboard=bool(raw.get("tensorboard", True)),
            start_step=int(raw.get("start_step") or 0), attempt=int(raw.get("attempt") or 0),
            rollbacks=dict(raw.get("rollbacks") or {}), launch_started=float(goodput.get("started") or 0.0),
            productive_before_s=float(goodput.get("productive_s") or 0.0),
            peak_dtype=str(raw.get("peak_dtype") or ""), config_yaml=str(raw.get("config_yaml") or ""),
            best=BestSeed.of(raw.get("best")), extra_rules=extra)


@dataclass(frozen=True)
class NodeSettings:
    """The launcher → node agent contract: one node of one attempt."""

    node: int
    device: str
    """`world.device` (cpu, ascend, gpu)."""
    rank_devices: Mapping[int, int]
    """Each of the node's ranks → its physical card."""
    world_size: int | None = None
    telemetry_interval_s: float = MonitorConfig.telemetry_interval_s
    straggler_window: int = MonitorConfig.straggler_window
    collect_freq: int = MonitorConfig.collect_freq
    compute_window: int = COMPUTE_DROP_WINDOW
    """The compute_drop rule's window: the node keeps each rank's TFLOPS median over it."""
    relay_token: str = ""
    """The ranks' key to the node's relay (this attempt only)."""
    driver: Mapping[str, Any] = field(default_factory=dict)
    """The launcher's process identity; while given, the agent's watchdog ends the node's
    processes of the run once that process is gone."""

    @property
    def local_ranks(self) -> int:
        return len(self.rank_devices)


__all__ = ["COMPUTE_DROP_WINDOW", "AggregatorSettings", "BestSeed", "NodeSettings", "compute_drop_window"]
