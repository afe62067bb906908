"""A rule as its config says it, without the rule's code: its typed config with every
placeholder filled (`rule_config`), the name it goes by (`name_of`), and which rules a job
runs (`chosen_configs`: the defaults, replaced by user entries of the same kind).

The aggregator's rules (`aggregator/policies.py`) are built from these; the driver's
`mindpulse rules` and the summary (`changes.py`) name and check rules with the same
functions, so neither runs the aggregator's code.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from mindpulse.config import DEFAULT_RULES, AnomalyRuleConfig, RuleKind, resolve_rule, sections_of

RuleInput = AnomalyRuleConfig | Mapping[str, Any]
"""A rule's config: typed, or the plain dict of its fields."""

RULE_FIELDS = tuple(f.name for f in dataclasses.fields(AnomalyRuleConfig))
BUILT_IN_KINDS: tuple[str, ...] = tuple(k.value for k in RuleKind)
"""The kinds of rule mindpulse ships (each has a class in `aggregator/policies.py`)."""


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def plain_rule(cfg: RuleInput) -> dict[str, Any]:
    """A rule's config as a plain dict (enum values as their text)."""
    if isinstance(cfg, AnomalyRuleConfig):
        return {f: _plain(getattr(cfg, f)) for f in RULE_FIELDS}
    return {k: _plain(v) for k, v in cfg.items()}


def rule_config(cfg: RuleInput, kind: str | None = None, straggler_threshold: float | None = None) -> AnomalyRuleConfig:
    """The typed config of a rule of `kind` (default: the config's own `rule`), every
    placeholder filled with the rule's default; fields `AnomalyRuleConfig` does not have are
    left out, and a kind it does not know (an extra rule) keeps the config's default `rule`."""
    raw = plain_rule(cfg)
    raw["rule"] = raw.get("rule") or kind or RuleKind.THRESHOLD.value
    raw = resolve_rule(raw, straggler_threshold)
    typed = {k: v for k, v in raw.items() if k in RULE_FIELDS and not (k == "rule" and v not in BUILT_IN_KINDS)}
    return sections_of({"anomalies": [typed]}).anomalies[0]


def name_of(config: AnomalyRuleConfig, kind: str) -> str:
    """The name a built-in rule of `kind` goes by: its config's `name`, else its kind (a
    threshold rule without one: its condition, `loss>5`)."""
    if config.name:
        return config.name
    if kind == RuleKind.THRESHOLD.value:
        return f"{config.metric}{config.op}{float(config.threshold):g}"  # type: ignore[arg-type]  # a threshold rule has one (config checks)
    return kind


def chosen_configs(configs: Sequence[RuleInput], kinds: Collection[str] = BUILT_IN_KINDS,
                   extra_kinds: Collection[str] = ()) -> list[dict[str, Any]]:
    """The plain configs of the rules a job runs, in order: the defaults (and one of each extra
    kind), each replaced by the user entries of its kind, then the other user entries; the
    turned-off ones and those of a kind not in `kinds` left out."""
    chosen: dict[str, dict[str, Any]] = {k.value: {"rule": k.value} for k in DEFAULT_RULES if k.value in kinds}
    for k in extra_kinds:
        chosen.setdefault(k, {"rule": k})
    added: list[dict[str, Any]] = []
    for c in configs:
        plain = plain_rule(c)
        # a user entry of a default's kind replaces the default; several entries of one
        # kind (card_overload on temp_c and on power_w) all stay
        chosen.pop(plain.get("rule"), None)
        added.append(plain)
    return [c for c in list(chosen.values()) + added if c.get("enabled", True) is not False and c.get("rule") in kinds]
