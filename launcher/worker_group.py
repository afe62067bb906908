"""The ranks of one attempt, one worker group per backend (after Ray Train v2's WorkerGroup):

- `RayWorkerGroup`: one Ray actor per rank in its node's bundle, and MindSpore's scheduler
  as a subprocess of node 0's agent;
- `MsrunWorkerGroup`: one `msrun` per node, run by that node's agent; msrun starts the
  node's ranks (and the scheduler on node 0) itself.

Both start exactly the `RankSpec`s they are given (what `mindpulse plan` prints) and hand
back one Ray reference per thing that ends: a rank (Ray) or a node's msrun.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from mindpulse.config import Backend, RunConfig

from . import interrupts as waits
from .node_agents import NodeAgents
from .rundir import PidFile
from .spec import MF_LOG_ENV, RankOutcome, RankSpec, scheduler_env

SCHED_EXIT_WAIT_S = 40.0
"""How long a graceful end waits for the rank actors to end, and the scheduler to see every
worker leave."""
SCHED_GRACE_S = 0.3
"""Once every rank actor has ended: how long the scheduler has to leave by itself before it
is ended (TERM, then KILL). Short: each rank released its communication group before its
`run` returned, so the scheduler has nothing left to coordinate, and it would only notice
at its next 5 s poll."""
RANK_START_TIMEOUT_S = 120


class OwnerKind(str, enum.Enum):
    RANK = "rank"
    NODE = "node"


class RefOwner(NamedTuple):
    """What a reference's result reports on: one rank, or every rank of a node (msrun)."""

    kind: OwnerKind
    index: int


class WorkerGroup(abc.ABC):
    """Start, kill and end the ranks of one attempt; tell where each rank ran."""

    def __init__(self, cfg: RunConfig, nodes: NodeAgents, logs_dir: Path, pids: PidFile,
                 say: Callable[[str], None]):
        self.cfg = cfg
        self.nodes = nodes
        self.interrupted = getattr(nodes, "interrupted", None)
        """The start's waits give up when it is true (the attempt's, through its agents)."""
        self.logs_dir = logs_dir
        self.pids = pids
        self.say = say
        self.rank_hosts: dict[int, str] = {}
        self.rank_nodes: dict[int, str] | None = None
        """Rank → Ray node id; None until the ranks were started."""
        self.rank_pids: dict[int, int] = {}

    def spawn(self, specs: list[RankSpec], sched_host: str) -> None:
        """Create the ranks' processes ahead of `start` (while the node agents and the
        aggregator start); nothing runs in them yet. A no-op where the ranks are started
        whole (msrun)."""
        return

    @abc.abstractmethod
    def start(self, specs: list[RankSpec], sched_host: str, sched_port: int,
              settings_path: str) -> dict[Any, RefOwner]:
        """Start every rank (the settings are written); returns reference → what its result
        reports on."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Stop every rank now, without waiting (a rank failed, a hang, a second interrupt)."""

    @abc.abstractmethod
    def terminate(self, graceful: bool) -> None:
        """The end of the attempt: let the ranks leave (graceful) or kill them."""

    def ranks_of(self, owner: RefOwner) -> list[int]:
        if owner.kind is OwnerKind.RANK:
            return [owner.index]
        rpn = self.cfg.world.ranks_per_node
        return list(range(owner.index * rpn, (owner.index + 1) * rpn))

    def outcomes(self, ref: Any, owner: RefOwner) -> list[RankOutcome]:
        """What happened to the ranks `ref` reports on (it has finished)."""
        import ray

        ranks = self.ranks_of(owner)
        try:
            res = ray.get(ref)
        except Exception as exc:  # the actor died: killed, OOM, segfault
            return [RankOutcome(rank=r, exit_code=None, error=died_error(exc), pid=self.rank_pids.get(r),
                                host=self.rank_hosts.get(r)) for r in ranks]
        return [RankOutcome(rank=r, exit_code=res["exit_code"], error=self._error(owner, res),
                            traceback=res.get("traceback", ""), pid=res.get("pid"), host=self.rank_hosts.get(r))
                for r in ranks]

    @abc.abstractmethod
    def _error(self, owner: RefOwner, res: dict[str, Any]) -> str:
        """The error text of a finished reference's result."""


