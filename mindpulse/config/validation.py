"""Checking a config: each YAML value typed against its field, then the checks across fields.

Every check raises `ConfigError` naming the dotted path of the field it rejects, the bad
value and what is allowed, so a user can fix the YAML without reading code. Unknown keys are
errors (a typo must never be silently ignored on a 3-day run).
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import itertools
import math
import re
import typing
from pathlib import Path
from typing import Any

from mindpulse.common.errors import MindpulseError
from mindpulse.config.derived import schedule_of
from mindpulse.config.fault_specs import FaultKind, parse_fault
from mindpulse.config.metric_names import RECIPE_METRICS, known_metrics
from mindpulse.config.schema import (
    CARD_LIMITS,
    RULE_DEFAULTS,
    AnomalyRuleConfig,
    Backend,
    Device,
    MindFormersJobConfig,
    Mode,
    PreflightConfig,
    RecipeConfig,
    RuleKind,
    RunConfig,
)
from mindpulse.wire.protocol import RULE_ACTIONS, Action


class ConfigError(MindpulseError, ValueError):
    """A config problem; the message names the dotted path, the bad value and what is allowed."""


ROLLBACK_RULES = (RuleKind.LOSS_SPIKE, RuleKind.NONFINITE, RuleKind.GRAD_EXPLOSION, RuleKind.THRESHOLD)
"""The rules whose cause a rollback can undo (a bad batch, a numerical blow-up)."""


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _describe(tp: Any) -> str:
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    return str(tp)


def _coerce(path: str, tp: Any, raw: Any) -> Any:
    """Turn a YAML value into the field's type, or raise ConfigError naming `path`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if raw is None or (raw == "auto" and args in ([bool], [float])):  # auto: the field's default (None)
            return None
        return _coerce(path, args[0], raw)
    if origin is dict:
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping, got {raw!r}")
        if typing.get_args(tp)[1:] == (Any,):  # plain YAML values as they are (job.mindformers.overrides)
            bad = [k for k in raw if not isinstance(k, str)]
            if bad:
                raise ConfigError(f"{path}.{bad[0]}: keys are strings (dotted YAML keys)")
            return dict(raw)
        out = {}
        for k, v in raw.items():
            if not isinstance(k, str) or isinstance(v, (dict, list)) or v is None:
                raise ConfigError(f"{path}.{k}: {v!r} is not allowed; use a string, number or boolean")
            out[k] = str(v).lower() if isinstance(v, bool) else str(v)
        return out
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if raw is None:
            return []
        if not isinstance(raw, list):
            raise ConfigError(f"{path}: expected a list, got {raw!r}")
        return [_coerce(f"{path}[{i}]", item_tp, v) for i, v in enumerate(raw)]
    if dataclasses.is_dataclass(tp):
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path or '<top>'}: expected a mapping of fields, got {raw!r}")
        return build_dataclass(tp, raw, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        allowed = _ACTION_CHOICES.get(path.rsplit(".", 1)[0].split("[")[0]) if tp is Action else None
        try:
            value = tp(raw)
        except ValueError:
            value = None
        if value is None or (allowed is not None and value not in allowed):
            choices = ", ".join(repr(a.value) for a in allowed) if allowed else _describe(tp)
            raise ConfigError(f"{path}: {raw!r} is not allowed; use {'one of ' if allowed else ''}{choices}") from None
        return value
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        raise ConfigError(f"{path}: {raw!r} is not allowed; use true or false")
    if tp is int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ConfigError(f"{path}: {raw!r} is not allowed; use an integer")
        return raw
    if tp is float:
        if isinstance(raw, str):
            # YAML 1.1 reads `1e-4` (no dot) as a string; users mean the number
            try:
                raw = float(raw)
            except ValueError:
                pass
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ConfigError(f"{path}: {raw!r} is not allowed; use a number")
        try:
            value = float(raw)
        except OverflowError:  # an integer too large for a float
            value = math.inf
        # every float field, nested ones included (anomalies[i].threshold): .nan makes a
        # timeout fire at once, .inf makes it never fire, and neither compares as a limit
        if not math.isfinite(value):
            raise ConfigError(f"{path}: {raw!r} is not allowed; use a finite number (not NaN or infinity)")
        return value
    if tp is str:
        if raw is None:
            return ""
        if not isinstance(raw, (str, int, float)) or isinstance(raw, bool):
            raise ConfigError(f"{path}: {raw!r} is not allowed; use a string")
        return str(raw)
    raise ConfigError(f"{path}: unsupported field type {tp!r}")


def build_dataclass(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            where = f"{prefix}.{key}" if prefix else str(key)
            allowed = ", ".join(sorted(names))
            raise ConfigError(f"{where}: unknown key; allowed here: {allowed}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in raw:
            path = f"{prefix}.{f.name}" if prefix else f.name
            kwargs[f.name] = _coerce(path, hints[f.name], raw[f.name])
    return cls(**kwargs)


def _positive(path: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        need = "0 or more" if allow_zero else "more than 0"
        raise ConfigError(f"{path}: {value!r} is not allowed; use a number {need}")


_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):([0-9]{1,5})$")
"""A Ray head's address as `ray start --head` prints it: HOST:PORT ([IPv6]:PORT)."""


_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST = re.compile(rf"^({_LABEL}(\.{_LABEL})*|[0-9A-Fa-f]*:[0-9A-Fa-f:.]*)$")
"""An IP address (v4 or v6) or a host name."""


def _validate_ray_address(address: str) -> None:
    """Ray itself refuses any other form only once the launch is under way."""
    if not address or address in ("auto", "local") or address.startswith("ray://"):
        return
    m = _HOST_PORT.match(address)
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        raise ConfigError(f"ray.address: {address!r} is not allowed; use empty (an embedded one-machine cluster), "
                          "auto (the cluster this machine joined), or the head's HOST:PORT as `ray start --head` "
                          "prints it, e.g. 10.0.0.1:6379")


def _validate_exporters(cfg: RunConfig) -> None:
    prom = cfg.exporters.prometheus
    if not 0 <= prom.port <= 65535:
        raise ConfigError(f"exporters.prometheus.port: {prom.port} is not allowed; use 0 (off) or 1-65535")
    try:
        ipaddress.ip_address(prom.address)
    except ValueError:
        raise ConfigError(f"exporters.prometheus.address: {prom.address!r} is not an IP address; use one such as "
                          "127.0.0.1 (this machine only, the default) or 0.0.0.0 (every interface: "
                          "docs/security.md)") from None
    if not cfg.sinks.swanlab.project.strip():
        raise ConfigError("sinks.swanlab.project: empty; name the SwanLab project")
    if not cfg.sinks.mlflow.experiment.strip():
        raise ConfigError("sinks.mlflow.experiment: empty; name the MLflow experiment")


def validate(cfg: RunConfig) -> RunConfig:
    """Checks across fields; raises ConfigError naming the first bad field."""
    if not _NAME_RE.match(cfg.name):
        raise ConfigError(
            f"name: {cfg.name!r} is not allowed; use 1-64 letters, digits, '.', '_' or '-'"
            " starting with a letter or digit (it becomes a folder name)"
        )
    if cfg.world.devices:
        if len(cfg.world.devices) != cfg.world.ranks_per_node:
            raise ConfigError(f"world.devices: {cfg.world.devices} lists {len(cfg.world.devices)} cards; "
                              f"world.ranks_per_node is {cfg.world.ranks_per_node}: give one id per rank")
        if len(set(cfg.world.devices)) != len(cfg.world.devices) or min(cfg.world.devices) < 0:
            raise ConfigError(f"world.devices: {cfg.world.devices} is not allowed; use distinct ids >= 0")
    _validate_ray_address(cfg.ray.address)
    if cfg.msrun.master_addr and not _HOST.match(cfg.msrun.master_addr):
        raise ConfigError(f"msrun.master_addr: {cfg.msrun.master_addr!r} is not allowed; use node 0's IP address or "
                          "host name alone (no port: msrun.master_port), or empty (node 0's address as Ray sees it)")
    if not 0 <= cfg.msrun.master_port <= 65535 or 0 < cfg.msrun.master_port < 1024:
        raise ConfigError(f"msrun.master_port: {cfg.msrun.master_port} is not allowed; use 0 or 1024-65535")
    for key in cfg.env:
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            raise ConfigError(f"env.{key}: not a valid environment variable name; use letters, digits and '_'"
                              " (not starting with a digit)")
        reason = env_reserved(key)
        if reason is not None:
            raise ConfigError(f"env.{key}: not allowed: {reason}. Variables mindpulse sets or relies on cannot "
                              "be set here (see the `env` row of the README's config reference)")
    _validate_exporters(cfg)
    _positive("msrun.heartbeat_interval_s", cfg.msrun.heartbeat_interval_s, allow_zero=True)
    _positive("max_restarts", cfg.max_restarts, allow_zero=True)
    _positive("world.nodes", cfg.world.nodes)
    _positive("world.ranks_per_node", cfg.world.ranks_per_node)
    _positive("world.peak_tflops", cfg.world.peak_tflops, allow_zero=True)
    if cfg.profile.steps and (len(cfg.profile.steps) != 2 or not 1 <= cfg.profile.steps[0] <= cfg.profile.steps[1]):
        raise ConfigError(f"profile.steps: {cfg.profile.steps} is not allowed; use [START, END] with 1 <= START <= END")
    if cfg.profile.steps and 0 < cfg.train.steps < cfg.profile.steps[0]:
        # the profiler starts at that step, which this run never reaches: no profile, nothing said
        raise ConfigError(f"profile.steps: {cfg.profile.steps} starts after the run's last step "
                          f"(train.steps={cfg.train.steps}); profile steps within 1..{cfg.train.steps}")
    bad = [r for r in cfg.profile.ranks if not 0 <= r < cfg.world.world_size]
    if bad:
        raise ConfigError(f"profile.ranks: {bad} are not ranks of this job (0..{cfg.world.world_size - 1})")
    _positive("train.steps", cfg.train.steps, allow_zero=True)
    _positive("train.epochs", cfg.train.epochs)
    _positive("train.batch_size", cfg.train.batch_size)
    _positive("train.lr", cfg.train.lr)
    _positive("train.warmup_steps", cfg.train.warmup_steps, allow_zero=True)
    _positive("monitor.collect_freq", cfg.monitor.collect_freq)
    _positive("monitor.per_print_step", cfg.monitor.per_print_step)
    _positive("monitor.max_lag_steps", cfg.monitor.max_lag_steps, allow_zero=True)
    _positive("monitor.decision_timeout_s", cfg.monitor.decision_timeout_s)
    if cfg.monitor.hang_timeout_s is not None:
        _positive("monitor.hang_timeout_s", cfg.monitor.hang_timeout_s)
    _positive("monitor.exit_timeout_s", cfg.monitor.exit_timeout_s)
    _positive("monitor.startup_timeout_s", cfg.monitor.startup_timeout_s, allow_zero=True)
    _positive("monitor.telemetry_interval_s", cfg.monitor.telemetry_interval_s, allow_zero=True)
    _positive("monitor.straggler_window", cfg.monitor.straggler_window)
    _positive("monitor.group_size", cfg.monitor.group_size, allow_zero=True)
    if cfg.monitor.histogram_regex:
        try:
            re.compile(cfg.monitor.histogram_regex)
        except re.error as exc:  # rank 0 compiles it at its first weight statistics, after the start
            raise ConfigError(f"monitor.histogram_regex: {cfg.monitor.histogram_regex!r} is not a regular "
                              f"expression ({exc}); e.g. 'embedding|lm_head'") from None
    if not 0 < cfg.monitor.straggler_threshold <= 1:
        raise ConfigError(f"monitor.straggler_threshold: {cfg.monitor.straggler_threshold!r} is not allowed; "
                          "use a number in (0, 1]")
    if cfg.train.sink_size == 0 or cfg.train.sink_size < -1:
        raise ConfigError(f"train.sink_size: {cfg.train.sink_size!r} is not allowed; use -1 or more than 0")
    if not cfg.output.root:
        raise ConfigError("output.root: must not be empty")
    if cfg.backend is Backend.MSRUN:
        # the launch checks the resolved path again (a relative root sits under the cwd)
        check_shell_safe_root(cfg.output.root)
    job = cfg.job
    given = [name for name, on in (("job.recipe", job.recipe is not None), ("job.script", bool(job.script)),
                                   ("job.mindformers", job.mindformers is not None)) if on]
    if len(given) > 1:
        raise ConfigError(f"job: give one of job.recipe, job.script or job.mindformers, not {' and '.join(given)}")
    if not given:
        job.recipe = RecipeConfig()
    if job.mindformers is not None:
        _validate_mindformers(job.mindformers)
    if job.recipe is not None:
        if job.recipe.name not in RECIPES:
            raise ConfigError(
                f"job.recipe.name: {job.recipe.name!r} is not allowed; use one of "
                + ", ".join(repr(r) for r in RECIPES)
            )
        r = job.recipe
        for fname in ("seq_length", "hidden_size", "num_layers", "num_heads", "intermediate_size"):
            _positive(f"job.recipe.{fname}", getattr(r, fname))
        if r.hidden_size % r.num_heads:
            raise ConfigError(
                f"job.recipe.hidden_size: {r.hidden_size} is not divisible by job.recipe.num_heads ({r.num_heads})"
            )
        if cfg.train.mode is Mode.GRAPH and cfg.world.device is Device.CPU and cfg.world.world_size > 1:
            # seen with MindSpore 2.9 / MindFormers 1.9: every rank fails at its first step after
            # about a minute of compiling; one CPU rank, or any Ascend world, compiles
            raise ConfigError(
                f"train.mode: 'graph' is not supported for the {r.name} recipe in data parallel on CPU "
                f"({cfg.world.world_size} ranks): MindSpore 2.9 fails to compile its train step there "
                "('Input[0] must be a Primitive ValueNode'); use train.mode=pynative, or one rank"
            )
    _validate_eval_metrics(cfg)
    known = known_metrics(cfg)
    for i, rc in enumerate(cfg.anomalies):
        _validate_rule(f"anomalies[{i}]", rc, known, cfg)
    for i, spec in enumerate(cfg.faults):
        try:
            parse_fault(spec, world_size=cfg.world.world_size)
        except ValueError as exc:
            raise ConfigError(f"faults[{i}]: {exc}") from None
    ck = cfg.checkpoint
    _positive("checkpoint.save_checkpoint_steps", ck.save_checkpoint_steps, allow_zero=True)
    _positive("checkpoint.keep_checkpoint_max", ck.keep_checkpoint_max)
    _positive("checkpoint.keep_best_max", ck.keep_best_max)
    _positive("checkpoint.best_every_steps", ck.best_every_steps)
    _positive("checkpoint.save_grace_s", ck.save_grace_s, allow_zero=True)
    if not math.isfinite(ck.save_grace_s):
        raise ConfigError(f"checkpoint.save_grace_s: {ck.save_grace_s!r} is not allowed; use a number of seconds")
    if ck.on_save_error not in ("continue", "stop"):
        raise ConfigError(f"checkpoint.on_save_error: {ck.on_save_error!r} is not allowed; use 'continue' or 'stop'")
    if not ck.best_metric:
        raise ConfigError("checkpoint.best_metric: must not be empty; e.g. loss or eval_loss")
    if ck.best_at_evaluations and not (cfg.eval.every_steps or cfg.eval.per_epoch):
        raise ConfigError(f"checkpoint.best_metric: {ck.best_metric!r} needs evaluation; set eval.every_steps")
    _check_metric("checkpoint.best_metric", ck.best_metric, known, cfg)
    _check_slow_saves(cfg)
    _positive("eval.every_steps", cfg.eval.every_steps, allow_zero=True)
    _positive("eval.max_batches", cfg.eval.max_batches, allow_zero=True)
    _positive("output.max_file_size", cfg.output.max_file_size, allow_zero=True)
    if 0 < cfg.output.max_file_size < 1 << 20:
        raise ConfigError(f"output.max_file_size: {cfg.output.max_file_size} is too small; use 0 (one file) or at "
                          "least 1048576 (1 MiB: a segment must hold more than a few steps)")
    if job.args and not job.script:
        raise ConfigError("job.args: only allowed together with job.script")
    _validate_preflight(cfg.preflight)
    return cfg


def _validate_mindformers(mf: MindFormersJobConfig) -> None:
    """What can be checked without the YAML (the launch reads it: mindpulse.config.mindformers_yaml)."""
    from mindpulse.config.mindformers_yaml import RUN_MODES, MindFormersConfigError, split_key

    if not mf.config:
        raise ConfigError("job.mindformers.config: must not be empty; give the MindFormers YAML to train")
    if mf.run_mode not in RUN_MODES:
        raise ConfigError(f"job.mindformers.run_mode: {mf.run_mode!r} is not allowed; use one of "
                          + ", ".join(repr(m) for m in RUN_MODES))
    for key in mf.overrides:
        try:
            split_key(key)
        except MindFormersConfigError as exc:
            raise ConfigError(f"job.mindformers.overrides: {exc}") from None


def check_mindformers_source(path: str) -> None:
    """`job.mindformers.source` (resolved by the launch): a folder holding the `mindformers`
    package, as a MindFormers clone does; ConfigError naming the key otherwise."""
    p = Path(path)
    what = f"job.mindformers.source: {path!r}"
    if not p.exists():
        raise ConfigError(f"{what} does not exist; give the folder of a MindFormers source tree (the one that "
                          "holds mindformers/__init__.py), or leave it empty to use the installed MindFormers")
    if not p.is_dir():
        raise ConfigError(f"{what} is not a folder; give the folder of a MindFormers source tree (the one that "
                          "holds mindformers/__init__.py)")
    if not (p / "mindformers" / "__init__.py").is_file():
        hint = (f"; it is the package itself: give its parent folder {str(p.parent)!r}"
                if (p / "__init__.py").is_file() and p.name == "mindformers" else
                "; give the folder of a MindFormers source tree (a clone of MindFormers holds it)")
        raise ConfigError(f"{what} is not a MindFormers source tree: it has no mindformers/__init__.py{hint}")


def _check_slow_saves(cfg: RunConfig) -> None:
    """`slow_save@0:S` delays rank 0's checkpoint write of step S. Refused where no
    periodic or best checkpoint can be written at S (as the aggregator decides them:
    `_save_decision`), since the rehearsal it was meant for would silently not happen; not
    checked where a `last` checkpoint may come at any step (a save_and_stop rule) or where
    the steps that may save are not known before the run (train.steps 0, evaluations at
    epoch ends judging the best)."""
    ck, total, every_eval = cfg.checkpoint, cfg.train.steps, cfg.eval.every_steps
    eval_best = ck.best_at_evaluations
    save_and_stop = any(getattr(rc.action, "value", rc.action) == Action.SAVE_AND_STOP.value for rc in cfg.anomalies)
    if not total or (ck.save_last and save_and_stop) or (eval_best and cfg.eval.per_epoch):
        return

    sched = schedule_of(cfg)

    def may_save(step: int) -> bool:
        if not 1 <= step <= total:
            return False
        # an evaluation metric is judged where an evaluation reports it: eval.every_steps
        # (epoch-end evaluations are not known before the run: not checked, above)
        return sched.is_save_step(step) or (ck.best_due(step) and (not eval_best or sched.eval_due(step)))

    for i, spec in enumerate(cfg.faults):
        f = parse_fault(spec)
        if f.kind is not FaultKind.SLOW_SAVE or may_save(f.step):
            continue
        steps = list(itertools.islice((s for s in range(1, total + 1) if may_save(s)), 7))
        kinds = [f"periodic checkpoints every checkpoint.save_checkpoint_steps={ck.save_checkpoint_steps}"
                 if ck.save_checkpoint_steps else "",
                 ("best checkpoints at evaluations (eval.every_steps=" + str(every_eval) + ")" if eval_best else
                  f"best checkpoints judged every checkpoint.best_every_steps={ck.best_every_steps}")
                 if ck.save_best_ckpt else ""]
        where = (f"steps {', '.join(map(str, steps[:6]))}{', ...' if len(steps) > 6 else ''} "
                 f"({'; '.join(k for k in kinds if k)})") if steps else \
            "no step (periodic and best checkpoints are off)"
        raise ConfigError(
            f"faults[{i}]: {spec!r}: rank 0 writes no checkpoint at step {f.step} of this {total}-step run, so the "
            f"fault would never act; it may write one at {where}. Pick one of those steps or change those settings")


_ACTION_CHOICES = {"preflight": (Action.STOP, Action.WARN), "anomalies": RULE_ACTIONS}
"""The one `Action` enum, narrowed per section: what a config may ask for there."""


def _validate_preflight(pf: PreflightConfig) -> None:
    if not 0 < pf.min_ratio <= 1:
        raise ConfigError(f"preflight.min_ratio: {pf.min_ratio!r} is not allowed; use a number in (0, 1]")
    if not 0 < pf.refuse_ratio <= pf.min_ratio:
        raise ConfigError(f"preflight.refuse_ratio: {pf.refuse_ratio!r} is not allowed; use a number in "
                          f"(0, preflight.min_ratio = {pf.min_ratio:g}]")
    if pf.matmul_size < 0 or pf.matmul_size > 16384:
        raise ConfigError(f"preflight.matmul_size: {pf.matmul_size} is not allowed; use 0 (by device) or 1-16384")
    _positive("preflight.matmul_seconds", pf.matmul_seconds)
    if not 0 < pf.allreduce_mb <= 1024:
        raise ConfigError(f"preflight.allreduce_mb: {pf.allreduce_mb!r} is not allowed; use a number in (0, 1024]")
    _positive("preflight.allreduce_iters", pf.allreduce_iters)
    _positive("preflight.timeout_s", pf.timeout_s)


RECIPES = ("llama_finetune",)
_OPS = (">", ">=", "<", "<=")
_CARD_METRICS = tuple(CARD_LIMITS)
"""card_overload's metrics: those it has a default limit for (or None)."""


def _check_metric(path: str, name: str, known: tuple[str, ...], cfg: RunConfig) -> None:
    """A typo here would pass silently: the rule never fires, no best checkpoint is saved."""
    if name in known:
        return
    recipe = cfg.job.recipe
    if recipe is not None and name in RECIPE_METRICS.get(recipe.name, ()):
        raise ConfigError(f"{path}: {name!r} is reported by the {recipe.name} recipe only when evaluation "
                          "is on; set eval.every_steps or eval.per_epoch")
    raise ConfigError(f"{path}: {name!r} is not a metric this job reports; use one of " + ", ".join(known)
                      + " (a job.script declares its own evaluation or extra metrics in eval.metrics)")


def _validate_eval_metrics(cfg: RunConfig) -> None:
    seen: set[str] = set()
    recipe = cfg.job.recipe
    for i, name in enumerate(cfg.eval.metrics):
        path = f"eval.metrics[{i}]"
        if not name or len(name) > 64 or name != name.strip():
            raise ConfigError(f"{path}: {name!r} is not allowed; use a metric name of 1-64 characters without "
                              "surrounding spaces, as the job reports it")
        if name in seen:
            raise ConfigError(f"{path}: {name!r} is listed twice; list each metric once")
        seen.add(name)
        if recipe is not None and name not in RECIPE_METRICS.get(recipe.name, ()):
            reports = ", ".join(RECIPE_METRICS.get(recipe.name, ())) or "no extra metrics"
            raise ConfigError(f"{path}: {name!r} is not reported by the {recipe.name} recipe (it reports "
                              f"{reports} when evaluation is on); eval.metrics declares a job.script's metrics")


ENV_RESERVED: dict[str, str] = {
    "MS_ROLE": "mindpulse starts every rank as MindSpore's MS_WORKER and the scheduler as MS_SCHED",
    "MS_SCHED_HOST": "mindpulse points every rank at the MindSpore scheduler; use msrun.master_addr",
    "MS_SCHED_PORT": "mindpulse points every rank at the MindSpore scheduler; use msrun.master_port",
    "MS_WORKER_NUM": "mindpulse sets the number of ranks; use world.nodes and world.ranks_per_node",
    "MS_NODE_ID": "mindpulse (or msrun) sets each rank's id in MindSpore's cluster; use world.nodes and "
                  "world.ranks_per_node",
    "MS_TOPO_TIMEOUT": "mindpulse sets it from msrun.cluster_time_out (msrun from its --cluster_time_out); "
                       "use msrun.cluster_time_out",
    "MS_RETRY_INTERVAL_LOWER": "mindpulse sets the ranks' heartbeat interval; use msrun.heartbeat_interval_s",
    "MS_RETRY_INTERVAL_UPPER": "mindpulse sets the ranks' heartbeat interval; use msrun.heartbeat_interval_s",
    "DEVICE_ID": "mindpulse sets it to each rank's local rank (its index among the visible cards); use "
                 "world.devices to choose the cards",
    "ASCEND_RT_VISIBLE_DEVICES": "mindpulse sets the node's visible cards from world.devices; use world.devices",
    "CUDA_VISIBLE_DEVICES": "mindpulse sets the node's visible cards from world.devices; use world.devices",
    "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "mindpulse sets it to `python`, without which ranks started "
                                              "by Ray cannot import MindSpore; it has no config key",
    "GLOG_v": "mindpulse gives every rank the GLOG_v of the shell that runs it (default 2), which would "
              "silently replace this value; set GLOG_v in that shell",
    "LOG_MF_PATH": "mindpulse writes MindFormers' logs into the run directory (logs/mindformers) unless the "
                   "shell that runs it sets LOG_MF_PATH; set it in that shell",
}
"""Variables mindpulse sets for ranks (or relies on), refused in `env:` with the key to use instead."""
ENV_RESERVED_PREFIXES: dict[str, str] = {
    "RANK_": "mindpulse (or msrun) sets RANK_ID and RANK_SIZE for every rank and starts them through "
             "MindSpore's scheduler, not a RANK_TABLE_FILE; use world.nodes and world.ranks_per_node",
    "MINDPULSE_": "mindpulse's own variables (MINDPULSE_SETTINGS, MINDPULSE_NODE_RANK) tell each rank its "
                  "run settings; they have no config key",
    "RAY_EXPERIMENTAL_NOSET_": "mindpulse tells Ray not to set device visibility itself so that one device "
                               "policy holds for both backends; use world.devices",
}
"""Prefixes of variables mindpulse sets for ranks (or relies on), refused in `env:`."""


def env_reserved(key: str) -> str | None:
    """Why `key` cannot be set in `env:` (mindpulse sets or relies on it), or None."""
    if key in ENV_RESERVED:
        return ENV_RESERVED[key]
    for prefix, reason in ENV_RESERVED_PREFIXES.items():
        if key.startswith(prefix):
            return reason
    return None


_SHELL_SAFE = re.compile(r"[\w./+,:@%=~-]")
"""Characters a POSIX shell takes literally inside a word of an absolute path (`~` only
expands at a word's start, and an absolute path starts with `/`)."""


def check_shell_safe_root(path: str, resolved: str | None = None) -> None:
    """msrun interpolates its log folder, under the run directory, unquoted into a shell
    command (`os.system(f"cat {log_dir}/scheduler.log | grep ...")` when a rank fails): with the
    msrun backend the output root may hold no character a shell would interpret."""
    text = path if resolved is None else resolved
    bad = sorted({c for c in text if not _SHELL_SAFE.fullmatch(c)})
    if bad:
        where = repr(path) if resolved is None else f"{path!r} (resolved: {resolved!r})"
        raise ConfigError(f"output.root: {where} holds {''.join(bad)!r}, which the shell command msrun runs on "
                          "the run's log folder would interpret; with the msrun backend use a folder whose "
                          "path has only letters, digits and . _ - / + , : @ % = ~")


def _validate_rule(path: str, rc: AnomalyRuleConfig, known: tuple[str, ...] | None = None,
                   cfg: RunConfig | None = None) -> None:
    if rc.action is not None and rc.action not in RULE_ACTIONS:
        raise ConfigError(f"{path}.action: {rc.action.value!r} is not allowed; use one of "
                          + ", ".join(a.value for a in RULE_ACTIONS))
    if rc.action is Action.ROLLBACK and rc.rule not in ROLLBACK_RULES:
        raise ConfigError(f"{path}.action: rollback is for " + ", ".join(k.value for k in ROLLBACK_RULES)
                          + f" rules, not {rc.rule.value}; use stop, save_and_stop or warn")
    if not 0 < rc.lr_factor <= 1:
        raise ConfigError(f"{path}.lr_factor: {rc.lr_factor} is not allowed; use a factor in (0, 1]")
    if rc.lr_steps < 0 or rc.max_rollbacks < 0:
        bad = "lr_steps" if rc.lr_steps < 0 else "max_rollbacks"
        raise ConfigError(f"{path}.{bad}: {getattr(rc, bad)} is not allowed; use 0 or more")
    if rc.op not in _OPS:
        raise ConfigError(f"{path}.op: {rc.op!r} is not allowed; use one of " + ", ".join(_OPS))
    if rc.for_steps < 1:
        raise ConfigError(f"{path}.for_steps: {rc.for_steps} is not allowed; use 1 or more")
    for fname in ("factor", "z", "tolerance"):
        if getattr(rc, fname) < 0:
            raise ConfigError(f"{path}.{fname}: {getattr(rc, fname)} is not allowed; use 0 or more")
    if rc.window < 0:
        raise ConfigError(f"{path}.window: {rc.window} is not allowed; use 0 (default) or more")
    if rc.rule is RuleKind.COMPUTE_DROP and not rc.factor <= 0.95:
        raise ConfigError(f"{path}.factor: {rc.factor} is not allowed for compute_drop; use a factor in (0, 0.95] "
                          f"(0: the default {RULE_DEFAULTS[RuleKind.COMPUTE_DROP]['factor']:g})")
    if rc.rule is RuleKind.THRESHOLD and rc.enabled:
        if not rc.metric:
            raise ConfigError(f"{path}.metric: a threshold rule needs a reduced metric, e.g. loss or grad_norm")
        if rc.threshold is None:
            raise ConfigError(f"{path}.threshold: a threshold rule needs a number")
    if rc.rule is RuleKind.THRESHOLD and rc.metric and known is not None and cfg is not None:
        _check_metric(f"{path}.metric", rc.metric, known, cfg)
    if rc.rule is RuleKind.CARD_OVERLOAD and rc.metric and rc.metric not in _CARD_METRICS:
        raise ConfigError(f"{path}.metric: {rc.metric!r} is not allowed for card_overload; use one of "
                          + ", ".join(_CARD_METRICS))


def check_rule(raw: Any, cfg: RunConfig | None, path: str) -> AnomalyRuleConfig:
    """One `anomalies` entry typed and checked exactly as a config's are, errors naming
    `path.FIELD` (`mindpulse rules` changes rules of a running job with it); `cfg`: the run's
    config, for the metrics a threshold rule may name (None: not checked)."""
    rc = _coerce(path, AnomalyRuleConfig, raw)
    _validate_rule(path, rc, known_metrics(cfg) if cfg is not None else None, cfg)
    return rc

