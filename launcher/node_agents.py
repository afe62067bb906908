"""One attempt's nodes: a placement group with one bundle per node, and a NodeAgent actor
in each bundle (packet relay, telemetry, stack dumps; msrun or the scheduler live there).

Both backends place their ranks in these bundles, so the agents are shared by the worker
groups; the attempt creates them before the ranks and shuts them down after.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mindpulse.config import RunConfig

from . import interrupts as waits
from .preflight import LaunchRefused
from .spec import free_port, node_settings

DEVICE_RESOURCE = {"cpu": "CPU", "ascend": "NPU", "gpu": "GPU"}
"""Ray's resource name for a card of each `world.device`."""
PLACEMENT_TIMEOUT_S = 120
LOOPBACK = "127.0.0.1"


def placement_bundles(cfg: RunConfig) -> tuple[list[dict[str, float]], str]:
    """One bundle per node holding that node's ranks' cards (Ray takes "CPU" and "GPU" in a
    bundle, unlike in an actor's `resources`), and the strategy: STRICT_SPREAD puts nodes apart."""
    w = cfg.world
    resource = DEVICE_RESOURCE[w.device.value]
    return [{resource: float(w.ranks_per_node)} for _ in range(w.nodes)], "PACK" if w.nodes == 1 else "STRICT_SPREAD"


def driver_first(bundle_nodes: list[str], driver_node: str) -> list[int]:
    """The job's node order over the placed bundles (bundle → Ray node id): the bundle on the
    driver's host, where there is one, becomes node 0, so rank 0 (which writes the
    checkpoints) and the scheduler run where the launch was made; the rest keep their order."""
    order = list(range(len(bundle_nodes)))
    here = [b for b in order if bundle_nodes[b] == driver_node]
    return here[:1] + [b for b in order if b not in here[:1]]


