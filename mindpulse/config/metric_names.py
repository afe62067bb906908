"""The metric names a config may give (`anomalies[].metric`, `checkpoint.best_metric`):
mindpulse's reduced metrics and their aliases, each recipe's evaluation metrics, and the
job's own declared in `eval.metrics`. One place, so that where these names come from can
change without touching the checks that use them (`validation.py`).
"""

from __future__ import annotations

from mindpulse.config.schema import RunConfig

REDUCED_METRICS = (
    "step", "epoch", "world_size", "loss_mean", "loss_min", "loss_min_rank", "loss_max", "loss_max_rank",
    "loss_std", "grad_norm", "grad_norm_local_max", "grad_norm_local_max_rank", "step_time_min",
    "step_time_min_rank", "step_time_max", "step_time_max_rank", "samples_per_s", "lr", "nan_count", "inf_count",
    "ts", "monitor_wait_max", "monitor_wait_sum", "ranks_reported", "data_wait_max", "checkpoint_s_max", "eval_s_max",
    "profile_s_max",
    "monitor_errors", "tokens", "tokens_per_s", "tflops_mean", "tflops_min", "tflops_min_rank", "tflops_max",
    "tflops_max_rank", "peak_tflops", "mfu_mean", "mfu_min", "mfu_min_rank", "mfu_max", "mfu_max_rank",
    "loss_scale_min", "loss_scale_min_rank", "loss_scale_max", "loss_scale_max_rank", "overflow_ranks",
    "overflow_steps",
)
"""The numeric fields of the aggregator's `ReducedStep`, which rules and the best checkpoint can
name. Listed here because config sits below the aggregator (it must not import it);
tests/unit/test_config.py fails when this drifts from `ReducedStep`."""
METRIC_ALIASES = ("loss", "grad_norm_global", "throughput", "mfu", "tflops", "loss_scale", "overflow")
"""`ReducedStep.metric`'s other names: loss_mean, grad_norm, samples_per_s, mfu_mean, tflops_mean,
loss_scale_min and overflow_ranks."""
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