class RayWorkerGroup(WorkerGroup):
    def __init__(self, cfg: RunConfig, nodes: NodeAgents, logs_dir: Path, pids: PidFile,
                 say: Callable[[str], None], *, actor_prefix: str):
        super().__init__(cfg, nodes, logs_dir, pids, say)
        self.actor_prefix = actor_prefix
        """Rank actors are named `<prefix>-rank-<r>` in the run's namespace."""
        self.actors: list[Any] = []

    def spawn(self, specs: list[RankSpec], sched_host: str) -> None:
        """One actor per rank in its node's bundle, its environment (MindSpore's variables
        among it) fixed at creation; its process starts (Ray worker, our imports) while the
        launcher waits for the agents. The job starts in `start`: `run` reads the settings."""
        import ray

        from mindpulse.lifetime.rank_processes import WORKER_ENV

        from .doors import rank_actor_class

        for spec in specs:
            opts = rank_actor_options(self.cfg, spec, {**WORKER_ENV, **loopback_env(sched_host), **spec.env},
                                      scheduling_strategy=self.nodes.bundle(spec.node),
                                      name=f"{self.actor_prefix}-rank-{spec.rank}")
            self.actors.append(ray.remote(rank_actor_class()).options(**opts).remote(
                spec.rank, str(self.logs_dir / f"rank_{spec.rank}.log")))

    def start(self, specs: list[RankSpec], sched_host: str, sched_port: int,
              settings_path: str) -> dict[Any, RefOwner]:

        cfg = self.cfg
        env = scheduler_env(cfg, settings_path=settings_path, sched_host=sched_host, sched_port=sched_port)
        env = {**loopback_env(sched_host), **env}
        sched = self.nodes.agents[0].start_scheduler.remote(env, str(self.logs_dir / "scheduler.log"))
        if not self.actors:
            self.spawn(specs, sched_host)
        self.pids["scheduler"] = waits.get(sched, 60, self.interrupted, "the MindSpore scheduler")
        self.say(f"mindpulse: started {len(specs)} ranks ({cfg.world.nodes} node(s) x {cfg.world.ranks_per_node}, "
                 f"{cfg.world.device.value}, ray backend), scheduler on {sched_host}:{sched_port}")
        infos: list[dict[str, Any]] = []
        try:
            infos = waits.get([a.info.remote() for a in self.actors], RANK_START_TIMEOUT_S, self.interrupted,
                              "the rank actors")
        # a start that timed out is said, not raised: the run calls below are still made and judged
        except Exception as exc:
            self.say(f"mindpulse: ranks did not start: {exc}")
        self.rank_pids = {i["rank"]: i["pid"] for i in infos}
        self.pids["ranks"] = self.rank_pids
        self.pids.save()
        self.rank_hosts = {i["rank"]: i["host"] for i in infos}
        self.rank_nodes = {i["rank"]: i["node_id"] for i in infos}
        # the rank reads its settings from MINDPULSE_SETTINGS in its runtime_env
        return {actor.run.remote(): RefOwner(OwnerKind.RANK, spec.rank) for actor, spec in zip(self.actors, specs)}

    def _error(self, owner: RefOwner, res: dict[str, Any]) -> str:
        return res.get("error", "")

    def kill(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # best effort kill: the actor may be gone already
                pass

    def terminate(self, graceful: bool) -> None:
        import ray

        ending = []
        for a in self.actors:
            try:
                if graceful:
                    ending.append(a.__ray_terminate__.remote())
                else:
                    ray.kill(a, no_restart=True)
            except Exception:  # best effort: an actor already gone needs no end
                pass
        # the scheduler leaves once it sees every worker unregistered, but it looks only every
        # 5 s (MindSpore's meta server): once the rank actors are gone (each unregisters as it
        # exits) it gets a short grace, then is ended, instead of up to 5 s of a launch's end
        wait = SCHED_EXIT_WAIT_S if graceful else 2.0
        if ending:
            _, running = ray.wait(ending, num_returns=len(ending), timeout=SCHED_EXIT_WAIT_S)
            if not running:
                # an actor's end comes back before its process has left: MindSpore unregisters
                # the rank from the scheduler at exit, and a scheduler ended before that makes
                # every rank retry, log an error and take ~1.5 s longer to go (measured on 2
                # cores: the ranks then left 2.9 s after their end instead of at once). So the
                # nodes first see their rank processes gone (killed after a grace), then the
                # scheduler gets its short grace
                self._wait_rank_processes()
                wait = min(wait, SCHED_GRACE_S)
        if self.nodes.agents:
            try:
                ray.get(self.nodes.agents[0].wait_scheduler.remote(wait), timeout=wait + 15)
            except Exception:  # best effort: the scheduler is ended right after whether it left or not
                pass


    def _wait_rank_processes(self) -> None:
        """Every node agent waits for its rank processes to exit (`NodeAgent.end_ranks`),
        all nodes at once."""
        import ray

        from mindpulse.lifetime.rank_processes import RANK_EXIT_GRACE_S

        refs = []
        for agent in self.nodes.agents:
            try:
                refs.append(agent.end_ranks.remote())
            except Exception:  # best effort: an agent already gone has no rank processes to wait for
                pass
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=RANK_EXIT_GRACE_S + 10)


