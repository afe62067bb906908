"""A lost node and a lost link, told apart from a rank's crash (launcher/node_health.py):
the probe of each node's raylet, the watch's verdicts, the failure block that names the node
and its ranks, the log tail without the lines every healthy rank prints, the stop of the
other ranks, and the restart refused when too few hosts are left."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mindpulse.config import from_dict
from mindpulse.launcher import controller as controller_mod
from mindpulse.launcher import node_health
from mindpulse.launcher.failures import (
    VICTIM,
    FailureKind,
    describe_failure,
    failure_kind,
    format_failure,
    without_common_lines,
)
from mindpulse.launcher.node_health import NodeEndpoint, NodeWatch, Reach, describe_loss, endpoints, probe_all
from mindpulse.launcher.progress import Console
from mindpulse.launcher.spec import RankOutcome, RunResult, RunStatus
from mindpulse.launcher.supervision import AttemptWatch, Interrupts

CPU_LINE = ("[ERROR] ME({pid}:{tid},MainProcess):2026-12-06-06:{m}:12.{ms} [mindspore/context.py:1] "
            "CPU device is not supported")


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_probe_tells_a_listener_from_a_refusal():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    try:
        got = probe_all([("127.0.0.1", srv.getsockname()[1]), ("127.0.0.1", _closed_port())], timeout=1)
    finally:
        srv.close()
    assert got == [Reach.UP, Reach.REFUSED]


def test_endpoints_take_the_raylet_port_and_address_from_rays_table():
    infos = [{"node": 0, "host": "a", "ip": "x", "node_id": "n0"}, {"node": 1, "host": "b", "ip": "y", "node_id": "n1"}]
    table = [{"NodeID": "n0", "NodeManagerAddress": "198.18.0.1", "NodeManagerPort": 4000},
             {"NodeID": "n1", "NodeManagerAddress": "198.18.0.2", "NodeManagerPort": 4001}]
    eps = endpoints(infos, table, ranks_per_node=2)
    assert [(e.address, e.port, e.ranks) for e in eps] == [("198.18.0.1", 4000, [0, 1]), ("198.18.0.2", 4001, [2, 3])]


def _watch(monkeypatch, reach: list[Reach], **kw) -> NodeWatch:
    monkeypatch.setattr(node_health, "probe_all", lambda targets, timeout=0: list(reach))
    nodes = [NodeEndpoint(0, "head", "198.18.0.1", "n0", 1, [0, 1]),
             NodeEndpoint(1, "w1", "198.18.0.2", "n1", 1, [2, 3])]
    return NodeWatch(nodes, **kw)


def test_a_refusing_raylet_is_a_lost_node_at_once(monkeypatch):
    lost = _watch(monkeypatch, [Reach.UP, Reach.REFUSED]).check(now=10.0)
    assert [(x["node"], x["host"], x["address"], x["ranks"], x["kind"]) for x in lost] == \
        [(1, "w1", "198.18.0.2", [2, 3], "node_lost")]


def test_ray_reporting_a_node_dead_is_a_lost_node(monkeypatch):
    lost = _watch(monkeypatch, [Reach.UP, Reach.UP]).check(now=1.0, dead_ids={"n1"})
    assert [x["kind"] for x in lost] == ["node_lost"] and "Ray reports" in lost[0]["how"]


def test_an_unanswered_node_is_a_lost_link_only_once_it_lasts(monkeypatch):
    w = _watch(monkeypatch, [Reach.UP, Reach.UNREACHABLE], link_lost_after_s=4.0)
    assert w.check(now=100.0) == []
    assert w.check(now=102.0) == []
    lost = w.check(now=104.5)
    assert [(x["node"], x["kind"]) for x in lost] == [(1, "link_lost")] and "partition" in lost[0]["how"]
    # a rank already failed: the unanswered node is named at once
    assert _watch(monkeypatch, [Reach.UP, Reach.UNREACHABLE]).check(now=5.0, at_failure=True)[0]["kind"] == "link_lost"


def test_a_node_that_answers_again_starts_its_clock_over(monkeypatch):
    w = _watch(monkeypatch, [Reach.UP, Reach.UNREACHABLE], link_lost_after_s=4.0)
    w.check(now=0.0)
    monkeypatch.setattr(node_health, "probe_all", lambda targets, timeout=0: [Reach.UP, Reach.UP])
    w.check(now=2.0)
    monkeypatch.setattr(node_health, "probe_all", lambda targets, timeout=0: [Reach.UP, Reach.UNREACHABLE])
    assert w.check(now=5.0) == []


def _lost(kind: str = "node_lost") -> list[dict]:
    return [{"node": 1, "host": "w1", "address": "198.18.0.2", "node_id": "n1", "ranks": [2, 3], "kind": kind,
             "how": "its Ray node is gone (its raylet refuses connections)"}]


def _logs(d: Path) -> None:
    for r in range(4):
        lines = [f"[rank {r}] pid {100 + r} starting", CPU_LINE.format(pid=100 + r, tid=7 * r, m=r, ms=r * 3),
                 f"step 9 loss 2.{r}"]
        if r == 2:
            lines.append("rank 2 was writing step 10 when its host went")
        (d / f"rank_{r}.log").write_text("\n".join(lines) + "\n")


def test_the_failure_names_the_node_and_its_ranks_not_a_rank_crash(tmp_path):
    _logs(tmp_path)
    outcomes = {0: RankOutcome(0, None, VICTIM), 1: RankOutcome(1, None, VICTIM),
                2: RankOutcome(2, None, "went with node 1 (w1, 198.18.0.2): node_lost"),
                3: RankOutcome(3, None, "went with node 1 (w1, 198.18.0.2): node_lost")}
    result = RunResult(RunStatus.FAILED, outcomes, describe_loss(_lost()), [2, 3], lost=_lost())
    assert failure_kind(result) is FailureKind.NODE_LOST
    f = describe_failure(outcomes, [2, 3], tmp_path, {0: 10, 1: 10, 2: 10, 3: 9}, failure_kind(result),
                         message=result.message, lost=result.lost)
    assert f["kind"] == "node_lost" and f["nodes"][0]["host"] == "w1" and f["ranks"] == [2, 3]
    assert f["root_cause_rank"] is None and f["step"] == 10 and f["signal"] is None
    assert "node 1 (w1, 198.18.0.2) lost with ranks [2, 3]" in f["error"]
    assert "CPU device is not supported" not in f["log_tail"]  # every healthy rank prints it
    assert "writing step 10" in f["log_tail"] and "[rank 2] pid 102 starting" in f["log_tail"]
    text = format_failure(f)
    assert text.startswith("FAILED (node_lost): node lost after step 10")
    assert "node 1 (w1, 198.18.0.2): ranks [2, 3] went with it" in text and "RpcError" not in text
    link = describe_failure(outcomes, [2, 3], tmp_path, {}, FailureKind.LINK_LOST, lost=_lost("link_lost"))
    assert format_failure(link).startswith("FAILED (link_lost): link lost (network partition)")
    assert failure_kind(RunResult(RunStatus.FAILED, outcomes, lost=_lost("link_lost"))) is FailureKind.LINK_LOST


def test_a_crash_tail_leaves_out_what_healthy_ranks_print_too(tmp_path):
    _logs(tmp_path)
    (tmp_path / "rank_1.log").write_text(CPU_LINE.format(pid=5, tid=6, m=1, ms=2) + "\nValueError: boom\n")
    outcomes = {0: RankOutcome(0, None, VICTIM), 1: RankOutcome(1, 1, "ValueError: boom")}
    f = describe_failure(outcomes, [1], tmp_path, {1: 3})
    assert f["kind"] == "crash" and f["root_cause_rank"] == 1
    assert f["log_tail"] == "ValueError: boom"
    # no healthy rank to compare with: the tail is kept whole
    assert "CPU device" in without_common_lines(CPU_LINE.format(pid=1, tid=1, m=1, ms=1), [tmp_path / "none.log"])


class _Say:
    def __init__(self):
        self.lines: list[str] = []
        self.progress = SimpleNamespace(clear=lambda: None)

    def say(self, text: str) -> None:
        self.lines.append(text)


def test_the_watch_stops_every_other_rank_and_forgets_the_lost_agent(monkeypatch):
    killed = []
    attempt = SimpleNamespace(nodes=SimpleNamespace(lost=set(), infos=[]),
                              group=SimpleNamespace(rank_pids={2: 42}), kill_ranks=lambda: killed.append(1))
    console = _Say()
    cfg = from_dict({"world": {"nodes": 2, "ranks_per_node": 2}})
    watch = AttemptWatch(cfg, attempt, {}, Interrupts(), console, 0.0)  # type: ignore[arg-type]
    watch.outcomes[3] = RankOutcome(3, None, "rank process died: The actor is unavailable: RpcError Socket closed")
    watch.failure_order = [3]
    assert watch._end_lost(_lost()) is RunStatus.FAILED
    res = watch.result()
    assert killed and attempt.nodes.lost == {1} and res.lost == _lost()
    assert res.outcomes[0].error == VICTIM and res.outcomes[1].error == VICTIM
    assert res.outcomes[3].error.startswith("went with node 1 (w1, 198.18.0.2)") and res.outcomes[2].pid == 42
    assert res.order == [2, 3] and "node 1 (w1, 198.18.0.2) lost with ranks [2, 3]" in res.message
    assert any("stopping the other ranks" in ln for ln in console.lines)


@pytest.mark.parametrize("left, restarts", [(1, False), (2, True)])
def test_a_lost_node_restarts_only_with_enough_hosts_left(monkeypatch, tmp_path, left, restarts):
    monkeypatch.setattr(node_health, "hosts_left", lambda resource, rpn, lost_ids: left)
    cfg = from_dict({"max_restarts": 1, "world": {"nodes": 2, "ranks_per_node": 2}})
    ctl = controller_mod.Controller(cfg, run_dir=tmp_path, run_id="r", session=None, resume=None,
                                    pids=SimpleNamespace(), console=Console(sys.stdout), interrupts=Interrupts(),
                                    started=0.0)
    ctl.result = RunResult(RunStatus.FAILED, {}, describe_loss(_lost()), lost=_lost())
    assert ctl._enough_hosts_left() is restarts
    if not restarts:
        assert "the job needs 2 hosts with 2 CPU each and 1 is left" in ctl.result.message


def test_a_large_job_probes_its_nodes_in_turn_and_all_at_a_failure(monkeypatch):
    monkeypatch.setattr(node_health, "PROBE_BATCH", 2)
    probed: list[list[int]] = []
    monkeypatch.setattr(node_health, "probe_all", lambda targets, timeout=0: (
        probed.append([p for _, p in targets]) or [Reach.UP] * len(targets)))
    nodes = [NodeEndpoint(i, f"h{i}", "198.18.0.9", f"n{i}", 100 + i, [i]) for i in range(5)]
    w = NodeWatch(nodes)
    for t in range(3):
        w.check(now=float(t))
    assert probed == [[100, 101], [102, 103], [104, 100]]
    w.check(now=9.0, at_failure=True)
    assert probed[-1] == [100, 101, 102, 103, 104]


def test_probes_go_in_batches():
    port = _closed_port()
    assert probe_all([("127.0.0.1", port)] * 300, timeout=1) == [Reach.REFUSED] * 300


def test_the_bundle_on_the_drivers_host_is_node_0():
    from mindpulse.launcher.node_agents import driver_first

    assert driver_first(["w1", "head", "w2"], "head") == [1, 0, 2]
    assert driver_first(["head", "w1"], "head") == [0, 1]
    assert driver_first(["w1", "w2"], "head") == [0, 1]  # the driver's host holds no rank
