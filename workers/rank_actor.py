"""The rank as a Ray actor: one MindSpore process per placement-group bundle.

The launcher passes every `MS_*`/`RANK_*` variable through the actor's runtime_env, so
they are set before MindSpore is imported (and `PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION`
too, without which `import mindspore` fails in a Ray worker). The actor writes its
output to `logs/rank_<r>.log`, runs the recipe or the user's script, and releases the
communication group before it exits: a hard kill makes the scheduler wait ~30 s.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any


def _redirect_output(log_path: str) -> None:
    """Point fds 1 and 2 (Python and MindSpore's C++ logs) at the rank's log file."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


class RankActor:
    def __init__(self, rank: int, log_path: str):
        self.rank = rank
        self.log_path = log_path
        _redirect_output(log_path)
        logging.basicConfig(
            level=logging.INFO,
            format=f"%(asctime)s [rank {rank}] %(name)s %(levelname)s: %(message)s",
            force=True,
        )

    def info(self) -> dict[str, Any]:
        import ray

        return {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def run(self, job: Any = None) -> dict[str, Any]:
        """Run the rank's work (the same entry msrun runs); never raises. `job` is ignored:
        the rank reads its settings from the job.json its environment names."""
        from .rank_main import run_job
        from .settings import SettingsError, load_settings

        try:
            settings = load_settings()
        except SettingsError as exc:
            print(f"[rank {self.rank}] {exc}", file=sys.stderr, flush=True)
            return {"rank": self.rank, "exit_code": 2, "error": str(exc), "traceback": "", "pid": os.getpid()}
        return run_job(settings, self.rank)
