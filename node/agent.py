"""One NodeAgent per node (a Ray actor placed in that node's placement-group bundle).

It owns what is per node, never per rank:
- the packet relay: the node's ranks send their packets to it over loopback; it batches
  them to the aggregator, so the aggregator's load grows with nodes, not ranks;
- the telemetry sampler (npu-smi/DCMI, NVML or psutil), on an interval;
- on node 0 (ray backend) the MindSpore scheduler subprocess;
- with the msrun backend, the `msrun` process that starts the node's ranks.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Every Ray worker (and subprocess) that imports mindspore needs the pure-Python protobuf from
# the start (Ray imports protobuf first; mindspore's generated code then fails to load). The one
# definition: the launcher gives it to every actor it starts, this agent to what it spawns.
WORKER_ENV = {"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}


def node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"


class NodeAgent:
    def __init__(self, node: int, aggregator: Any, device: str, rank_devices: dict[int, int],
                 interval_s: float = 5.0, local_ranks: int = 1, decision_timeout_s: float = 120.0):
        from mindpulse.node.relay import RelayServer

        self.node = node
        self.name = f"node{node}-{socket.gethostname()}"
        self.aggregator = aggregator
        self.device = device
        self.rank_devices = {int(k): int(v) for k, v in rank_devices.items()}
        self.interval_s = interval_s
        self.sampler = None
        self.sent = 0
        self.errors: list[str] = []
        self.sched: subprocess.Popen | None = None
        self.msrun: subprocess.Popen | None = None
        self._inflight: list[Any] = []
        self.dropped = 0
        self.relay = RelayServer(self._forward_send, self._forward_decide, local_ranks)
        self.relay_port = self.relay.start()

    # ---- relay -------------------------------------------------------------------------------
    MAX_INFLIGHT_CALLS = 2000
    """Batches on their way to the aggregator; while it restarts they wait (Ray retries
    them on the new instance); beyond this bound new batches are dropped and counted."""

    def _forward_send(self, batch: list[bytes]) -> None:
        import ray

        if self._inflight:
            done, self._inflight = ray.wait(self._inflight, num_returns=len(self._inflight), timeout=0)
        if len(self._inflight) >= self.MAX_INFLIGHT_CALLS:
            self.dropped += len(batch)
            return
        self._inflight.append(self.aggregator.ingest.remote(batch))

    def _forward_decide(self, batch: list[bytes], step: int, timeout: float) -> bytes:
        import ray

        return ray.get(self.aggregator.decide.remote(batch, step, timeout), timeout=timeout + 10)

    def info(self) -> dict[str, Any]:
        import ray

        return {"node": self.node, "name": self.name, "ip": node_ip(), "host": socket.gethostname(),
                "relay": f"127.0.0.1:{self.relay_port}", "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "python": sys.executable}

    # ---- MindSpore scheduler (ray backend, node 0) ------------------------------------------
    def start_scheduler(self, sched_env: dict[str, str], log_path: str) -> int:
        """`sched_env` is the launcher's `scheduler_env` (what `mindpulse plan` shows): the
        user's `env:`, MS_ROLE=MS_SCHED with the scheduler's address and worker count, and
        MINDPULSE_SETTINGS (the scheduler reads its device target from the run's settings)."""
        env = dict(os.environ)
        env.update(WORKER_ENV)
        env.update(sched_env)
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as logf:
            self.sched = subprocess.Popen([sys.executable, "-m", "mindpulse.workers.scheduler"], env=env,
                                          stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
        return self.sched.pid

    def wait_scheduler(self, timeout_s: float) -> int | None:
        return _wait(self.sched, timeout_s)

    # ---- msrun backend ---------------------------------------------------------------------------
    def run_msrun(self, command: list[str], env: dict[str, str], log_path: str) -> dict[str, Any]:
        """Run this node's msrun (it starts the node's ranks) until it ends."""
        full = dict(os.environ)
        full.update(WORKER_ENV)
        full.update(env)
        # msrun starts workers with the `python` on PATH: make it this interpreter's
        full["PATH"] = os.path.dirname(sys.executable) + os.pathsep + full.get("PATH", "")
        cmd = [os.path.join(os.path.dirname(sys.executable), "msrun")] + command[1:]
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        with open(log_path, "ab") as logf:
            logf.write(("$ " + " ".join(cmd) + "\n").encode())
            logf.flush()
            self.msrun = subprocess.Popen(cmd, env=full, stdout=logf, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
            code = self.msrun.wait()
        return {"node": self.node, "exit_code": code, "seconds": time.time() - t0, "pid": self.msrun.pid}

    def msrun_pid(self) -> int | None:
        return self.msrun.pid if self.msrun else None

    # ---- telemetry ---------------------------------------------------------------------------------
    def start_telemetry(self, rank_pids: dict[int, int]) -> dict[str, Any]:
        from mindpulse.node.telemetry import NodeSampler, TelemetryUnavailable, pick_sampler

        if self.interval_s <= 0:
            return {"node": self.name, "source": None, "reason": "telemetry off"}
        try:
            sampler = pick_sampler(self.device)
        except TelemetryUnavailable as exc:
            self.errors.append(str(exc))
            return {"node": self.name, "source": None, "reason": str(exc)}
        self.sampler = NodeSampler(self.name, sampler, self.rank_devices,
                                   {int(k): int(v) for k, v in rank_pids.items()}, interval_s=self.interval_s)
        self.sampler.start(self._ship)
        return {"node": self.name, "source": sampler.name}

    def _ship(self, sample: dict[str, Any]) -> None:
        from mindpulse.node.telemetry import telemetry_packet

        try:
            self.aggregator.ingest.remote([telemetry_packet(sample).encode()])
            self.sent += 1
        except Exception as exc:  # the aggregator may be restarting: drop this sample
            self.errors.append(repr(exc))
            del self.errors[:-20]

    # ---- end ------------------------------------------------------------------------------------
    def stop(self, kill: bool = False) -> dict[str, Any]:
        if self.sampler is not None:
            self.sampler.stop()
            try:
                self._ship(self.sampler.sample_once())  # short runs still end with a sample
            except Exception:
                pass
            self.sampler = None
        for proc in (self.msrun, self.sched):
            if proc is not None and proc.poll() is None and kill:
                _killpg(proc)
        self.relay.stop()
        if self._inflight:  # the last packets reach the aggregator before it closes
            import ray

            try:
                ray.wait(self._inflight, num_returns=len(self._inflight), timeout=10)
            except Exception:
                pass
            self._inflight = []
        return {"node": self.name, "sent": self.sent, "errors": self.errors[-5:], "dropped": self.dropped,
                "relay": dict(self.relay.stats)}

    stack_ready: set[int] = set()

    def dump_stacks(self, pids: dict[int, int], out_dir: str, ready: list[int] | None = None) -> dict[int, str]:
        """Every given rank's Python stacks into `out_dir/stacks_rank_<r>.txt` (py-spy, which
        also reads a stopped process), and SIGUSR1 to live ranks (faulthandler writes all
        threads' stacks into the rank's own log)."""
        import shutil

        spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        out: dict[int, str] = {}
        self.stack_ready = set(ready or [])
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        for rank, pid in pids.items():
            if not pid:
                continue
            path = Path(out_dir) / f"stacks_rank_{rank}.txt"
            text = ""
            if os.path.exists(spy):
                try:
                    proc = subprocess.run([spy, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True,
                                          text=True, timeout=30)
                    text = proc.stdout + proc.stderr
                except Exception as exc:
                    text = f"py-spy failed: {exc}"
            try:
                # only ranks that registered faulthandler (the monitor started): SIGUSR1's
                # default action would kill a rank stuck earlier
                if rank in self.stack_ready:
                    os.kill(pid, signal.SIGUSR1)
                text += f"\n(SIGUSR1 sent: faulthandler wrote all threads' stacks into logs/rank_{rank}.log)\n"
            except OSError as exc:
                text += f"\n(SIGUSR1 not delivered: {exc})\n"
            path.write_text(f"rank {rank} pid {pid}\n{text}")
            out[rank] = str(path)
        return out

    def kill_ranks(self) -> None:
        """Stop this node's ranks now (another rank failed): msrun's whole process group."""
        if self.msrun is not None and self.msrun.poll() is None:
            _killpg(self.msrun)

    def ping(self) -> float:
        return time.time()


def _wait(proc: subprocess.Popen | None, timeout_s: float) -> int | None:
    if proc is None:
        return None
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _killpg(proc)
        return proc.poll()


def _killpg(proc: subprocess.Popen) -> None:
    """TERM, then KILL, the process's whole session (msrun's workers run in their own
    process groups: kill them by the pids msrun spawned too)."""
    try:
        import psutil

        children = psutil.Process(proc.pid).children(recursive=True)
    except Exception:
        children = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in [proc.pid] + [c.pid for c in children]:
            try:
                os.killpg(os.getpgid(pid), sig)
            except (ProcessLookupError, PermissionError, OSError):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        deadline = time.time() + 5
        while time.time() < deadline and (proc.poll() is None or any(_alive(c.pid) for c in children)):
            time.sleep(0.1)
        if proc.poll() is not None and not any(_alive(c.pid) for c in children):
            return


def _alive(pid: int) -> bool:
    try:
        import psutil

        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE
    except Exception:
        return False
