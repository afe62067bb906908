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
import runpy
import socket
import sys
import time
import traceback
from typing import Any

from .errors import StopTraining


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

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        """Run the rank's work; returns exit code, error text and traceback (never raises)."""
        t0 = time.time()
        code, error, tb = 0, "", ""
        print(f"[rank {self.rank}] pid {os.getpid()} starting", flush=True)
        try:
            if job["job"].get("script"):
                script = job["job"]["script"]
                sys.argv = [script] + list(job["job"].get("args") or [])
                sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
                runpy.run_path(script, run_name="__main__")
            else:
                from mindpulse.workers.recipes import llama_finetune

                llama_finetune.main(job)
        except StopTraining as exc:
            print(f"[rank {self.rank}] stopped before the next step: {exc}", flush=True)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if code:
                error = f"SystemExit({exc.code!r})"
        except BaseException as exc:  # report everything; the launcher decides
            code, error, tb = 1, f"{type(exc).__name__}: {exc}", traceback.format_exc()
            print(tb, file=sys.stderr, flush=True)
        finally:
            self._release()
        print(f"[rank {self.rank}] finished with exit code {code} after {time.time() - t0:.1f}s", flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        return {"rank": self.rank, "exit_code": code, "error": error, "traceback": tb, "pid": os.getpid()}

    def _release(self) -> None:
        if "mindspore" not in sys.modules:
            return
        try:
            from mindspore.communication import release
            from mindspore.communication.management import GlobalComm

            if getattr(GlobalComm, "INITED", False):
                release()
        except Exception as exc:
            print(f"[rank {self.rank}] communication release failed: {exc}", file=sys.stderr, flush=True)
