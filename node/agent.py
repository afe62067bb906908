"""One NodeAgent per node (a Ray actor placed in that node's placement-group bundle).

It owns what is per node, never per rank:
- the packet relay: the node's ranks send their packets to it over loopback; it batches
  them to the aggregator, so the aggregator's load grows with nodes, not ranks;
- the telemetry sampler (npu-smi/DCMI, NVML or psutil), on an interval;
- on node 0 (ray backend) the MindSpore scheduler subprocess;
- with the msrun backend, the `msrun` process that starts the node's ranks.

Nothing it starts outlives it: the scheduler and msrun get a parent-death signal
(PR_SET_PDEATHSIG; msrun's is SIGINT, on which msrun kills its workers), and a watchdog
thread ends the run's processes on this node (msrun and every process under it, the
scheduler, the Ray rank actors) once the driver that launched the run is gone.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mindpulse.config.settings import NodeSettings
from mindpulse.lifetime.process_identity import process_alive, same_process_table
from mindpulse.lifetime.processes import descendants, die_with_parent_preexec, end_process_tree, end_processes
from mindpulse.lifetime.rank_processes import RANK_EXIT_GRACE_S, WORKER_ENV
from mindpulse.node.relay import NodeBatch
from mindpulse.rundir.rundir_io import open_log_fd
from mindpulse.wire.uplink import Receipt, Uplink, UplinkServer

if TYPE_CHECKING:
    from mindpulse.node.group import GroupLeader

log = logging.getLogger(__name__)

DRIVER_CHECK_S = 1.0
"""How often the watchdog looks for the driver (and for new processes under msrun)."""
UPLINK_CLOSE_S = 10.0
"""At the end, how long a node waits for its last frames to be acknowledged."""
REMOTE_DRIVER_CHECK_S = 5.0
"""How often it asks Ray whether a driver on another machine is gone (a GCS call)."""
LEADER_ANSWER_S = 60.0
"""How long a group member waits for its leader to say where it listens before sending to the
aggregator itself, for the rest of the run. A dead leader fails the call at once; a live one
can be slow to answer while its node starts its ranks on busy cores (10 s was exceeded on a
2-core machine), and a member that gave up on it stayed out of its group for good."""


def node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (tests, a plain process) the node is this machine
        return "127.0.0.1"


# The agent's coroutines live outside the class: Ray makes an actor whose class has any
# coroutine method (private ones too) an async actor, which runs every plain method in one
# event loop, one at a time. With msrun, `run_msrun` holds a call for the whole job, and
# `start_telemetry`, `kill_ranks`, `dump_stacks` and `stop` then waited behind it (the
# launcher's start waited up to 60 s, and the node had no telemetry). As a threaded actor
# (`max_concurrency`, launcher/node_agents.py) they run next to it.
async def _forward_decide(agent: NodeAgent, batch: NodeBatch, step: int, timeout: float) -> bytes:
    """A rank of this node waits for a verdict (in the relay's loop)."""
    if agent.group is not None:  # the step goes up with the group's; the directive comes back
        agent.group.add(agent.node, batch)
        return await agent.uplink.decide([], step, timeout)
    return await agent.uplink.decide([(agent.node, batch)], step, timeout)


async def _members_decide(agent: NodeAgent, step: int, timeout: float) -> bytes:
    """A member's rank waits for a verdict: the group's step goes up with the group's merged
    partial; the directive is asked for here (in the relay's loop)."""
    return await agent.uplink.decide([], step, timeout)


class NodeAgent:
    def __init__(self, aggregator: Any, settings: NodeSettings):
        """`settings`: the launcher's `NodeSettings` for this node (launcher/spec.py
        `node_settings`); while they name the driver, a watchdog ends this node's processes of
        the run once that process is gone."""
        from mindpulse.node.relay import NodePreReducer, RelayServer

        node = settings.node
        self.settings = settings
        self.node = node
        self.name = f"node{node}-{socket.gethostname()}"
        self.aggregator = aggregator
        self.device = settings.device
        self.rank_devices = {int(k): int(v) for k, v in settings.rank_devices.items()}
        self.interval_s = settings.telemetry_interval_s
        self.sampler = None
        self.sent = 0
        self.errors: list[str] = []
        self.sched: subprocess.Popen | None = None
        self.msrun: subprocess.Popen | None = None
        self.rank_pids: dict[int, int] = {}
        """This node's rank processes (Ray backend), for the watchdog."""
        self._tracked: dict[int, float] = {}
        """pid → create time of every process seen under msrun and the scheduler."""
        # children are started from this one thread: their parent-death signal is tied to the
        # thread that forked them, and Ray's actor threads are not ours to keep alive
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mindpulse-spawn")
        self.driver = dict(settings.driver)
        self._ending = threading.Event()
        """Set to stop the watchdog (tests; the agent itself ends with its process)."""
        self._watchdog: threading.Thread | None = None
        # the node's ranks are validated and each step reduced here: the aggregator merges
        # one partial per node and step
        ranks = sorted(self.rank_devices)
        self.prereduce = NodePreReducer(node, range(ranks[0], ranks[-1] + 1) if ranks else range(0),
                                        straggler_window=settings.straggler_window,
                                        collect_freq=settings.collect_freq, world_size=settings.world_size,
                                        compute_window=settings.compute_window)
        # steps go up, and the lease comes down, over one stream (mindpulse/wire/uplink.py): to the
        # aggregator, or to the group's leader; the relay sends into it and takes its leases
        # straight (`_route`)
        self.uplink = Uplink(node, self._resolve_up, self._on_lease, max_unacked=self.MAX_UNACKED)
        self.relay = RelayServer(self.uplink.send_batch, functools.partial(_forward_decide, self),
                                 settings.local_ranks, prereduce=self.prereduce, token=settings.relay_token,
                                 pushed_leases=True)
        self.server: UplinkServer | None = None
        """A group leader's uplink server, for its members."""
        self._end: dict[str, Any] | None = None
        self._route()
        self.relay_port = self.relay.start()
        self.uplink.start(self._loop)
        if self.driver:
            self._watchdog = threading.Thread(target=self._watch_driver, name="mindpulse-driver-watchdog",
                                              daemon=True)
            self._watchdog.start()

    # ---- relay and uplink ----------------------------------------------------------------------
    MAX_UNACKED = 2000
    """Frames on their way up, not yet acknowledged; while the aggregator restarts they wait
    (and go again to the new instance); beyond this bound new batches are dropped and counted."""

    # ---- the group (node/group.py): a leader merges its members' batches -----------------------
    group: GroupLeader | None = None
    leader: Any = None

    @property
    def _loop(self) -> Any:
        assert self.relay.loop is not None
        return self.relay.loop

    def _in_loop(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run `coro` in the relay's loop (where the uplink and the servers live) and wait."""
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def lead(self, members: list[int]) -> tuple[str, int, str]:
        """Lead the group of `members` (node ids, this node's included); returns the address
        members send to (`uplink_address`)."""
        from mindpulse.node.group import GroupLeader

        async def serve() -> tuple[str, int, str]:
            # the group and the relay's route change together, in the loop where the relay
            # and `_forward_decide` read them: a step never goes up half by each route
            self.group = GroupLeader(self.node, members, self.uplink.send_threadsafe)
            self._route()
            # a member's frame is acknowledged once what it carried is acknowledged above
            self.server = UplinkServer(self._members_ingest, functools.partial(_members_decide, self),
                                       lambda: self.relay.lease.encode(), deferred_acks=True)
            return await self.server.start(node_ip())

        return self._in_loop(serve())

    def uplink_address(self) -> tuple[str, int, str]:
        if self.server is None:
            raise RuntimeError(f"node {self.node} does not lead a group")
        return self.server.address

    def follow(self, leader: Any) -> None:
        """Send this node's batches through `leader` (a NodeAgent handle), which passes the
        lease down too."""
        self.leader = leader
        self.uplink.redirect()

    def _resolve_up(self) -> tuple[str, int, str]:
        """Where the uplink connects: the group's leader, else (none, or gone) the aggregator."""
        import ray

        leader = self.leader
        if leader is not None:
            try:
                return tuple(ray.get(leader.uplink_address.remote(),  # type: ignore[return-value]
                                     timeout=LEADER_ANSWER_S))
            except Exception as exc:  # any failure of the leader (gone, timed out): send to the aggregator itself
                log.warning("node %d: group leader unreachable (%s); sending to the aggregator", self.node, exc)
                if self.leader is leader:  # a leader named meanwhile (`follow`) is kept: its redirect is pending
                    self.leader = None
        return tuple(ray.get(self.aggregator.uplink_address.remote(), timeout=60))  # type: ignore[return-value]

    def _route(self) -> None:
        """Wire the packet path past the agent: the relay's batches go straight into the
        uplink, and a lease pushed down straight to the relay. A group's leader puts its own
        batches into its group instead (node/group.py) and passes each lease on to its
        members too (`_on_lease`). Called at start and when this node starts leading (in the
        loop: the relay and the uplink run there)."""
        if self.group is None:
            self.relay.forward_send = self.uplink.send_batch
            self.uplink.on_lease = self.relay.set_lease
        else:
            self.relay.forward_send = functools.partial(self.group.add, self.node)
            self.uplink.on_lease = self._on_lease

    def _send_up(self, batch: NodeBatch) -> None:
        """A batch made outside the relay (the telemetry sampler's): where the relay's go."""
        self.relay.forward_send(batch)

    def _on_lease(self, raw: bytes) -> None:
        """A lease from above (in the loop), at a group's leader: the node's ranks, and the
        leader's members, get it."""
        self.relay.set_lease(raw)
        if self.server is not None:
            self.server.push_lease()

    def _members_ingest(self, entries: list[tuple[Any, NodeBatch]], receipt: Receipt) -> None:
        """A member's frame: its pieces hold `receipt` until they are acknowledged above."""
        assert self.group is not None
        for node, batch in entries:
            if isinstance(node, int) and not isinstance(node, bool):
                self.group.add(node, batch, receipt)
            else:
                self.group.reject("malformed_entry")

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
        with os.fdopen(open_log_fd(log_path), "ab") as logf:
            self.sched = self._spawn([sys.executable, "-m", "mindpulse.workers.scheduler"], env=env, stdout=logf,
                                     death_signal=signal.SIGKILL)
        self._track()
        return self.sched.pid

    def _spawn(self, cmd: list[str], *, env: dict[str, str], stdout: Any, death_signal: int) -> subprocess.Popen:
        """Start `cmd` in a session of its own (its process group is killed as one) that gets
        `death_signal` when this agent dies. The signal comes when the *thread* that started
        the child ends: `_spawner` is one thread that lives as long as the agent."""
        def start() -> subprocess.Popen:
            return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=die_with_parent_preexec(death_signal))

        return self._spawner.submit(start).result()

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
        t0 = time.time()
        with os.fdopen(open_log_fd(log_path), "ab") as logf:
            logf.write(("$ " + " ".join(cmd) + "\n").encode())
            logf.flush()
            # SIGINT: msrun's own handler kills its workers (in sessions of their own) and its scheduler
            self.msrun = self._spawn(cmd, env=full, stdout=logf, death_signal=signal.SIGINT)
            self._track()
            code = self._wait_msrun(log_path, logf)
        return {"node": self.node, "exit_code": code, "seconds": time.time() - t0, "pid": self.msrun.pid}

    MSRUN_GRACE_S = 3.0
    """How long msrun may take to end by itself once it has killed its workers after one failed."""

    def _wait_msrun(self, log_path: str, logf: Any) -> int:
        """msrun's exit status. Once msrun says that it killed
        its other workers after one failed, the job is over and msrun only waits for its
        scheduler, which waits for the killed ranks' heartbeats to time out
        (node/msrun_output.py): after MSRUN_GRACE_S the agent ends msrun and everything under
        it, so the launcher learns of the failure seconds after it, not half a minute."""
        from mindpulse.frameworks.msrun_text import KILLED_OTHERS
        from mindpulse.node.msrun_output import LogScanner

        assert self.msrun is not None
        scanner = LogScanner(log_path, KILLED_OTHERS)
        gave_up_at: float | None = None
        cut = False
        while True:
            try:
                return self.msrun.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
            if gave_up_at is None:
                if scanner.found():
                    gave_up_at = time.time()
            elif not cut and time.time() - gave_up_at > self.MSRUN_GRACE_S:
                cut = True
                logf.write(f"mindpulse: msrun killed its workers after one failed and still waits for its "
                           f"scheduler {self.MSRUN_GRACE_S:g}s later (the scheduler waits for the killed ranks' "
                           "heartbeats to time out): ending msrun and its scheduler now\n".encode())
                logf.flush()
                end_process_tree(self.msrun, CHILD_END_GRACE_S)

    def msrun_pid(self) -> int | None:
        return self.msrun.pid if self.msrun else None

    # ---- telemetry ---------------------------------------------------------------------------------
    def start_telemetry(self, rank_pids: dict[int, int]) -> dict[str, Any]:
        from mindpulse.node.telemetry import NodeSampler, TelemetryUnavailable, pick_sampler

        self.rank_pids = {int(k): int(v) for k, v in rank_pids.items()}
        for pid in self.rank_pids.values():
            self._remember(pid)
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
            batch = {"steps": [], "other": [telemetry_packet(sample).encode()], "partials": [], "rejected": {}}
            self._loop.call_soon_threadsafe(self._send_up, batch)
            self.sent += 1
        except Exception as exc:  # the relay is stopping: drop this sample
            self.errors.append(repr(exc))
            del self.errors[:-20]

    # ---- end ------------------------------------------------------------------------------------
    def stop(self, kill: bool = False, end_ranks: bool = False) -> dict[str, Any]:
        """Last telemetry sample, relay flushed, uplink closed. `kill`: msrun and the
        scheduler are killed; `end_ranks` (the launch is over, its ranks were told to end):
        this node's rank processes still running after RANK_EXIT_GRACE_S are killed."""
        if end_ranks:
            self.end_ranks()
        if self.sampler is not None:
            self.sampler.stop()
            try:
                self._ship(self.sampler.sample_once())  # short runs still end with a sample
            except Exception:  # a last sample is a courtesy: its failure must not stop the node's end
                pass
            self.sampler = None
        for proc in (self.msrun, self.sched):
            if proc is not None and proc.poll() is None and kill:
                end_process_tree(proc, CHILD_END_GRACE_S)
        # the last packets reach the aggregator before it closes: the relay's queue goes up,
        # then a leader's merged steps, then the uplink waits until all is acknowledged
        if self._end is not None:  # stopped already (flush, then shutdown)
            return self._end
        lost = 0
        try:
            self._in_loop(self.relay.flush())
            group = self.group.close() if self.group is not None else {}
            lost = self._in_loop(self.uplink.close(UPLINK_CLOSE_S), UPLINK_CLOSE_S + 5)
            if self.server is not None:
                self._in_loop(self.server.close())
        except Exception as exc:  # the agent's stop must always return its record: the error goes into it
            group = {}
            self.errors.append(f"stop: {exc!r}")
        self.relay.stop()
        self._end = {"node": self.name, "sent": self.sent, "errors": self.errors[-5:],
                     "dropped": self.uplink.dropped, "lost": lost, "relay": dict(self.relay.stats), "group": group,
                     "uplink": dict(self.uplink.stats), "members": dict(self.server.stats) if self.server else {}}
        return self._end

    def end_ranks(self, grace_s: float | None = None) -> list[int]:
        """Wait up to `grace_s` (default RANK_EXIT_GRACE_S) for this node's rank processes to
        exit (their run ended), then kill those still running; returns the killed pids. Only
        ranks whose start time is known: a pid alone may be another process by now."""
        grace_s = RANK_EXIT_GRACE_S if grace_s is None else grace_s
        known = {pid: self._tracked[pid] for pid in self.rank_pids.values() if pid in self._tracked}
        ended = end_lingering(known, grace_s)
        if ended:
            self.errors.append(f"rank processes {ended} still ran {grace_s:g} s after the run ended: killed")
        return ended

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
        ours = set(self.rank_pids.values()) | set(self._tracked)
        for rank, pid in pids.items():
            if not pid:
                continue
            path = Path(out_dir) / f"stacks_rank_{rank}.txt"
            if pid not in ours:  # a pid from a packet: never signal a process this agent did not start
                path.write_text(f"rank {rank} pid {pid}\nnot a process this node agent started or watches: "
                                "not inspected, not signalled\n")
                out[rank] = str(path)
                continue
            text = ""
            if os.path.exists(spy):
                try:
                    proc = subprocess.run([spy, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True,
                                          text=True, timeout=30)
                    text = proc.stdout + proc.stderr
                except Exception as exc:  # a failed dump is written into the rank's stack file instead
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

    def saving_now(self, ckpt_dir: str) -> dict[str, Any] | None:
        """Rank 0's save-in-progress marker in `ckpt_dir` on this host (`rundir_io.saving_now`)."""
        from mindpulse.rundir.rundir_io import saving_now

        return saving_now(ckpt_dir)

    def write_marker(self, path: str, token: str) -> dict[str, Any]:
        """Write `token` to `path` on this host (launcher/shared_output.py: does the driver see it?)."""
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(token)
        except OSError as exc:  # the answer carries the failure: the driver names this host
            return {"error": f"{type(exc).__name__}: {exc}", "host": socket.gethostname()}
        return {"host": socket.gethostname()}

    def remove_marker(self, path: str) -> None:
        try:
            Path(path).unlink()
            Path(path).parent.rmdir()  # the last node's removal takes the folder along
        except OSError:  # another node's marker is still there, or this one is gone already
            pass

    def kill_ranks(self) -> None:
        """Stop this node's ranks now (another rank failed): msrun's whole process group."""
        if self.msrun is not None and self.msrun.poll() is None:
            end_process_tree(self.msrun, CHILD_END_GRACE_S)

    def ping(self) -> float:
        return time.time()

    # ---- the driver's death -------------------------------------------------------------------
    def _remember(self, pid: int) -> None:
        try:
            import psutil

            self._tracked.setdefault(pid, psutil.Process(pid).create_time())
        except Exception:  # a process already gone or not ours is simply not tracked
            pass

    def _track(self) -> None:
        """Remember msrun's and the scheduler's processes and everything under them: msrun's
        workers run in sessions of their own and outlive a killed msrun as orphans."""
        for proc in (self.msrun, self.sched):
            if proc is None or proc.poll() is not None:
                continue
            self._remember(proc.pid)
            for pid, ct in descendants(proc.pid).items():
                self._tracked.setdefault(pid, ct)
        for pid, ct in list(self._tracked.items()):
            if not process_alive(pid, ct):
                self._tracked.pop(pid, None)

    def driver_alive(self) -> bool | None:
        """Is the launcher still there? None: cannot tell now (a driver on another machine and
        Ray does not answer)."""
        d = self.driver
        if same_process_table(d):
            return process_alive(d.get("pid"), d.get("create_time"))
        try:
            import ray

            if not ray.is_initialized():  # not in a Ray worker: nobody to ask
                return None
            from ray._private.state import jobs

            me = ray.get_runtime_context().get_job_id()
            for job in jobs():
                if job.get("JobID") == me:
                    return not job.get("IsDead")
        except Exception:  # Ray's job table unreadable: the driver's liveness is unknown, not dead
            return None
        return None

    def _watch_driver(self) -> None:
        last_remote = 0.0
        remote = not same_process_table(self.driver)
        while not self._ending.wait(DRIVER_CHECK_S):
            try:
                self._track()
                if remote and time.time() - last_remote < REMOTE_DRIVER_CHECK_S:
                    continue
                last_remote = time.time()
                if self.driver_alive() is False:
                    log.warning("the launcher (pid %s on %s) is gone: ending this node's processes of the run",
                                self.driver.get("pid"), self.driver.get("host"))
                    self.end_run_processes()
                    self._exit()
                    return
            except Exception:  # the watchdog never dies of a passing error
                log.exception("driver watchdog")

    def _exit(self) -> None:
        """The agent's own end once the driver is gone (nobody will ask it anything again)."""
        os._exit(0)

    def end_run_processes(self) -> list[int]:
        """SIGKILL every process of the run this agent knows on its node: msrun and all under it,
        the scheduler, the rank actors. Returns the pids signalled."""
        self._track()
        targets = dict(self._tracked)
        for pid in self.rank_pids.values():
            targets.setdefault(pid, None)
        for proc in (self.msrun, self.sched):
            if proc is not None and proc.poll() is None:
                targets.setdefault(proc.pid, None)
        return end_processes(targets)  # no grace: the driver is gone, nobody will stop them


CHILD_END_GRACE_S = 5.0
"""How long msrun or the scheduler (and each process under it, every one in its process
group) may take to end on SIGTERM before SIGKILL, and then to be gone after it: msrun's
workers run in process groups of their own, so they are ended by the pids msrun started."""


def end_lingering(targets: dict[int, float | None], grace_s: float) -> list[int]:
    """Wait up to `grace_s` for the processes `targets` ({pid: create time or None}) to
    exit, then SIGKILL those still running; returns their pids. A Ray rank's process can
    outlive its actor's end while it tears down (MindSpore's and gRPC's exit work, or a
    hang there), and nothing of a run may outlive its launch. The create time keeps a pid
    the system gave to another process since from being killed. No SIGTERM first: the ranks
    were told to end through their run already."""
    return end_processes(targets, grace_s=grace_s)


def _wait(proc: subprocess.Popen | None, timeout_s: float) -> int | None:
    if proc is None:
        return None
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        end_process_tree(proc, CHILD_END_GRACE_S)
        return proc.poll()