class MsrunWorkerGroup(WorkerGroup):
    def start(self, specs: list[RankSpec], sched_host: str, sched_port: int,
              settings_path: str) -> dict[Any, RefOwner]:
        cfg = self.cfg
        refs: dict[Any, RefOwner] = {}
        for n, agent in enumerate(self.nodes.agents):
            spec = next(s for s in specs if s.node == n)
            refs[agent.run_msrun.remote(spec.command, msrun_env(cfg, spec),
                                        str(self.logs_dir / f"msrun_node{n}.log"))] = RefOwner(OwnerKind.NODE, n)
        infos = self.nodes.infos
        self.rank_hosts = {s.rank: infos[s.node]["host"] for s in specs}
        self.rank_nodes = {s.rank: infos[s.node]["node_id"] for s in specs}
        self.say(f"mindpulse: started msrun on {cfg.world.nodes} node(s) x {cfg.world.ranks_per_node} ranks "
                 f"({cfg.world.device.value}), scheduler on {sched_host}:{sched_port}")
        return refs

    def _error(self, owner: RefOwner, res: dict[str, Any]) -> str:
        return "" if res["exit_code"] == 0 else f"msrun on node {owner.index} exited {res['exit_code']}"

    def outcomes(self, ref: Any, owner: RefOwner) -> list[RankOutcome]:
        """Each rank's own exit status and first error, from msrun's output and the rank logs
        (msrun's exit status alone would fail every rank of the node, in rank order): the
        ranks that failed by themselves first, the first to fail first."""
        import ray

        from .msrun_logs import read_node_outcomes

        try:
            res = ray.get(ref)
        except Exception:  # the node's agent died: nothing of msrun's to read
            return super().outcomes(ref, owner)
        return read_node_outcomes(self.logs_dir, self.ranks_of(owner), res["exit_code"], owner.index,
                                  hosts=self.rank_hosts)

    def kill(self) -> None:
        self.nodes.kill_ranks()

    def terminate(self, graceful: bool) -> None:
        # nothing of its own: msrun, its ranks and its scheduler are the agents' children and
        # end with them (NodeAgents.shutdown, next)
        return


def died_error(exc: BaseException) -> str:
    """The error of a rank whose process died under Ray: Ray's first line, and the signal or
    exit status where Ray's text states one (Ray 2.60 reports a dead actor's worker as
    "unexpectedly exits with a connection error code 2. End of file", without its exit status:
    the failure block then says signal "unknown"; its boilerplate's list of possible causes
    names SIGSEGV and must not be taken for the cause)."""
    import re

    full = str(exc)
    first = full.splitlines()[0] if full else type(exc).__name__
    error = f"rank process died: {first}"
    m = re.search(r"\b(?:killed|terminated) by signal:? ?(SIG[A-Z0-9]+|\d+)\b", full)
    if m:
        error += f" (killed by signal {m.group(1)})"
    return error


def rank_actor_options(cfg: RunConfig, spec: RankSpec, env_vars: dict[str, str], *,
                       scheduling_strategy: Any = None, name: str | None = None) -> dict[str, Any]:
    """The `.options()` of one rank actor: its card (Ray's `num_cpus`/`num_gpus` keywords for
    CPUs and GPUs, which Ray refuses as custom `resources`; `{"NPU": 1}` for an Ascend card),
    its bundle, its environment and its name."""
    from .node_agents import DEVICE_RESOURCE

    resource = DEVICE_RESOURCE[cfg.world.device.value]
    opts: dict[str, Any] = dict(
        num_cpus=1 if resource == "CPU" else 0,
        runtime_env={"env_vars": dict(env_vars)},
        max_restarts=0,
        namespace=cfg.ray.namespace,
    )
    if resource == "GPU":
        opts["num_gpus"] = 1
    elif resource != "CPU":
        opts["resources"] = {resource: 1}
    if scheduling_strategy is not None:
        opts["scheduling_strategy"] = scheduling_strategy
    if name is not None:
        opts["name"] = name
    return opts


def loopback_env(sched_host: str) -> dict[str, str]:
    """With every rank on the driver's machine (the scheduler on 127.0.0.1), MindSpore's
    ranks listen on loopback too: without MS_WORKER_IP a worker takes the first network
    interface it finds ("'MS_WORKER_IP' env is not set, so get first available network
    interface"). A user's own MS_WORKER_IP (`env:`) wins."""
    from .node_agents import LOOPBACK

    return {"MS_WORKER_IP": LOOPBACK} if sched_host == LOOPBACK else {}


def msrun_env(cfg: RunConfig, spec: RankSpec) -> dict[str, str]:
    """What a node's msrun is given of its ranks' environment: msrun sets MS_*, RANK_* and
    DEVICE_ID per rank itself; the rest (mindpulse's, visibility, MindFormers' log folder,
    the user's) passes through,
    and MS_WORKER_IP=127.0.0.1 when the node's ranks meet on loopback (`loopback_env`)."""
    passed = {k: v for k, v in spec.env.items()
              if k.startswith("MINDPULSE_") or k in cfg.env or k in (
                  "ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "GLOG_v", MF_LOG_ENV)}
    return {**loopback_env(spec.env.get("MS_SCHED_HOST", "")), **passed}


def worker_group(cfg: RunConfig, nodes: NodeAgents, logs_dir: Path, pids: PidFile, say: Callable[[str], None],
                 *, actor_prefix: str) -> WorkerGroup:
    if cfg.backend is Backend.MSRUN:
        return MsrunWorkerGroup(cfg, nodes, logs_dir, pids, say)
    return RayWorkerGroup(cfg, nodes, logs_dir, pids, say, actor_prefix=actor_prefix)
