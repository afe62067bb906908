"""The typed run config: its sections as dataclasses, the enums they use, and every default.

YAML is only a loader (`loading.py`); these dataclasses are the contract. Each field carries
a docstring-style comment below it, which `describe_fields` turns into the README's config
reference, so a default is written once, here, and read from here everywhere else (the rules'
own defaults included: `RULE_DEFAULTS`).
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from mindpulse.config.rank_settings import periodic_due
from mindpulse.wire.protocol import Action


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
    """Training text (UTF-8; relative paths as `init_from`'s); empty uses the corpus shipped with mindpulse."""
    valid_file: str = ""
    """Validation text (relative paths as `init_from`'s); empty uses the shipped validation split."""


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
    source: str = ""
    """A MindFormers source tree (a `git clone` of MindFormers, the folder that holds
    `mindformers/__init__.py`) that every rank imports MindFormers from, ahead of any installed
    MindFormers, as run_mindformer.py users work (relative: as `config`; empty: the installed
    MindFormers). The tree must be at the same path on every node."""


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
    """Ranks scoring below this (fastest rank's median busy time, plus its noise, / theirs) are stragglers."""
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
    """grad_explosion / loss_spike: steps left out of the baseline after the start, a restore or a
    rollback, before its full `window` fills (-1: the rule's default). The straggler and
    compute_drop baselines warm up for a fixed 5 steps (and 2 after an evaluation, a checkpoint
    write or a profiler window): docs/anomalies.md."""
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



RULE_DEFAULTS: dict[RuleKind, dict[str, Any]] = {
    RuleKind.NONFINITE: {"action": Action.STOP},
    RuleKind.GRAD_EXPLOSION: {"action": Action.STOP, "factor": 20.0, "window": 20, "warmup": 5},
    RuleKind.LOSS_SPIKE: {"action": Action.WARN, "z": 6.0, "window": 20, "warmup": 5, "patience": 1},
    RuleKind.THRESHOLD: {"action": Action.WARN, "op": AnomalyRuleConfig.op, "for_steps": AnomalyRuleConfig.for_steps},
    RuleKind.CARD_OVERLOAD: {"action": Action.WARN, "metric": "temp_c", "for_s": 30.0},
    RuleKind.DESYNC: {"action": Action.STOP, "tolerance": 0.0},
    RuleKind.STRAGGLER: {"action": Action.WARN, "patience": 2},
    RuleKind.COMPUTE_DROP: {"action": Action.WARN, "factor": 0.7, "for_steps": 3, "window": 10},
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
    """Consider a new best only every N steps: rank 0 copies the weights of each such step
    and asks for the aggregator's verdict, training on meanwhile, so the best checkpoint holds
    exactly the judged weights (1: every step, paying that copy every step; eval metrics are
    judged at evaluation steps)."""
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
    require_shared: bool = False
    """Refuse the launch (exit 2) when a host of the job does not see `output.root` as the
    driver does (a folder that is not on a filesystem every host shares): rank 0 would write
    checkpoints the driver cannot read. false: a warning naming those hosts."""

    @property
    def best_at_evaluations(self) -> bool:
        """The best is judged on an evaluation's metric (`eval_*`): at every step that has one."""
        return self.best_metric.startswith("eval_")

    def periodic_due(self, step: int) -> bool:
        """Whether a periodic checkpoint is due after `step` (`mindpulse.config.rank_settings.periodic_due`)."""
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
class PrometheusConfig:
    port: int = 0
    """Serve the job's metrics for Prometheus at `http://ADDRESS:PORT/metrics` from the aggregator
    (0: off). Series and labels: docs/dashboards.md."""
    address: str = "127.0.0.1"
    """The address the endpoint listens on: loopback by default; any other address (`0.0.0.0`,
    the head's cluster address) is an explicit choice: docs/security.md."""


@dataclass
class ExportersConfig:
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)


class SwanLabMode(str, enum.Enum):
    OFFLINE = "offline"
    LOCAL = "local"
    CLOUD = "cloud"


@dataclass
class SwanLabConfig:
    enabled: bool = False
    """Log the run to SwanLab (`pip install 'mindpulse[swanlab]'`): one SwanLab run per job."""
    project: str = "mindpulse"
    """SwanLab project."""
    mode: SwanLabMode = SwanLabMode.OFFLINE
    """`offline` (files under `logdir`, nothing leaves the machine), `local` (the same, for
    `swanlab watch`) or `cloud` (sent to SwanLab's server: an explicit choice)."""
    logdir: str = ""
    """Where SwanLab writes its files (empty: `RUN_DIR/swanlab`)."""
    workspace: str = ""
    """SwanLab workspace (cloud mode; empty: the logged-in user's)."""


@dataclass
class MlflowConfig:
    enabled: bool = False
    """Log the run to MLflow (`pip install 'mindpulse[mlflow]'`): one MLflow run per job."""
    tracking_uri: str = ""
    """MLflow tracking URI (empty: a file store in `<output.root>/mlruns`, on this machine)."""
    experiment: str = "mindpulse"
    """MLflow experiment name."""


@dataclass
class SinksConfig:
    swanlab: SwanLabConfig = field(default_factory=SwanLabConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)

    @property
    def enabled(self) -> list[str]:
        """The trackers turned on, by section name (`mlflow`, `swanlab`)."""
        return [f.name for f in fields(self) if getattr(self, f.name).enabled]


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
    exporters: ExportersConfig = field(default_factory=ExportersConfig)
    sinks: SinksConfig = field(default_factory=SinksConfig)

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)



def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list):
        return [_to_plain(v) for v in value]
    return value


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