class NodeAgents:
    def __init__(self, cfg: RunConfig, interrupted: Callable[[], bool] | None = None):
        self.cfg = cfg
        self.interrupted = interrupted
        """Set: the start's waits give up when it is true (interrupts.StartInterrupted)."""
        self.resource = DEVICE_RESOURCE[cfg.world.device.value]
        self.pg: Any = None
        self.agents: list[Any] = []
        self.infos: list[dict[str, Any]] = []
        self.node_ips: list[str] = []
        """Bundle (node) → the address of the Ray node it was placed on."""
        self.order: list[int] = []
        """Node → its bundle: the bundle on the driver's host is node 0 (`driver_first`)."""
        self.lost: set[int] = set()
        """Nodes lost or cut off (launcher/node_health.py): their agents are not called again
        (a call to a host that does not answer would wait out its timeout)."""

    def place(self, aggregator: Any, relay_token: str = "") -> None:
        """Reserve every node's cards and start its agent, and wait until every agent runs."""
        self.reserve(aggregator, relay_token)
        self.wait_ready()

    def reserve(self, aggregator: Any, relay_token: str = "") -> None:
        """Reserve every node's cards and create its agent, without waiting for the agents'
        processes (the ranks' and the aggregator's start meanwhile: `wait_ready`); refused
        when the cluster cannot hold the job. Handles are kept as they are made, so a failure
        halfway is cleaned up."""
        import ray
        from ray.util.placement_group import placement_group, placement_group_table

        from mindpulse.lifetime.process_identity import driver_identity
        from mindpulse.lifetime.rank_processes import WORKER_ENV

        from .doors import node_agent_class

        w = self.cfg.world
        bundles, strategy = placement_bundles(self.cfg)
        pg = placement_group(bundles, strategy=strategy)
        self.pg = pg  # kept before it is placed: `release` removes a pending one too
        try:
            waits.get(pg.ready(), PLACEMENT_TIMEOUT_S, self.interrupted, "the placement of the nodes")
        except Exception as exc:
            self.release()
            raise LaunchRefused(f"the Ray cluster cannot place {w.nodes} node(s) x {w.ranks_per_node} "
                                f"{self.resource}: {exc}") from None
        # each bundle's node address, known once the group is placed: where the scheduler
        # listens is decided before the agents' processes have started
        by_id = {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes()}
        placed = sorted(placement_group_table(pg).get("bundles_to_node_id", {}).items())
        self.order = driver_first([nid for _, nid in placed], ray.get_runtime_context().get_node_id())
        self.node_ips = [by_id.get(placed[b][1], "") for b in self.order] if len(placed) == w.nodes else []
        group = self.cfg.monitor.groups_of(w.nodes)  # a leader also passes the lease down to its members
        # its watchdog ends the node's processes of the run when the launcher is gone
        driver = driver_identity()
        for n in range(w.nodes):
            self.agents.append(ray.remote(node_agent_class()).options(
                num_cpus=0, scheduling_strategy=self.bundle(n),
                runtime_env={"env_vars": dict(WORKER_ENV)}, max_restarts=0,
                # threaded: run_msrun holds one thread for the whole job; kill_ranks, stop,
                # dump_stacks and telemetry must still get through
                max_concurrency=8 + group,
            ).remote(aggregator, node_settings(self.cfg, n, relay_token=relay_token, driver=driver)))

    def wait_ready(self) -> None:
        """Wait for every agent created by `reserve` and link the groups of the tree."""

        w = self.cfg.world
        group = self.cfg.monitor.groups_of(w.nodes)
        self.infos = waits.get([a.info.remote() for a in self.agents], PLACEMENT_TIMEOUT_S, self.interrupted,
                               "the node agents")
        self.leaders: set[int] = set()
        if group > 1:  # the tree's second level (node/group.py)
            groups = [list(range(first, min(w.nodes, first + group))) for first in range(0, w.nodes, group)]
            # leaders first: a member's uplink asks its leader for the address it serves
            waits.get([self.agents[g[0]].lead.remote(g) for g in groups], PLACEMENT_TIMEOUT_S, self.interrupted,
                      "the group leaders")
            self.leaders = {g[0] for g in groups}
            waits.get([self.agents[m].follow.remote(self.agents[g[0]]) for g in groups for m in g[1:]],
                      PLACEMENT_TIMEOUT_S, self.interrupted, "the group members")

    def _stop_waves(self) -> list[list[Any]]:
        """The agents in two waves, group members before their leaders: a member's last
        batch goes through its leader, which must still be there to pass it on (and to have
        it acknowledged above before it acknowledges it)."""
        leaders = getattr(self, "leaders", set())
        waves = [[a for n, a in enumerate(self.agents) if n not in leaders and n not in self.lost],
                 [self.agents[n] for n in sorted(leaders) if n not in self.lost]]
        return [w for w in waves if w]

    def bundle(self, node: int) -> Any:
        """The scheduling strategy that puts an actor in `node`'s bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=self.order[node]
                                                if node < len(self.order) else node)

    # ---- what ranks are told -----------------------------------------------------------------
    def relays(self) -> dict[int, str]:
        """Node → host:port of its agent's packet relay."""
        return {int(i["node"]): i["relay"] for i in self.infos}

    def sched_endpoint(self, embedded: bool) -> tuple[str, int]:
        """Where MindSpore's scheduler listens: node 0 (loopback when every rank is on the
        driver's machine), on `msrun.master_port` or a free port."""
        import ray

        w = self.cfg.world
        ip0 = self.infos[0]["ip"] if self.infos else (self.node_ips[0] if self.node_ips else "")
        if not ip0 and not embedded:  # the group's node is not listed (yet): ask its agent
            self.wait_ready()
            ip0 = self.infos[0]["ip"]
        local = embedded or (w.nodes == 1 and ip0 == ray.util.get_node_ip_address())
        host = LOOPBACK if local else (self.cfg.msrun.master_addr or ip0)
        port = self.cfg.msrun.master_port or free_port(LOOPBACK if host == LOOPBACK else "", outside_ephemeral=True)
        return host, port

    def pids(self) -> dict[int, int]:
        return {i["node"]: i["pid"] for i in self.infos}

    # ---- while the ranks run ------------------------------------------------------------------
    def start_telemetry(self, rank_pids: dict[int, int], say: Callable[[str], None]) -> None:

        rpn = self.cfg.world.ranks_per_node
        for n, agent in enumerate(self.agents):
            pids = {r: p for r, p in rank_pids.items() if r // rpn == n}
            try:
                res = waits.get(agent.start_telemetry.remote(pids), 60, self.interrupted, "the telemetry")
                if res.get("source") is None and self.cfg.monitor.telemetry_interval_s > 0:
                    say(f"mindpulse: no telemetry on {res['node']}: {res.get('reason')}")
            except Exception as exc:  # telemetry is optional: the run goes on without it, said once
                say(f"mindpulse: node agent {n} did not start telemetry: {exc}")

    def dump_stacks(self, pids: dict[int, int], logs_dir: str, ready: list[int],
                    say: Callable[[str], None]) -> None:
        """Every node dumps its own ranks' stacks into `logs_dir`."""
        import ray

        rpn = self.cfg.world.ranks_per_node
        for n, agent in enumerate(self.agents):
            if n in self.lost:
                continue
            mine = {r: p for r, p in pids.items() if r // rpn == n}
            try:
                ray.get(agent.dump_stacks.remote(mine, logs_dir, ready), timeout=90)
            except Exception as exc:  # a diagnostic that failed must not stop the run's end: said
                say(f"mindpulse: stack dump on node {n} failed: {exc}")

    def saving_now(self, ckpt_dir: str) -> dict[str, Any] | None:
        """Rank 0's save-in-progress marker as node 0's agent reads it (rank 0 writes on its own
        host): None without one, else {"step", "pid", "started", "alive"}; {"error": why}
        when the agent does not answer within a few seconds."""
        import ray

        if not self.agents:
            return {"error": "no node agent"}
        try:
            return ray.get(self.agents[0].saving_now.remote(ckpt_dir), timeout=5)
        except Exception as exc:  # an unanswered question is reported in the answer itself
            return {"error": f"node 0's agent did not answer ({type(exc).__name__})"}

    def kill_ranks(self) -> None:
        """msrun backend: each agent kills its msrun's process group (no wait: all at once)."""
        for n, a in enumerate(self.agents):
            if n in self.lost:
                continue
            try:
                a.kill_ranks.remote()
            except Exception:  # best effort kill: an agent already gone has no ranks left
                pass

    # ---- the end ------------------------------------------------------------------------------
    def flush(self, kill: bool) -> int:
        """Last telemetry sample, relay flushed to the aggregator; returns packets dropped (or
        never acknowledged)."""
        return sum(end.get("dropped", 0) + end.get("lost", 0) for end in self._stop_all(kill))

    def shutdown(self) -> None:
        """Stop every agent (killing what it started: msrun, the scheduler) and the actor."""
        self._stop_all(kill=True, release=True)

    def _stop_all(self, kill: bool, release: bool = False) -> list[dict[str, Any]]:
        """Ask every agent to stop, wave by wave (`_stop_waves`), each wave's agents at once;
        returns the ends that came back. `release`: each wave's actors are killed once it stopped."""
        import ray

        ends = []
        for wave in self._stop_waves():
            refs = []
            for a in wave:
                try:
                    # at the end (`release`) the ranks were told to end: one still running is killed
                    refs.append(a.stop.remote(kill=kill, end_ranks=release))
                except Exception:  # an agent already gone has nothing to flush: the others still end
                    pass
            for ref in refs:
                try:
                    ends.append(ray.get(ref, timeout=20))
                except Exception:  # an agent that does not answer is left out of the ends, the others still count
                    pass
            for a in wave if release else ():
                try:
                    ray.kill(a, no_restart=True)
                except Exception:  # best effort cleanup: the actor may be gone already
                    pass
        return ends

    def kill(self, grace_s: float = 3.0) -> None:
        """End every agent within `grace_s` (an interrupted start). Each is asked to stop,
        all at once, so an agent that runs msrun or the scheduler ends their process groups
        (msrun's ranks among them); one that is still starting would answer only after its
        start, so after `grace_s` every agent is killed. What a killed agent started directly
        gets SIGKILL from the kernel when its process dies."""
        import ray

        asked = []
        for a in self.agents:
            try:
                asked.append(a.stop.remote(kill=True))
            except Exception:  # best effort: the agents are killed just below anyway
                pass
        if asked:
            try:
                ray.wait(asked, num_returns=len(asked), timeout=grace_s)
            except Exception:  # best effort: the agents are killed just below anyway
                pass
        for a in self.agents:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # best effort cleanup: the actor may be gone already
                pass

    def release(self) -> None:
        """Give the placement group's cards back (the next attempt reserves them again)."""
        from ray.util.placement_group import remove_placement_group

        if self.pg is None:
            return
        try:
            remove_placement_group(self.pg)
        except Exception:  # best effort cleanup: Ray frees the group with the job anyway
            pass
        self.pg = None
