"""Typed run configuration: YAML is only a loader, these dataclasses are the contract.

Every field carries a docstring-style comment; every check names the dotted path of the
field it rejects and what is allowed, so a user can fix the YAML without reading code.
Unknown keys are errors (a typo must never be silently ignored on a 3-day run).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mindpulse.metrics import FIXED_REDUCED, aliases, reduced_fields
from mindpulse.protocol import RULE_ACTIONS, Action, FaultKind, MonitorSettings, Schedule, parse_fault, periodic_due


class ConfigError(ValueError):
    """A config problem; the message names the dotted path, the bad value and what is allowed."""


class Backend(str, enum.Enum):
    RAY = "ray"
    MSRUN = "msrun"


class Device(str, enum.Enum):
    CPU = "cpu"
    ASCEND = "ascend"
    GPU = "gpu"

    @property
    def device_target(self) -> str:
        """MindSpore's `device_target` name for this device."""
        return {"cpu": "CPU", "ascend": "Ascend", "gpu": "GPU"}[self.value]


class Mode(str, enum.Enum):
    PYNATIVE = "pynative"
    GRAPH = "graph"


@dataclass
class RayConfig:
    address: str = ""
    """Ray cluster address: empty starts an embedded local cluster on 127.0.0.1;
    `auto` or `HOST:PORT` joins an existing cluster."""
    namespace: str = "mindpulse"
    """Ray namespace for the run's named actors."""
    allow_no_auth: bool = False
    """Let an embedded cluster start without Ray's token authentication (when the
    environment turns it off, e.g. RAY_AUTH_MODE=disabled); without this it refuses to."""


