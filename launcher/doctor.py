"""`mindpulse doctor [CONFIG]`, and the same check at the start of `launch`.

For every node that may host the config's ranks (launcher/node_probes.py: a pinned Ray task
per node on a Ray cluster, this machine for the embedded one) the node probe
(mindpulse/frameworks/framework_probe.py) reports what the ranks there will find, and
launcher/framework_check.py judges it against the supported ranges. `doctor` prints one
table per node with the fixes and exits 0 when everything fits, 2 when something does not;
it runs MindSpore's one-op smoke test too. `launch` runs the probe without the smoke test
(the ranks are the smoke test), once per node and in parallel, inside the Ray session
before any rank starts; on the embedded cluster the probe starts before Ray does and runs
while it starts. A node that does not fit refuses the launch (exit 2) before anything else
starts, naming the node, what was found, the range and the fix, and pointing to `doctor`.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from mindpulse.config import RunConfig

from .framework_check import DEVICE_PLUGIN, Level, Verdict, failures, judge, mindformers_source
from .node_probes import LocalCall, NodeAnswer, call_local, call_on_nodes, rank_env
from .preflight import LaunchRefused


def probe_kwargs(cfg: RunConfig, smoke: bool) -> dict[str, Any]:
    return {"env": rank_env(cfg), "backend": cfg.backend.value, "device_target": DEVICE_PLUGIN[cfg.world.device],
            "smoke": smoke, "mindformers_source": mindformers_source(cfg)}


def start(cfg: RunConfig, smoke: bool = False) -> LocalCall | None:
    """The embedded cluster's probe, started now (it runs while Ray starts); None on a Ray
    cluster, whose nodes are probed once connected (`answers`)."""
    from mindpulse.frameworks.framework_probe import probe_node_dict

    return call_local(probe_node_dict, probe_kwargs(cfg, smoke)) if not cfg.ray.address else None


def answers(cfg: RunConfig, local: LocalCall | None, smoke: bool = False) -> list[NodeAnswer]:
    """Every node's probe: the local one's answer, or (connected to a Ray cluster) each eligible node's."""
    from mindpulse.frameworks.framework_probe import probe_node_dict

    if local is not None:
        return local.wait()
    import ray

    from .preflight import check_cluster

    # a cluster without the cards the job needs is refused as the attempt refuses it (naming
    # the resource and the count), not as nodes without an answer
    check_cluster(cfg, ray.cluster_resources(), [n for n in ray.nodes() if n.get("Alive")])
    return call_on_nodes(cfg, probe_node_dict, probe_kwargs(cfg, smoke))


def verdicts(cfg: RunConfig, got: list[NodeAnswer]) -> list[tuple[NodeAnswer, list[Verdict]]]:
    from mindpulse.frameworks.framework_probe import NodeProbe

    out = []
    for a in got:
        if a.error or a.result is None:
            out.append((a, [Verdict(a.name, "probe", Level.FAIL, a.error or "no answer", "the node's answer",
                                    "check that the node is up and its Ray worker can start Python")]))
        else:
            out.append((a, judge(cfg, NodeProbe.from_dict(a.result), a.name)))
    if not got:
        out.append((NodeAnswer(name="(none)"), [Verdict("(none)", "nodes", Level.FAIL, "no alive node in the Ray "
                    f"cluster has {cfg.world.ranks_per_node} {cfg.world.device.value} slot(s)",
                    f"{cfg.world.nodes} node(s)", "start Ray on the nodes that hold the cards")]))
    return out


def format_node(answer: NodeAnswer, rows: list[Verdict]) -> str:
    from tabulate import tabulate

    probe = answer.result or {}
    head = f"node {answer.name}" + (f" (host {probe.get('host')})" if probe.get("host") and probe.get("host")
                                    not in answer.name else "")
    table = tabulate([[v.item, v.level.value, v.found, v.wanted, v.fix] for v in rows],
                     headers=["what", "verdict", "found", "wanted", "fix"], tablefmt="simple", maxcolwidths=[
                         None, None, 60, 24, 60], disable_numparse=True)
    return f"{head}\n{table}"


def refusal(judged: list[tuple[NodeAnswer, list[Verdict]]], config_hint: str) -> str:
    """The launch's message: every failing row (node, what was found, the range, the fix)."""
    lines = [f"node {v.node}: {v.item} {v.found}" + (f" (supported: {v.wanted})" if v.wanted else "")
             + (f"; fix: {v.fix}" if v.fix else "") for _, rows in judged for v in failures(rows)]
    return ("the ranks' environment does not fit this job, so no rank was started:\n  " + "\n  ".join(lines)
            + f"\nrun `mindpulse doctor {config_hint}` to see everything each node has")


def gate(cfg: RunConfig, local: LocalCall | None, console: Any, config_hint: str) -> None:
    """`launch`'s check, inside the Ray session before any rank starts: raises LaunchRefused
    when a node does not fit; warnings are said and the launch goes on."""
    import time

    t0 = time.time()
    judged = verdicts(cfg, answers(cfg, local))
    if any(failures(rows) for _, rows in judged):
        raise LaunchRefused(refusal(judged, config_hint))
    for _, rows in judged:
        for v in rows:
            if v.level is Level.WARN:
                console.say(f"mindpulse: WARNING node {v.node}: {v.item} {v.found}" + (f"; {v.fix}" if v.fix else ""))
    found = ", ".join(sorted({str(a.result.get("mindspore", {}).get("version")) for a, _ in judged if a.result}))
    console.say(f"mindpulse: framework check: {len(judged)} node(s) fit (mindspore {found}; "
                f"{time.time() - t0:.1f} s waited)")


def doctor_command(cfg: RunConfig, config_hint: str, as_json: bool = False) -> int:
    """`mindpulse doctor`: 0 when every node fits, 2 when one does not (or the cluster cannot be reached)."""
    from .ray_session import RaySession
    from .spec import ExitCode

    out = sys.stderr if as_json else sys.stdout
    try:
        if cfg.ray.address:
            print(f"mindpulse: probing the nodes of the Ray cluster at {cfg.ray.address} ...", file=out, flush=True)
            with RaySession(cfg):
                got = answers(cfg, None, smoke=True)
        else:
            print("mindpulse: probing this machine (the embedded cluster's ranks run this Python) ...", file=out,
                  flush=True)
            got = answers(cfg, start(cfg, smoke=True), smoke=True)
    except LaunchRefused as exc:
        print(f"mindpulse: {exc}", file=sys.stderr, flush=True)
        return int(ExitCode.USAGE)
    judged = verdicts(cfg, got)
    bad = [v for _, rows in judged for v in failures(rows)]
    if as_json:
        print(json.dumps({"ok": not bad, "nodes": [{"name": a.name, "probe": a.result, "error": a.error,
                                                    "verdicts": [v.to_dict() for v in rows]} for a, rows in judged]},
                         indent=2), flush=True)
    else:
        w = cfg.world
        print(f"{cfg.name}: {w.nodes} node(s) x {w.ranks_per_node} {w.device.value} rank(s), backend "
              f"{cfg.backend.value}; {len(judged)} node(s) probed\n", file=out)
        for a, rows in judged:
            print(format_node(a, rows) + "\n", file=out)
        warn = sum(v.level is Level.WARN for _, rows in judged for v in rows)
        print(f"mindpulse doctor: {'every node fits this job' if not bad else f'{len(bad)} problem(s)'}"
              + (f", {warn} warning(s)" if warn else ""), file=out, flush=True)
    return int(ExitCode.SUCCESS if not bad else ExitCode.USAGE)
