"""Blueprint → instance → outcome, as separate types (after torch elastic).

`RankSpec` is what a rank will be (node, rank, device, environment, command) and is
computed without starting anything; `RankOutcome` is what happened to it; `RunResult`
is the whole run's outcome with failures keyed by global rank.
"""

from __future__ import annotations

import enum
import socket
import sys
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

from .config import Device, RunConfig


class RunStatus(str, enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    ANOMALY_STOP = "anomaly_stop"
    FAILED = "failed"
    INTERRUPTED = "interrupted"

    def is_terminal(self) -> bool:
        return self is not RunStatus.RUNNING


class ExitCode(enum.IntEnum):
    SUCCESS = 0
    FAILED = 1
    USAGE = 2
    ANOMALY = 3
    INTERRUPTED = 130

    @staticmethod
    def of(status: RunStatus) -> "ExitCode":
        return {
            RunStatus.SUCCEEDED: ExitCode.SUCCESS,
            RunStatus.ANOMALY_STOP: ExitCode.ANOMALY,
            RunStatus.INTERRUPTED: ExitCode.INTERRUPTED,
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

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.of(self.status)

    @property
    def failures(self) -> dict[int, RankOutcome]:
        return {r: o for r, o in self.outcomes.items() if o.exit_code not in (0, None) or o.error}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


RUN_DIR = "${RUN_DIR}"
"""Placeholder for the run directory in plans made before a run exists."""
RANK_MAIN_MODULE = "mindpulse.workers.rank_main"


def node_devices(cfg: RunConfig) -> list[int]:
    """Physical card ids of a node, in local-rank order."""
    return list(cfg.world.devices) or list(range(cfg.world.ranks_per_node))


def msrun_command(cfg: RunConfig, node: int, master_addr: str, master_port: str, run_dir: str) -> list[str]:
    """The msrun line a MindSpore user would type on `node` (MindSpore's msrun docs)."""
    w = cfg.world
    cmd = [
        "msrun",
        f"--worker_num={w.world_size}",
        f"--local_worker_num={w.ranks_per_node}",
        f"--master_addr={master_addr}",
        f"--master_port={master_port}",
        f"--node_rank={node}",
        f"--log_dir={run_dir}/logs",
        "--join=True",
        f"--cluster_time_out={cfg.msrun.cluster_time_out}",
        "--worker_log_name=rank",
    ]
    if cfg.msrun.bind_core:
        cmd.append("--bind_core=True")
    # msrun runs `python <args>` as given when the task is `python` (the PATH's python:
    # the node agent puts the driver's interpreter first on PATH)
    return cmd + ["python", "-m", RANK_MAIN_MODULE, "--job", f"{run_dir}/job.json"]


def rank_specs(cfg: RunConfig, sched_host: str | None = None, sched_port: int | None = None,
               run_env: dict[str, str] | None = None, run_dir: str = RUN_DIR) -> list[RankSpec]:
    """Every rank's node, devices, environment and command, computed without starting anything.

    Device visibility (one policy for both backends): every rank of a node sees the node's
    cards (`world.devices`, default 0..ranks_per_node-1) through ASCEND_RT_VISIBLE_DEVICES
    (CUDA_VISIBLE_DEVICES on GPUs) and picks its own with DEVICE_ID = its local rank, as
    msrun does. Ray is told not to set the visibility variable itself. Telemetry maps a
    rank to physical card `world.devices[local_rank]`.
    """
    from .config import Backend

    w = cfg.world
    world = w.world_size
    devices = node_devices(cfg)
    single = w.nodes == 1
    host = sched_host or cfg.msrun.master_addr or ("127.0.0.1" if single else "${MASTER_ADDR}")
    port_num = sched_port if sched_port is not None else cfg.msrun.master_port
    port = str(port_num) if port_num else "${MASTER_PORT}"
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
            env.update(run_env or {})
            if cfg.backend is Backend.MSRUN:
                command = msrun_command(cfg, node, host, port, run_dir)
            else:
                command = ["python", "-m", RANK_MAIN_MODULE, "--job", f"{run_dir}/job.json"]
            specs.append(RankSpec(node=node, rank=rank, local_rank=local, device_id=devices[local], env=env,
                                  command=command))
    return specs