@dataclass
class WorldConfig:
    nodes: int = 1
    """Number of machines (Ray nodes) taking part."""
    ranks_per_node: int = 2
    """Ranks (MindSpore processes, one per card) per node."""
    device: Device = Device.CPU
    """`cpu`, `ascend` or `gpu`: MindSpore's device_target for the ranks."""
    devices: list[int] = field(default_factory=list)
    """Physical card ids each node uses, in local-rank order (empty: 0 .. ranks_per_node-1).
    They become ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES; DEVICE_ID is the local rank."""
    peak_tflops: float = 0.0
    """Peak TFLOPS of one card that MFU is measured against (0: the pre-flight check's measured
    matmul figure when it ran, else the known-card table by the card's name, else no MFU)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass
class RecipeConfig:
    name: str = "llama_finetune"
    """Built-in recipe to run (`llama_finetune`)."""
    init_from: str = ""
    """Base checkpoint to start from (relative paths are resolved against the config
    file's folder, then the project); empty trains from random weights."""
    seq_length: int = 64
    """Tokens per sample (byte-level tokens)."""
    hidden_size: int = 64
    """Model width."""
    num_layers: int = 2
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads."""
    intermediate_size: int = 128
    """Feed-forward width."""
    train_file: str = ""
    """Training text (UTF-8); empty uses the corpus shipped with mindpulse."""
    valid_file: str = ""
    """Validation text; empty uses the shipped validation split."""


@dataclass
class MsrunConfig:
    master_port: int = 0
    """--master_port / MS_SCHED_PORT: the MindSpore scheduler's port on node 0 (msrun's
    default is 8118); 0 picks a free port at launch."""
    cluster_time_out: int = 600
    """msrun --cluster_time_out: seconds the ranks wait for each other to join."""
    bind_core: bool = False
    """msrun --bind_core: pin each rank to CPU cores near its card."""
    master_addr: str = ""
    """Node 0's address for the other nodes (empty: node 0's IP as Ray sees it; 127.0.0.1
    on one machine)."""
    heartbeat_interval_s: int = 0
    """Seconds between a rank's heartbeats to MindSpore's scheduler (MS_RETRY_INTERVAL_LOWER
    and _UPPER). A rank learns that the cluster is built only from a heartbeat's answer, so
    this is most of the wait before training starts. 0: 1 s up to 128 ranks, MindSpore's
    own default above (a random 3-5 s, which spreads the scheduler's load)."""


@dataclass
class MindFormersJobConfig:
    config: str = ""
    """A MindFormers YAML (`run_mode`, `model`, `runner_config`, `optimizer`, `lr_schedule`,
    `train_dataset`, `callbacks`, ...) that every rank trains with MindFormers' own Trainer, as
    run_mindformer.py does (relative paths: against the config file's folder, then the working
    directory, then the project; relative paths inside the YAML: against its own folder)."""
    run_mode: str = "finetune"
    """`train` or `finetune` (replaces the YAML's run_mode)."""
    load_checkpoint: str = ""
    """The checkpoint to start from instead of the YAML's `load_checkpoint` (empty: the YAML's)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Values merged into the YAML by dotted key, e.g. `{model.model_config.num_layers: 1}`; each key
    must exist in the YAML. mindpulse itself sets the device target, `use_parallel`,
    `parallel_config.data_parallel` (the world size), `output_dir` and the step cap (`train.steps`)."""


@dataclass
class JobConfig:
    recipe: RecipeConfig | None = None
    """A built-in recipe and its options (give either `recipe` or `script`; with
    neither, the built-in `llama_finetune` recipe runs)."""
    script: str = ""
    """A user training script run in every rank, as it is (no mindpulse import needed: see `job.auto_monitor`)."""
    args: list[str] = field(default_factory=list)
    """Command-line arguments passed to `script`."""
    mindformers: MindFormersJobConfig | None = None
    """A MindFormers fine-tune from its own YAML (give one of `recipe`, `script`, `mindformers`)."""
    auto_monitor: bool = True
    """`script` only: add mindpulse's Monitor to `Model.train`/`Model.fit` calls that have none,
    and take the gradient statistics around the train cell `Model` builds or is given (no edit
    needed; a Monitor the script adds itself is never doubled). false: neither is added (a rank
    that trains without a Monitor is still named at once, shared callback directories still
    warned of, and on CPU a loss-scale cell still gets its CPU overflow check)."""


@dataclass
class TrainConfig:
    steps: int = 0
    """Stop after this many optimizer steps in all (0: run all epochs)."""
    epochs: int = 1
    """Passes over each rank's shard of the data."""
    batch_size: int = 8
    """Samples per rank per step (MindSpore's per-device batch size)."""
    lr: float = 1e-3
    """Peak learning rate."""
    warmup_steps: int = 0
    """Linear warm-up steps before the cosine decay (0: constant rate)."""
    seed: int = 1234
    """`mindspore.set_seed` in every rank; equal seeds give equal initial weights."""
    mode: Mode = Mode.PYNATIVE
    """MindSpore execution mode: `pynative` or `graph`."""
    dataset_sink_mode: bool = False
    """MindSpore's dataset sinking (callbacks then run once per sink, not per step)."""
    sink_size: int = -1
    """Steps per sink when `dataset_sink_mode` is on (-1: a whole epoch)."""


@dataclass
class MonitorConfig:
    collect_freq: int = 10
    """Every N steps each rank also sends a parameter fingerprint (and step 0)."""
    per_print_step: int = 10
    """Every N steps the driver prints the cluster table."""
    max_lag_steps: int = 1
    """How far a rank may run ahead of the aggregator: it starts step k once step
    k-1-max_lag_steps is reduced, so no rank waits while the aggregator keeps up, and a
    stop decided at step S ends every rank after step S+max_lag_steps (0: lockstep)."""
    decision_timeout_s: float = 120.0
    """How long a rank waits for a directive before it goes on without one."""
    hang_timeout_s: float | None = None
    """Seconds without a new step before the job is declared hung; `auto` (the default, also
    empty or null): the larger of 60 s and 20 x the rolling p99 step time of the slowest rank, once
    10 steps are reduced (300 s before that; on CPU ranks at most 25 s, or 2x the step time where
    steps are longer: MindSpore's CPU collectives give up on a peer after 30 s); time a rank's
    heartbeat reports as saving a checkpoint or evaluating does not count, and start-up has
    `startup_timeout_s`."""
    exit_timeout_s: float = 60.0
    """Seconds a rank's process may live on after its training ended (its Monitor's end, or its
    script's end): past them it is named, its stacks dumped into logs/, and it is ended; the run's
    status still says the training completed."""
    startup_timeout_s: float = 0.0
    """Seconds a rank may take from the start to its first finished step (start-up, the
    first graph compile, the first collective's connection) before the job is declared
    hung; the hang clock starts after that step (0: msrun.cluster_time_out)."""
    straggler_threshold: float = 0.7
    """Ranks scoring below this (fastest rank's effective step time / theirs) are stragglers."""
    straggler_window: int = 10
    """Steps in the rolling window of the straggler score."""
    weight_stats: bool = True
    """Every collect_freq steps rank 0 ships per-layer weight norms, update ratios and
    histograms (TensorBoard `weights/`, `grads/`), and the model's structure once."""
    histogram_regex: str = ""
    """Layers whose weight (and, in PYNATIVE, gradient) histograms are shipped (empty: the
    embedding, the output head and the first attention query projection)."""
    telemetry_interval_s: float = 5.0
    """Each node's agent samples its cards (npu-smi/DCMI, NVML or psutil) this often (0: off)."""
    group_size: int = 0
    """Node agents per group: a group's first agent (its leader) merges its members' step
    partials and passes the lease down to them, so the aggregator takes one frame per group
    and step (0: groups of 64 once the job has more than 64 nodes; 1: never group)."""

    def groups_of(self, nodes: int) -> int:
        """The nodes per group this job uses (1: no groups)."""
        if self.group_size:
            return min(self.group_size, max(nodes, 1))
        return AUTO_GROUP_SIZE if nodes > AUTO_GROUP_SIZE else 1


AUTO_GROUP_SIZE = 64
"""One Ray actor drains ~1,900 calls/s on a 2-core machine: 64-node groups keep a
4,096-node job at 2 steps/s to ~128 aggregator calls a second (docs/architecture.md)."""


class RuleKind(str, enum.Enum):
    NONFINITE = "nonfinite"
    GRAD_EXPLOSION = "grad_explosion"
    LOSS_SPIKE = "loss_spike"
    CARD_OVERLOAD = "card_overload"
    THRESHOLD = "threshold"
    DESYNC = "desync"
    STRAGGLER = "straggler"
    COMPUTE_DROP = "compute_drop"


RuleAction = Action
"""A rule's action is the one `Action` enum of the protocol (warn, stop or save_and_stop)."""


@dataclass
class AnomalyRuleConfig:
    """One anomaly rule. Entries whose `rule` names a built-in default replace that
    default; `threshold` rules are always added. Fields a rule does not use are ignored."""

    rule: RuleKind = RuleKind.THRESHOLD
    """Which test: nonfinite, grad_explosion, loss_spike, card_overload, threshold, desync, straggler,
    compute_drop."""
    action: RuleAction | None = None
    """warn, stop, save_and_stop or rollback (empty: the rule's default)."""
    enabled: bool = True
    """false turns a default rule off."""
    name: str = ""
    """Label used in messages and anomalies.json (default: the rule kind)."""
    metric: str = ""
    """threshold: reduced metric (loss, loss_max, grad_norm, grad_norm_local_max, step_time_max,
    samples_per_s, tokens_per_s, mfu, tflops, the recipe's eval_loss and eval_ppl when evaluation
    is on, or a metric declared in eval.metrics; any other name is refused); card_overload:
    temp_c, memory_pct or power_w."""
    op: str = ">"
    """threshold: comparison, one of >, >=, <, <=."""
    threshold: float | None = None
    """threshold / card_overload: the limit; grad_explosion: absolute grad-norm limit."""
    for_steps: int = 1
    """threshold / compute_drop: fire only after this many consecutive steps past the limit."""
    factor: float = 0.0
    """grad_explosion: fire when the global grad norm exceeds factor x its rolling median;
    compute_drop: when a rank's achieved TFLOPS (its MFU) fall below factor x its own rolling median
    (at most 0.95)."""
    z: float = 0.0
    """loss_spike: robust z-score limit ((loss - median) / (1.4826 MAD))."""
    window: int = 0
    """grad_explosion / loss_spike / straggler / compute_drop: rolling window in steps (compute_drop's
    is fixed at launch: the nodes keep it)."""
    warmup: int = -1
    """grad_explosion / loss_spike: steps before the rule may fire (-1: the rule's default)."""
    patience: int = 0
    """loss_spike: consecutive hits needed (0: the rule's default)."""
    for_s: float = -1.0
    """card_overload: seconds the card must stay past the limit (-1: the rule's default)."""
    tolerance: float = 0.0
    """desync: relative tolerance on parameter norms (0: fingerprints must be bit-equal)."""
    skip_batches: bool = True
    """rollback: skip the data batches from the checkpoint resumed to the anomaly step."""
    lr_factor: float = 0.5
    """rollback: the learning rate is multiplied by this after the rollback..."""
    lr_steps: int = 100
    """rollback: ...for this many steps."""
    max_rollbacks: int = 2
    """rollback: rollbacks this rule may make in one launch; past them it stops the job as `stop` does."""


ROLLBACK_RULES = (RuleKind.LOSS_SPIKE, RuleKind.NONFINITE, RuleKind.GRAD_EXPLOSION, RuleKind.THRESHOLD)
"""The rules whose cause a rollback can undo (a bad batch, a numerical blow-up)."""

RULE_DEFAULTS: dict[RuleKind, dict[str, Any]] = {
    RuleKind.NONFINITE: {"action": Action.STOP},
    RuleKind.GRAD_EXPLOSION: {"action": Action.STOP, "factor": 20.0, "window": 50, "warmup": 5},
    RuleKind.LOSS_SPIKE: {"action": Action.WARN, "z": 6.0, "window": 50, "warmup": 10, "patience": 1},
    RuleKind.THRESHOLD: {"action": Action.WARN, "op": ">", "for_steps": 1},
    RuleKind.CARD_OVERLOAD: {"action": Action.WARN, "metric": "temp_c", "for_s": 30.0},
    RuleKind.DESYNC: {"action": Action.STOP, "tolerance": 0.0},
    RuleKind.STRAGGLER: {"action": Action.WARN, "patience": 2},
    RuleKind.COMPUTE_DROP: {"action": Action.WARN, "factor": 0.7, "for_steps": 3, "window": 20},
}
"""Each rule's real defaults, filling the fields an entry leaves at their placeholder
(None, 0, -1 or empty); the straggler threshold comes from `monitor.straggler_threshold`."""
CARD_LIMITS: dict[str, float | None] = {"temp_c": 95.0, "memory_pct": 98.0, "power_w": None}
"""card_overload's default limit per metric (power has none: it depends on the card)."""
DEFAULT_RULES = (RuleKind.NONFINITE, RuleKind.GRAD_EXPLOSION, RuleKind.LOSS_SPIKE, RuleKind.CARD_OVERLOAD,
                 RuleKind.DESYNC, RuleKind.STRAGGLER, RuleKind.COMPUTE_DROP)
"""On unless turned off with `{rule: NAME, enabled: false}`."""


def resolve_rule(raw: dict[str, Any], straggler_threshold: float | None = None) -> dict[str, Any]:
    """A rule entry (plain dict, as the aggregator receives it) with every placeholder
    replaced by the rule's default; idempotent. Unknown kinds (extra rules) pass through."""
    out = dict(raw)
    try:
        kind = RuleKind(out.get("rule"))
    except ValueError:
        return out
    for key, value in RULE_DEFAULTS[kind].items():
        cur = out.get(key)
        if cur is None or cur == "" or (key in ("warmup", "for_s") and cur < 0) or (
                key not in ("warmup", "for_s", "tolerance") and cur == 0):
            out[key] = value.value if isinstance(value, enum.Enum) else value
    if kind is RuleKind.CARD_OVERLOAD and out.get("threshold") is None:
        out["threshold"] = CARD_LIMITS.get(out["metric"])
    if kind is RuleKind.STRAGGLER and out.get("threshold") is None:
        out["threshold"] = MonitorConfig.straggler_threshold if straggler_threshold is None else straggler_threshold
    return out


@dataclass
class EvalConfig:
    every_steps: int = 0
    """Evaluate every N steps on each rank's shard of the validation split (0: off)."""
    per_epoch: bool = False
    """Also evaluate at the end of every epoch."""
    max_batches: int = 16
    """Validation batches per rank per evaluation (0: the whole shard)."""
    metrics: list[str] = field(default_factory=list)
    """Metric names the job's evaluation or extra scalars report, e.g. eval_acc (a job.script's
    own, which it also passes to `Monitor(metrics=[...])`; the recipe's eval_loss and eval_ppl
    need no entry). `anomalies[].metric` and `checkpoint.best_metric` may name only these and
    mindpulse's reduced metrics."""


class CkptFormat(str, enum.Enum):
    CKPT = "ckpt"
    SAFETENSORS = "safetensors"


class BestMode(str, enum.Enum):
    MIN = "min"
    MAX = "max"


@dataclass
class CheckpointConfig:
    save_checkpoint_steps: int = 0
    """Periodic checkpoint every N steps, written by rank 0 (0: none)."""
    keep_checkpoint_max: int = 5
    """Periodic checkpoints kept (the newest is never deleted)."""
    save_best_ckpt: bool = True
    """Keep the checkpoint of the step whose reduced `best_metric` was best."""
    best_metric: str = "loss"
    """Reduced metric that judges "best": loss (mean over ranks), eval_loss, eval_ppl (recipe, with
    evaluation on), a metric declared in eval.metrics, ... (any other name is refused)."""
    best_mode: BestMode = BestMode.MIN
    """min or max."""
    best_every_steps: int = 10
    """Consider a new best only every N steps: rank 0 waits for the aggregator's verdict
    after each such step, so the best checkpoint holds exactly the judged weights (1:
    every step, paying that wait every step; eval metrics are judged at evaluation steps)."""
    keep_best_max: int = 1
    """Best checkpoints kept."""
    format: CkptFormat = CkptFormat.CKPT
    """ckpt or safetensors."""
    on_save_error: str = "continue"
    """When rank 0 cannot write a checkpoint (disk full, read-only): `continue` (the error is
    reported, the previous best and the manifest stay valid) or `stop` every rank."""
    save_last: bool = True
    """Save a `last` checkpoint when the run is interrupted or stopped by save_and_stop."""
    save_grace_s: float = 120.0
    """When a rank fails while rank 0 is writing a checkpoint, seconds the launcher lets the
    write finish before it stops the other ranks (0: stop at once). With msrun, msrun itself
    kills the failed rank's node within a second: the grace holds for rank 0 on another node."""

    @property
    def best_at_evaluations(self) -> bool:
        """The best is judged on an evaluation's metric (`eval_*`): at every step that has one."""
        return self.best_metric.startswith("eval_")

    def periodic_due(self, step: int) -> bool:
        """Whether a periodic checkpoint is due after `step` (`mindpulse.protocol.periodic_due`)."""
        return periodic_due(step, self.save_checkpoint_steps)

    def best_due(self, step: int) -> bool:
        """Whether a new best may be judged after `step`: every `best_every_steps` steps,
        or, for an evaluation metric, at any step (it is judged where an evaluation
        reported it). The one rule for the aggregator's verdict and the launch checks."""
        if not (self.save_best_ckpt and step > 0):
            return False
        return self.best_at_evaluations or step % self.best_every_steps == 0


@dataclass
class ProfileConfig:
    steps: list[int] = field(default_factory=list)
    """[START, END]: run MindSpore's Profiler from step START to step END (empty: off)."""
    ranks: list[int] = field(default_factory=lambda: [0])
    """Ranks that profile; output under RUN_DIR/profile/rank_<r>/ (linked from the report)."""


class FileMode(str, enum.Enum):
    PRIVATE = "private"
    SHARED = "shared"


@dataclass
class OutputConfig:
    root: str = "runs"
    """Folder holding the run directories (`<root>/<name>-<YYYYmmdd-HHMMSS>/`); with the msrun
    backend its resolved path may hold no shell metacharacter (msrun puts it in a shell command)."""
    tensorboard: bool = True
    """Write TensorBoard event files under `RUN_DIR/tb/` (the aggregator is the one writer)."""
    report: bool = True
    """Write `RUN_DIR/report/` (PNG plots and report.html) at the end of the run."""
    mode: FileMode = FileMode.PRIVATE
    """Permissions of what the run directory holds: `private` (files 0600, folders 0700:
    config.yaml, job.json and plan.json carry `env:` values) or `shared` (0644 / 0755)."""
    max_file_size: int = 256 * 1024 * 1024
    """Bytes a metrics segment may reach (SummaryCollector's name): `metrics.msgpack` is then
    closed as `metrics.000001.msgpack`, ... and a new one begun; the per-rank detail of all but
    the newest segments is thinned (docs/run_directory.md). 0: one file, never thinned."""


@dataclass
class PreflightConfig:
    enabled: bool | None = None
    """Run the pre-flight card check at the start of `launch`: true, false, or `auto` / empty
    (true when world.nodes > 1). `mindpulse preflight` runs it whatever this says."""
    action: Action = Action.WARN
    """What a slow card does to `launch`: `warn` (the default) reports a card below `min_ratio` x
    the median and trains, and refuses the launch (status preflight_failed, exit code 4) only for
    a card below `refuse_ratio` x the median or one that failed; `stop` refuses it for any slow or
    failed card (a shared or busy host can then refuse a healthy job)."""
    min_ratio: float = 0.8
    """A rank whose matmul GFLOP/s or all-reduce GB/s is below this x the median over ranks is slow."""
    refuse_ratio: float = 0.5
    """A rank below this x the median (or one that failed: crashed, hung, computed a wrong result)
    refuses the launch whatever `action` says; between this and `min_ratio` it is reported."""
    matmul_size: int = 0
    """Side of the float32 square matrices each rank multiplies (0: 512 on CPU, 4096 on Ascend and GPU)."""
    matmul_seconds: float = 2.0
    """Seconds each rank times its matmuls, after a warm-up."""
    allreduce_mb: float = 4.0
    """Size of the all-reduced float32 buffer in MiB."""
    allreduce_iters: int = 10
    """Timed all-reduces of that buffer, after a warm-up (every rank runs the same number)."""
    timeout_s: float = 600.0
    """Seconds the whole check may take, start-up included; ranks without a result by then failed."""


@dataclass
class RunConfig:
    name: str = "run"
    """Run name: letters, digits, `.`, `_`, `-` (it becomes a folder name)."""
    backend: Backend = Backend.RAY
    """How ranks are started: `ray` (a rank actor per card) or `msrun` (one msrun per
    node, run by its node agent)."""
    ray: RayConfig = field(default_factory=RayConfig)
    msrun: MsrunConfig = field(default_factory=MsrunConfig)
    world: WorldConfig = field(default_factory=WorldConfig)
    job: JobConfig = field(default_factory=JobConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    anomalies: list[AnomalyRuleConfig] = field(default_factory=list)
    """Anomaly rules added to (or replacing) the defaults; see docs/anomalies.md."""
    max_restarts: int = 0
    """After a failure, relaunch every rank from the newest valid checkpoint, up to N times
    (injected faults fire in the first attempt only; each attempt's logs go to
    `logs/attempt_<k>/`)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every rank (e.g. HCCL_CONNECT_TIMEOUT, LD_PRELOAD); variables
    mindpulse sets or relies on (MS_ROLE, MS_SCHED_*, RANK_*, DEVICE_ID, *_VISIBLE_DEVICES,
    GLOG_v, ...: the README lists them) are refused, naming the config key to use instead."""
    faults: list[str] = field(default_factory=list)
    """Faults to inject, `KIND@RANK:STEP` (`slow_card@RANK` for the pre-flight card check; see
    docs/faults.md); --inject adds more."""
    output: OutputConfig = field(default_factory=OutputConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list):
        return [_to_plain(v) for v in value]
    return value


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
        return _build(tp, raw, path)
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


def _build(cls: type, raw: dict[str, Any], prefix: str) -> Any:
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
    _positive("msrun.heartbeat_interval_s", cfg.msrun.heartbeat_interval_s, allow_zero=True)
    _positive("max_restarts", cfg.max_restarts, allow_zero=True)
    _positive("world.nodes", cfg.world.nodes)
    _positive("world.ranks_per_node", cfg.world.ranks_per_node)
    _positive("world.peak_tflops", cfg.world.peak_tflops, allow_zero=True)
    if cfg.profile.steps and (len(cfg.profile.steps) != 2 or not 1 <= cfg.profile.steps[0] <= cfg.profile.steps[1]):
        raise ConfigError(f"profile.steps: {cfg.profile.steps} is not allowed; use [START, END] with 1 <= START <= END")
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
    """What can be checked without the YAML (the launch reads it: mindpulse.mindformers_yaml)."""
    from mindpulse.mindformers_yaml import RUN_MODES, MindFormersConfigError, split_key

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


AUTO_HANG_MIN_S = 60.0
"""`monitor.hang_timeout_s: auto`: never below this (published detectors name a stuck rank in 15-30 s;
HCCL's own timeout is 1,800 s)."""
AUTO_HANG_STEPS = 10
"""... from this many reduced steps on: 20 x their p99 step time (before: AUTO_HANG_EARLY_S)."""
AUTO_HANG_FACTOR = 20.0
AUTO_HANG_EARLY_S = 300.0
CPU_AUTO_HANG_S = 25.0
"""`auto` on CPU ranks: MindSpore's CPU collectives give up on a peer after 30 s (a ring
all-reduce's receive, measured with MindSpore 2.9; MS_RECEIVE_MSG_TIMEOUT does not change it),
so a stuck rank would surface as a collective error of the ranks waiting for it, named as the
root cause. The hang is named before that, unless the steps themselves are longer: then 2x the
slowest rank's step time (p99, or the longest so far before 10 steps), never less than a step."""


def auto_hang_timeout(step_times: list[float], device: str = "") -> float:
    """The hang limit `auto` gives after these reduced steps' step times (the slowest rank's,
    newest last): max(60 s, 20 x their p99) from 10 steps on, 300 s before; on CPU ranks at
    most 25 s (CPU_AUTO_HANG_S)."""
    times = sorted(t for t in step_times if t is not None and math.isfinite(t) and t >= 0)
    p99 = times[max(0, math.ceil(0.99 * len(times)) - 1)] if len(times) >= AUTO_HANG_STEPS else None
    limit = AUTO_HANG_EARLY_S if p99 is None else max(AUTO_HANG_MIN_S, AUTO_HANG_FACTOR * p99)
    if device != Device.CPU.value:
        return limit
    step = p99 if p99 is not None else (times[-1] if times else 0.0)
    return min(limit, max(CPU_AUTO_HANG_S, 2 * step))


RECIPES = ("llama_finetune",)
_OPS = (">", ">=", "<", "<=")
_CARD_METRICS = ("temp_c", "memory_pct", "power_w")

REDUCED_METRICS = ("step", *reduced_fields(), *FIXED_REDUCED)
"""The numeric fields of the aggregator's `ReducedStep`, which rules and the best checkpoint can
name: from the metric registry (mindpulse/metrics.py); tests/unit/test_config.py checks them
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
                          "(0: the default 0.7)")
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


def sections_of(raw: dict[str, Any]) -> RunConfig:
    """A config from some of its sections (the aggregator receives `monitor`, `checkpoint`,
    `eval`, `anomalies` as plain dicts): every field not given takes its one default here.
    Fields are type-checked; cross-field checks are the launcher's (it validated the run)."""
    keep = {f.name for f in dataclasses.fields(RunConfig)}
    return _build(RunConfig, {k: v for k, v in raw.items() if k in keep}, "")


REMOVED_KEYS = {
    ("monitor", "decision_every"): (
        "monitor.decision_every: removed; ranks no longer wait for the aggregator every N steps. "
        "They run up to monitor.max_lag_steps steps ahead of it (default 1) and every rank still stops "
        "after the same step. Delete the key, or set monitor.max_lag_steps (0: wait for every step)."),
}
"""Keys of earlier versions, with what replaces them (an unknown-key error would not say)."""


def from_dict(raw: Any, source: str = "<config>") -> RunConfig:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(raw).__name__}")
    for (section, key), message in REMOVED_KEYS.items():
        if isinstance(raw.get(section), dict) and key in raw[section]:
            raise ConfigError(message)
    return validate(_build(RunConfig, raw, ""))


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` → (['a','b','c'], YAML-parsed value)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: use --set dotted.key=value")
    key, _, value = item.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {item!r}: the key must be a dotted path such as train.steps")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return key.split("."), parsed


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    keys = {parse_override(item)[0][:2] == ["job", "recipe"] for item in overrides}
    for item in overrides:
        parts, value = parse_override(item)
        # the command line's choice of job wins over the file's: --set job.script=x.py
        # replaces the file's recipe (unless job.recipe is set on the command line too)
        if parts == ["job", "script"] and value and isinstance(raw.get("job"), dict) and True not in keys:
            raw["job"].pop("recipe", None)
            raw["job"].pop("mindformers", None)
        if parts[:2] == ["job", "mindformers"] and value and isinstance(raw.get("job"), dict) and True not in keys:
            raw["job"].pop("recipe", None)
            if parts == ["job", "mindformers", "config"]:
                raw["job"].pop("script", None)
        node = raw
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = {}
                node[part] = nxt
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = nxt
        node[parts[-1]] = value
    return raw


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    return raw


def load_config(path: Path | None, overrides: list[str] | None = None) -> tuple[RunConfig, Path | None]:
    """Load, override and validate. Returns the config and the resolved file path."""
    if path is None:
        path = default_config_path()
    path = Path(path).resolve()
    raw = read_yaml(path)
    raw = apply_overrides(raw, list(overrides or []))
    return from_dict(raw, str(path)), path


def default_config_path() -> Path:
    """`cluster_configs/local_cpu.yaml` of the project (shipped inside the package too)."""
    here = Path(__file__).resolve().parent
    # the project's folder (a checkout, an editable install), then the installed package's copy
    for candidate in (here.parent / "cluster_configs" / "local_cpu.yaml", here / "cluster_configs" / "local_cpu.yaml"):
        if candidate.exists():
            return candidate
    raise ConfigError("no config file given and cluster_configs/local_cpu.yaml is missing")


def describe_fields() -> list[tuple[str, str, str]]:
    """(dotted path, default, doc) for the README's config reference."""
    import ast
    import inspect

    rows: list[tuple[str, str, str]] = []

    def docs_of(cls: type) -> dict[str, str]:
        src = inspect.getsource(cls)
        tree = ast.parse(src)
        out: dict[str, str] = {}
        body = tree.body[0].body  # type: ignore[attr-defined]
        for a, b in zip(body, body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                out[a.target.id] = " ".join(str(b.value.value).split())  # type: ignore[union-attr]
        return out

    def walk(cls: type, prefix: str) -> None:
        docs = docs_of(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            path = f"{prefix}{f.name}"
            tp = hints[f.name]
            args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
            inner = args[0]
            if dataclasses.is_dataclass(inner):
                walk(inner, path + ".")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            rows.append((path, repr(_to_plain(default)), docs.get(f.name, "")))

    walk(RunConfig, "")
    return rows


def schedule_of(cfg: RunConfig) -> Schedule:
    """The run's special steps, computed once here and shipped to every rank."""
    return Schedule(
        total_steps=cfg.train.steps,
        collect_freq=cfg.monitor.collect_freq,
        max_lag_steps=cfg.monitor.max_lag_steps,
        save_best=cfg.checkpoint.save_best_ckpt,
        save_every=cfg.checkpoint.save_checkpoint_steps,
        best_every=cfg.checkpoint.best_every_steps,
        eval_every=cfg.eval.every_steps,
        eval_per_epoch=cfg.eval.per_epoch,
    )


def monitor_settings_of(cfg: RunConfig) -> MonitorSettings:
    """What a rank's monitor needs of `monitor.*`."""
    m = cfg.monitor
    return MonitorSettings(
        decision_timeout_s=m.decision_timeout_s,
        # a few beats per hang timeout, never slower than every 5 s
        heartbeat_s=max(0.5, min(5.0, (m.hang_timeout_s or AUTO_HANG_MIN_S) / 4)),
        weight_stats=m.weight_stats,
        histogram_regex=m.histogram_regex,
    )
