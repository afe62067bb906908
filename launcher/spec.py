"""Blueprint → instance → outcome, as separate types (after torch elastic).

`RankSpec` is what a rank will be (node, rank, device, environment, command) and is
computed without starting anything; `RankOutcome` is what happened to it; `RunResult`
is the whole run's outcome with failures keyed by global rank.
"""

from __future__ import annotations

import enum
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from mindpulse.config import Device, RunConfig, monitor_settings_of, schedule_of
from mindpulse.config.rank_settings import (
    NODE_RANK_ENV,
    SETTINGS_ENV,
    CheckpointSettings,
    ProfileSettings,
    RankSettings,
    ResumePoint,
)
from mindpulse.config.settings import AggregatorSettings, BestSeed, NodeSettings, compute_drop_window


class RunStatus(str, enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    ANOMALY_STOP = "anomaly_stop"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    PREFLIGHT_FAILED = "preflight_failed"
    """The pre-flight card check found a slow or failed card; nothing trained."""

    def is_terminal(self) -> bool:
        return self is not RunStatus.RUNNING


class ExitCode(enum.IntEnum):
    SUCCESS = 0
    FAILED = 1
    USAGE = 2
    ANOMALY = 3
    PREFLIGHT = 4
    """The pre-flight card check refused the launch (a slow or failed card)."""
    INTERRUPTED = 130

    @staticmethod
    def of(status: RunStatus) -> ExitCode:
        return {
            RunStatus.SUCCEEDED: ExitCode.SUCCESS,
            RunStatus.ANOMALY_STOP: ExitCode.ANOMALY,
            RunStatus.INTERRUPTED: ExitCode.INTERRUPTED,
            RunStatus.PREFLIGHT_FAILED: ExitCode.PREFLIGHT,
        }.get(status, ExitCode.FAILED)


@dataclass
class RankSpec:
    node: int
    rank: int
    local_rank: int
    device_id: int
    env: dict[str, str]
    command: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "rank": self.rank, "local_rank": self.local_rank, "device_id": self.device_id,
                "env": dict(sorted(self.env.items())), "command": list(self.command)}


@dataclass
class RankOutcome:
    rank: int
    exit_code: int | None = None
    error: str = ""
    traceback: str = ""
    pid: int | None = None
    host: str | None = None


