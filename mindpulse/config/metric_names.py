"""The metric names a config may give (`anomalies[].metric`, `checkpoint.best_metric`):
mindpulse's reduced metrics and their aliases, each recipe's evaluation metrics, and the
job's own declared in `eval.metrics`. One place, so that where these names come from can
change without touching the checks that use them (`validation.py`).
"""

from __future__ import annotations

from mindpulse.config.schema import RunConfig
from mindpulse.registry.metrics import FIXED_REDUCED, aliases, reduced_fields

REDUCED_METRICS = ("step", *reduced_fields(), *FIXED_REDUCED)
"""The numeric fields of the aggregator's `ReducedStep`, which rules and the best checkpoint can
name: from the metric registry (mindpulse/registry/metrics.py); tests/unit/test_config.py checks them
against `ReducedStep`."""
METRIC_ALIASES = tuple(aliases())
"""`ReducedStep.metric`'s other names (the registry's aliases: loss for loss_mean, ...)."""
RECIPE_METRICS: dict[str, tuple[str, ...]] = {"llama_finetune": ("eval_loss", "eval_ppl")}
"""What each built-in recipe reports (as extra metrics) when evaluation is on."""


def known_metrics(cfg: RunConfig) -> tuple[str, ...]:
    """Every metric name this job's reduced steps can carry: mindpulse's reduced metrics, their
    aliases, the recipe's evaluation metrics (when evaluation is on) and `eval.metrics`."""
    names = list(METRIC_ALIASES) + list(REDUCED_METRICS)
    if cfg.job.recipe is not None and (cfg.eval.every_steps or cfg.eval.per_epoch):
        names += RECIPE_METRICS.get(cfg.job.recipe.name, ())
    names += cfg.eval.metrics
    return tuple(dict.fromkeys(names))


