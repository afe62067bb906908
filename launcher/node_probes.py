"""Run one function on every node that may host this config's ranks, the way its ranks run there.

- **A Ray cluster** (`ray.address`): one Ray task per alive node with the cards a node of the
  job needs (`world.ranks_per_node` of the device's resource: where the attempt's placement
  group may put a node's ranks), pinned to it (a hard node affinity), all at once. The task
  runs in a Ray worker of that node: the interpreter and environment a rank actor gets, and
  msrun's too (the node agent runs msrun beside that interpreter). The task asks for no CPU,
  so it runs beside whatever the cluster is doing.
- **The embedded one-machine cluster** (empty `ray.address`): its Ray workers run this
  process's interpreter with this process's environment, so the function runs here, in a
  thread: that is the ranks' launch path on one machine, without starting a cluster for it.

Each node's call gets the ranks' environment (the first rank of a node's `RankSpec.env`: the
config's `env:`, the device visibility and MindSpore's variables), as keyword `env`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mindpulse.config import RunConfig

PROBE_WAIT_S = 180.0
"""How long the driver waits for every node's answer (a node that does not answer is a failure)."""


@dataclass
class NodeAnswer:
    """One node's answer: the function's result, or why there is none."""

    name: str
    """How the node is named to the user: its address (and host name) on a Ray cluster, `local`."""
    result: Any = None
    error: str = ""


def rank_env(cfg: RunConfig) -> dict[str, str]:
    """The environment a node's first rank is given on top of its Ray worker's (what
    `mindpulse plan` prints): the probe reads the frameworks with it."""
    from .spec import rank_specs

    return dict(rank_specs(cfg)[0].env)


def eligible_nodes(cfg: RunConfig) -> list[dict[str, Any]]:
    """The alive Ray nodes with a node's worth of the job's device resource."""
    import ray

    from .node_agents import DEVICE_RESOURCE

    key = DEVICE_RESOURCE[cfg.world.device.value]
    need = float(cfg.world.ranks_per_node)
    return [n for n in ray.nodes() if n.get("Alive") and float(n.get("Resources", {}).get(key, 0)) >= need]


def node_name(node: dict[str, Any]) -> str:
    host = node.get("NodeManagerHostname", "")
    addr = node.get("NodeManagerAddress", "")
    return f"{addr} ({host})" if host and host != addr else (addr or node.get("NodeID", "?")[:12])


class LocalCall:
    """The embedded cluster's call, started now in a thread (it may run while Ray starts).
    `fn` is given `on_start` among its keywords: it hands over the process it starts, which
    `cancel` ends (a launch refused before it waited for the answer leaves nothing running)."""

    def __init__(self, fn: Callable[[dict[str, Any]], Any], kwargs: dict[str, Any]):
        import socket

        self.answer = NodeAnswer(name=f"{socket.gethostname()} (this machine)")
        self._procs: list[Any] = []
        self._thread = threading.Thread(target=self._run, args=(fn, dict(kwargs, on_start=self._procs.append)),
                                        name="mindpulse-node-probe", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        """End the call's process if it still runs (its process group: the ranks' Python and its children)."""
        import os
        import signal

        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:  # it ended meanwhile
                    pass
        self._thread.join(5)

    def _run(self, fn: Callable[[dict[str, Any]], Any], kwargs: dict[str, Any]) -> None:
        try:
            self.answer.result = fn(kwargs)
        except Exception as exc:  # the probe's own failure is this node's answer, said to the user
            self.answer.error = f"{type(exc).__name__}: {exc}"

    def wait(self, timeout: float = PROBE_WAIT_S) -> list[NodeAnswer]:
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.answer.error = f"no answer within {timeout:g} s"
        return [self.answer]


def call_local(fn: Callable[[dict[str, Any]], Any], kwargs: dict[str, Any]) -> LocalCall:
    return LocalCall(fn, kwargs)


def call_on_nodes(cfg: RunConfig, fn: Callable[[dict[str, Any]], Any], kwargs: dict[str, Any],
                  timeout: float = PROBE_WAIT_S) -> list[NodeAnswer]:
    """`fn(kwargs)` on every eligible node of the connected Ray cluster, in parallel.
    `fn` must be importable on the nodes (a module-level function of mindpulse)."""
    import time

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = eligible_nodes(cfg)
    task = ray.remote(fn)
    refs = {task.options(num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False), name="mindpulse-node-probe").remote(kwargs): n for n in nodes}
    names = [node_name(n) for n in refs.values()]
    # nodes that share an address (several Ray nodes on one host) are told apart by their id
    answers = {ref: NodeAnswer(name=name if names.count(name) == 1 else f"{name} [{n['NodeID'][:8]}]")
               for (ref, n), name in zip(refs.items(), names)}
    deadline = time.time() + timeout
    pending = list(refs)
    while pending and time.time() < deadline:
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=min(1.0, max(0.0, deadline - time.time())))
        for ref in done:
            try:
                answers[ref].result = ray.get(ref)
            except Exception as exc:  # the task died on its node: that node's answer, said to the user
                answers[ref].error = f"the probe task failed: {str(exc).splitlines()[0] if str(exc) else exc}"
    for ref in pending:
        answers[ref].error = f"no answer within {timeout:g} s"
        ray.cancel(ref, force=True)
    return list(answers.values())