@dataclass
class RunResult:
    status: RunStatus
    outcomes: dict[int, RankOutcome] = field(default_factory=dict)
    message: str = ""
    order: list[int] = field(default_factory=list)
    """Ranks in the order their failure was seen: the first is the root cause."""
    hang: list[int] = field(default_factory=list)
    """Ranks that stopped making progress (a hang), if that ended the run."""
    lost: list[dict[str, Any]] = field(default_factory=list)
    """Nodes lost or cut off (launcher/node_health.py), if that ended the run: {node, host,
    address, node_id, ranks, kind, how}."""

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.of(self.status)

    @property
    def failures(self) -> dict[int, RankOutcome]:
        return {r: o for r, o in self.outcomes.items() if o.exit_code not in (0, None) or o.error}


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOW_PORTS = 20000
"""Where a port picked outside the kernel's ephemeral range starts (above most services)."""


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open(EPHEMERAL_RANGE_FILE) as fh:
            lo, hi = (int(x) for x in fh.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1", outside_ephemeral: bool = False) -> int:
    """A port nothing listens on now. `outside_ephemeral`: one below the kernel's ephemeral
    range, which no socket bound to port 0 can draw meanwhile (the scheduler's port is
    picked seconds before the scheduler binds it, while the node agents' servers start);
    any free port where that range leaves no room."""
    if outside_ephemeral:
        import random

        lo, _ = _ephemeral_range()
        if lo - LOW_PORTS >= 1000:
            for port in random.sample(range(LOW_PORTS, lo), 64):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    try:
                        s.bind((host, port))
                    except OSError:
                        continue
                    return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


RUN_DIR = "${RUN_DIR}"
"""Placeholder for the run directory in plans made before a run exists."""
MASTER_ADDR = "${MASTER_ADDR}"
"""Placeholder for the scheduler's host when only the running cluster can tell it (node 0's address)."""
MASTER_PORT = "${MASTER_PORT}"
"""Placeholder for the scheduler's port when the config leaves it free (picked at launch)."""
RANK_MAIN_MODULE = "mindpulse.workers.rank_main"
SCHEDULER_MODULE = "mindpulse.workers.scheduler"
GLOG_DEFAULT = "2"
"""MindSpore's C++ log level for ranks unless the launching shell sets GLOG_v (2: warnings)."""
MF_LOG_ENV = "LOG_MF_PATH"
"""MindFormers' log folder (it adds rank_N/ with info.log and error.log): the attempt's
logs/mindformers unless the launching shell sets it. Unset, it is ./output/log in the
rank's working directory: the user's, shared by every run started there, and outside the
run directory that holds the rest of the run's logs."""


def node_devices(cfg: RunConfig) -> list[int]:
    """Physical card ids of a node, in local-rank order."""
    return list(cfg.world.devices) or list(range(cfg.world.ranks_per_node))


def settings_path_of(run_dir: str) -> str:
    """Where a run's `RankSettings` live: the one path every rank is given."""
    return f"{run_dir}/job.json"


def msrun_command(cfg: RunConfig, node: int, master_addr: str, master_port: str, *, logs_dir: str,
                  settings_path: str) -> list[str]:
    """The msrun line a MindSpore user would type on `node` (MindSpore's msrun docs)."""
    w = cfg.world
    cmd = [
        "msrun",
        f"--worker_num={w.world_size}",
        f"--local_worker_num={w.ranks_per_node}",
        f"--master_addr={master_addr}",
        f"--master_port={master_port}",
        f"--node_rank={node}",
        f"--log_dir={logs_dir}",
        "--join=True",
        f"--cluster_time_out={cfg.msrun.cluster_time_out}",
        "--worker_log_name=rank",
    ]
    if cfg.msrun.bind_core:
        cmd.append("--bind_core=True")
    # msrun runs `python <args>` as given when the task is `python` (the PATH's python:
    # the node agent puts the driver's interpreter first on PATH)
    return cmd + ["python", "-m", RANK_MAIN_MODULE, "--job", settings_path]


def sched_endpoint(cfg: RunConfig, sched_host: str | None, sched_port: int | None) -> tuple[str, str]:
    """The MindSpore scheduler's host and port as ranks are told them: the values the launch
    picked, else the config's, else placeholders for what only the running cluster knows."""
    host = sched_host or cfg.msrun.master_addr or ("127.0.0.1" if cfg.world.nodes == 1 else MASTER_ADDR)
    port_num = sched_port if sched_port is not None else cfg.msrun.master_port
    return host, (str(port_num) if port_num else MASTER_PORT)


FAST_HEARTBEAT_MAX_RANKS = 128
"""Up to this many ranks `msrun.heartbeat_interval_s: 0` means a 1 s heartbeat. A rank
learns that MindSpore's cluster is built only from a heartbeat's answer; at MindSpore's
default (a random 3-5 s) the first rank to register waited 3-5 s for a cluster that was
complete (measured: the last rank learned it 4.9 s after the scheduler with the default,
0.7 s with 1 s). A 1 s heartbeat costs the scheduler one small message per rank and second."""


def heartbeat_env(cfg: RunConfig) -> dict[str, str]:
    """MS_RETRY_INTERVAL_LOWER/_UPPER for `msrun.heartbeat_interval_s` (empty: MindSpore's
    default, for a large world with the setting at 0)."""
    interval = cfg.msrun.heartbeat_interval_s
    if not interval:
        if cfg.world.world_size > FAST_HEARTBEAT_MAX_RANKS:
            return {}
        interval = 1
    return {"MS_RETRY_INTERVAL_LOWER": str(interval), "MS_RETRY_INTERVAL_UPPER": str(interval)}


def rank_specs(cfg: RunConfig, *, run_dir: str = RUN_DIR, logs_dir: str | None = None,
               settings_path: str | None = None, sched_host: str | None = None,
               sched_port: int | None = None) -> list[RankSpec]:
    """Every rank's node, devices, environment and command, computed without starting anything.

    This is the one place a rank's environment is made: `mindpulse plan` prints these specs
    (placeholders for what only a running launch knows) and a launch starts exactly them.
    `logs_dir` is the attempt's log folder (default RUN_DIR/logs); `settings_path` the
    run's job.json (default RUN_DIR/job.json).

    Device visibility (one policy for both backends): every rank of a node sees the node's
    cards (`world.devices`, default 0..ranks_per_node-1) through ASCEND_RT_VISIBLE_DEVICES
    (CUDA_VISIBLE_DEVICES on GPUs) and picks its own with DEVICE_ID = its local rank, as
    msrun does. Ray is told not to set the visibility variable itself. Telemetry maps a
    rank to physical card `world.devices[local_rank]`.
    """
    from mindpulse.config import Backend

    w = cfg.world
    world = w.world_size
    devices = node_devices(cfg)
    logs_dir = logs_dir or f"{run_dir}/logs"
    settings_path = settings_path or settings_path_of(run_dir)
    host, port = sched_endpoint(cfg, sched_host, sched_port)
    # read from the launching shell, as MindSpore users set it; the plan shows the value a
    # launch from the same shell would pass
    glog = os.environ.get("GLOG_v", GLOG_DEFAULT)
    # the attempt's own folder unless the launching shell names one (env: may not)
    mf_logs = os.environ.get(MF_LOG_ENV) or f"{logs_dir}/mindformers"
    specs = []
    for node in range(w.nodes):
        for local in range(w.ranks_per_node):
            rank = node * w.ranks_per_node + local
            env = {
                "MS_ROLE": "MS_WORKER",
                "MS_SCHED_HOST": host,
                "MS_SCHED_PORT": port,
                "MS_WORKER_NUM": str(world),
                "MS_NODE_ID": str(rank),
                "MS_TOPO_TIMEOUT": str(cfg.msrun.cluster_time_out),
                "RANK_ID": str(rank),
                "RANK_SIZE": str(world),
                "DEVICE_ID": str(local),
                **heartbeat_env(cfg),
            }
            if w.device is Device.ASCEND:
                env["ASCEND_RT_VISIBLE_DEVICES"] = ",".join(map(str, devices))
                if cfg.backend is Backend.RAY:
                    env["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"] = "1"
            elif w.device is Device.GPU:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
                if cfg.backend is Backend.RAY:
                    env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
            env.update(cfg.env)
            # after the user's `env:` (config validation refuses MINDPULSE_* there; a GLOG_v
            # there has always lost to the launching shell's)
            env[SETTINGS_ENV] = settings_path
            env["GLOG_v"] = glog
            env[MF_LOG_ENV] = mf_logs
            if cfg.backend is Backend.MSRUN:
                # msrun also starts the scheduler from rank_main on every "master" node: it
                # runs only where this is 0
                env[NODE_RANK_ENV] = str(node)
                command = msrun_command(cfg, node, host, port, logs_dir=logs_dir, settings_path=settings_path)
            else:
                command = ["python", "-m", RANK_MAIN_MODULE, "--job", settings_path]
            specs.append(RankSpec(node=node, rank=rank, local_rank=local, device_id=devices[local], env=env,
                                  command=command))
    return specs


def scheduler_env(cfg: RunConfig, *, run_dir: str = RUN_DIR, settings_path: str | None = None,
                  sched_host: str | None = None, sched_port: int | None = None) -> dict[str, str]:
    """Ray backend: the variables of MindSpore's scheduler process, which node 0's agent
    starts (`python -m mindpulse.workers.scheduler`). msrun starts its own."""
    host, port = sched_endpoint(cfg, sched_host, sched_port)
    env = dict(cfg.env)
    env.update({"MS_ROLE": "MS_SCHED", "MS_SCHED_HOST": host, "MS_SCHED_PORT": port,
                "MS_WORKER_NUM": str(cfg.world.world_size),
                # the scheduler reads its device target from the run's settings
                SETTINGS_ENV: settings_path or settings_path_of(run_dir)})
    return env


def rank_settings(cfg: RunConfig, *, run_dir: str, run_id: str, attempt: int, aggregator: str,
                  ray_address: str, relays: dict[int, str], resume: dict[str, Any] | None,
                  relay_token: str = "", task: str = "train") -> RankSettings:
    """The launcher → rank contract for one attempt (written to RUN_DIR/job.json); `task`
    `card_check` makes the ranks run the pre-flight card check only."""
    return RankSettings(
        run_id=run_id,
        run_dir=run_dir,
        attempt=attempt,
        namespace=cfg.ray.namespace,
        aggregator=aggregator,
        ray_address=ray_address,
        world_size=cfg.world.world_size,
        ranks_per_node=cfg.world.ranks_per_node,
        device_target=cfg.world.device.device_target,
        relays=dict(relays),
        batch_size=cfg.train.batch_size,
        schedule=schedule_of(cfg),
        monitor=monitor_settings_of(cfg),
        checkpoint=CheckpointSettings(keep_periodic=cfg.checkpoint.keep_checkpoint_max,
                                      keep_best=cfg.checkpoint.keep_best_max, format=cfg.checkpoint.format.value),
        profile=ProfileSettings(steps=tuple(cfg.profile.steps), ranks=tuple(cfg.profile.ranks)),
        # faults are a rehearsal of the first attempt: a restart runs clean
        faults=tuple(cfg.faults) if attempt == 0 else (),
        resume=ResumePoint(path=resume["path"], step=int(resume["step"]), epoch=int(resume.get("epoch") or 0),
                           kind=str(resume.get("kind") or ""), skip_batches=int(resume.get("skip_batches") or 0),
                           lr_factor=float(resume.get("lr_factor") or 1.0),
                           lr_until_step=int(resume.get("lr_until_step") or 0)) if resume else None,
        config=cfg.to_dict(),
        relay_token=relay_token,
        task=task,
    )


def aggregator_settings(cfg: RunConfig, *, attempt: int = 0, start_step: int = 0,
                        rollbacks: dict[str, int] | None = None, goodput: dict[str, Any] | None = None,
                        config_yaml: str = "", best: dict[str, Any] | None = None,
                        peak_dtype: str = "") -> AggregatorSettings:
    """The launcher → aggregator contract for one attempt. `start_step`: the step the attempt
    resumes after; `rollbacks`: each rule's rollbacks in this launch; `goodput`: the launch's
    start and the earlier attempts' productive seconds ({started, productive_s}); `best`: the
    manifest's best checkpoint (launcher/resume.py `best_seed`); `peak_dtype`: MFU's dtype."""
    goodput = goodput or {}
    return AggregatorSettings(
        config=cfg, tensorboard=cfg.output.tensorboard, start_step=start_step, attempt=attempt,
        rollbacks=dict(rollbacks or {}), launch_started=float(goodput.get("started") or 0.0),
        productive_before_s=float(goodput.get("productive_s") or 0.0), peak_dtype=peak_dtype,
        config_yaml=config_yaml, best=BestSeed.of(best))


def node_settings(cfg: RunConfig, node: int, *, relay_token: str = "",
                  driver: dict[str, Any] | None = None) -> NodeSettings:
    """The launcher → node agent contract: node `node` of one attempt. `driver`: the
    launcher's process identity (the agent's watchdog ends the node's processes once it is gone)."""
    w = cfg.world
    devices = node_devices(cfg)
    return NodeSettings(
        node=node, device=w.device.value,
        rank_devices={node * w.ranks_per_node + i: devices[i] for i in range(w.ranks_per_node)},
        world_size=w.world_size, telemetry_interval_s=cfg.monitor.telemetry_interval_s,
        straggler_window=cfg.monitor.straggler_window,
        collect_freq=cfg.monitor.collect_freq,
        # the compute_drop rule's window: the node keeps each rank's TFLOPS median
        compute_window=compute_drop_window(cfg.anomalies), relay_token=relay_token, driver=dict(driver or {}))
