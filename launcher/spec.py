"""Blueprint → instance → outcome, as separate types (after torch elastic).

`RankSpec` is what a rank will be (node, rank, device, environment, command) and is
computed without starting anything; `RankOutcome` is what happened to it; `RunResult`
is the whole run's outcome with failures keyed by global rank.
"""

from __future__ import annotations

import enum
import socket
import sys
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


def rank_specs(cfg: RunConfig, sched_host: str, sched_port: int, run_env: dict[str, str]) -> list[RankSpec]:
    """Every rank's environment, set before MindSpore is imported in that rank."""
    specs = []
    world = cfg.world.world_size
    for node in range(cfg.world.nodes):
        for local in range(cfg.world.ranks_per_node):
            rank = node * cfg.world.ranks_per_node + local
            device_id = local
            env = {
                "MS_ROLE": "MS_WORKER",
                "MS_SCHED_HOST": sched_host,
                "MS_SCHED_PORT": str(sched_port),
                "MS_WORKER_NUM": str(world),
                "MS_NODE_ID": str(rank),
                "RANK_ID": str(rank),
                "RANK_SIZE": str(world),
                "DEVICE_ID": str(device_id),
                "LOCAL_RANK": str(local),
            }
            if cfg.world.device is Device.ASCEND:
                env["ASCEND_RT_VISIBLE_DEVICES"] = str(device_id)
            elif cfg.world.device is Device.GPU:
                env["CUDA_VISIBLE_DEVICES"] = str(device_id)
            env.update(run_env)
            command = [sys.executable, "-m", "mindpulse.workers.rank_main"] if cfg.job.script == "" else [
                sys.executable, cfg.job.script, *cfg.job.args]
            specs.append(RankSpec(node=node, rank=rank, local_rank=local, device_id=device_id, env=env,
                                  command=command))
    return specs
