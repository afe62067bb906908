"""The rank as a Ray actor: one MindSpore process per placement-group bundle.

The launcher passes every `MS_*`/`RANK_*` variable through the actor's runtime_env, so
they are set before MindSpore is imported (and `PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION`
too, without which `import mindspore` fails in a Ray worker). The actor writes its
output to `logs/rank_<r>.log`, runs the recipe or the user's script, and releases the
communication group before it exits: a hard kill makes the scheduler wait ~30 s.

It ends with its raylet (PR_SET_PDEATHSIG): when the launcher is killed its embedded
cluster goes with it, and a rank must not train on unsupervised.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import socket
import sys
from typing import Any

from mindpulse.lifetime.processes import die_with_parent
from mindpulse.rundir.rundir_io import open_log_fd


def _redirect_output(log_path: str) -> None:
    """Point fds 1 and 2 (Python and MindSpore's C++ logs) at the rank's log file (with the
    run directory's mode, output.mode), line-buffered."""
    fd = open_log_fd(log_path)
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
        die_with_parent()  # SIGKILL when the raylet that started this Ray worker dies
        _redirect_output(log_path)
        # a rank killed by SIGSEGV/SIGBUS/SIGABRT/SIGFPE/SIGILL says so in its log (Ray does not
        # report a dead worker's signal): the failure block reads it from there
        faulthandler.enable(file=sys.stderr, all_threads=True)
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
