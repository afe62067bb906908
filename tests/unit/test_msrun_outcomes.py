"""The msrun backend's per-rank outcomes: each rank's own exit status and first error from
msrun's output and the rank logs, the rank that failed first as the root cause (not the
node's lowest rank). The log lines are msrun 2.9's and the entry point's, as a real run on
this machine wrote them (`--inject crash@1:3`, and a SIGKILL of rank 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mindpulse.config import from_dict
from mindpulse.launcher.failures import VICTIM, FailureKind, describe_failure
from mindpulse.launcher.msrun_logs import node_outcomes, parse_msrun_log, parse_rank_log, read_node_outcomes
from mindpulse.launcher.worker_group import MsrunWorkerGroup, OwnerKind, RefOwner

RUN = "/runs/x"
MSRUN_HEAD = f"""$ /venv/bin/msrun --worker_num=2 --local_worker_num=2 --master_addr=127.0.0.1 --master_port=39651 --node_rank=0
Start scheduler process, log file:{RUN}/logs/scheduler.log. Execute command: python -m mindpulse.workers.rank_main --job {RUN}/job.json
Start worker process with rank id:0, log file:{RUN}/logs/rank_0.log. Environment variable [RANK_ID=0] is exported. Execute command: python -m mindpulse.workers.rank_main --job {RUN}/job.json
Start worker process with rank id:1, log file:{RUN}/logs/rank_1.log. Environment variable [RANK_ID=1] is exported. Execute command: python -m mindpulse.workers.rank_main --job {RUN}/job.json
[WARNING] ME(11590:139755565882240,MainProcess):2026-12-01-08:25:26.708.000 [mindspore/parallel/cluster/process_entity/_api.py:274] Distributed job is spawned. Waiting all processes to exit...
"""  # noqa: E501


def died(pid: int, code: int, ts: str = "2026-12-01-08:26:03.744.000") -> str:
    return (f"[ERROR] ME(11590:139755565882240,MainProcess):{ts} [mindspore/parallel/cluster/process_entity/"
            f"_api.py:364] Worker process {pid} exit with exception. Error code: {code}.\n"
            "[WARNING] ME(11590:139755565882240,MainProcess):2026-12-01-08:26:03.744.000 [mindspore/parallel/cluster/"
            "process_entity/_api.py:369] There's worker exits with exception, kill all other workers.\n")


def rank_log(rank: int, pid: int, *, crash: str | None = None, code: int | None = None) -> str:
    text = (f"[rank {rank}] pid {pid} starting\n"
            f"[WARNING] DISTRIBUTED({pid},7f47231beb80,python):2026-12-01-08:25:41.323.547 [mindspore/ccsrc/cluster/"
            f"topology/cluster_context.cc:428] PostProcess] This node {rank} rank id: {rank}\n"
            f"[ERROR] ME({pid}:139943508437888,MainProcess):2026-12-01-08:25:53.490.000 [mindspore/runtime/"
            "device.py:25] CPU device is not supported. Please use correct device\n")
    if crash:
        text += ("Traceback (most recent call last):\n"
                 '  File "/work/main/workers/rank_main.py", line 51, in run_job\n'
                 "    llama_finetune.main(settings)\n"
                 '  File "/work/main/workers/faults.py", line 93, in before_step\n'
                 '    raise RuntimeError(f"injected crash ({f}) in rank {self.rank} at step {step}")\n'
                 f"{crash}\n\n")
    if code is not None:
        text += f"[rank {rank}] finished with exit code {code} after 30.2s\n"
    return text


CRASH_1 = "RuntimeError: injected crash (crash@1:3) in rank 1 at step 3"


def test_msrun_log_says_what_it_started():
    ms = parse_msrun_log(MSRUN_HEAD + died(11652, 1))
    assert sorted(ms.workers) == [0, 1]
    assert ms.workers[1].log == f"{RUN}/logs/rank_1.log"
    assert ms.workers[1].command == f"python -m mindpulse.workers.rank_main --job {RUN}/job.json"
    assert ms.scheduler_command == ms.workers[0].command
    assert [(pid, code) for pid, code, _ in ms.died] == [(11652, 1)] and ms.died[0][2] is not None
    assert ms.killed_others


def test_a_rank_log_gives_its_pid_exit_code_and_first_error():
    log = parse_rank_log(rank_log(1, 11652, crash=CRASH_1, code=1), 1)
    assert (log.pid, log.exit_code, log.error) == (11652, 1, CRASH_1)
    assert log.traceback.startswith("Traceback") and "faults.py" in log.traceback
    assert parse_rank_log(rank_log(0, 11650), 0).exit_code is None  # killed: it never said


def test_a_crashed_rank_is_the_root_cause_and_the_one_msrun_killed_its_victim():
    outs = node_outcomes([0, 1], 1, MSRUN_HEAD + died(11652, 1),
                         {0: rank_log(0, 11650), 1: rank_log(1, 11652, crash=CRASH_1, code=1)},
                         {0: 100.0, 1: 120.0})
    assert [o.rank for o in outs] == [1, 0]
    assert (outs[0].exit_code, outs[0].error, outs[0].pid) == (1, CRASH_1, 11652)
    assert (outs[1].exit_code, outs[1].error) == (None, VICTIM)
    f = describe_failure({o.rank: o for o in outs}, [o.rank for o in outs], Path("/nonexistent"), {0: 2, 1: 2})
    assert f["root_cause_rank"] == 1 and f["exit_code"] == 1 and "injected crash" in f["traceback"]
    assert f["errors"] == [{"error": CRASH_1, "ranks": [1]}]


def test_a_rank_killed_by_a_signal_is_named_by_msrun_status():
    outs = node_outcomes([0, 1], 1, MSRUN_HEAD + died(18962, -9), {0: rank_log(0, 18960), 1: rank_log(1, 18962)})
    assert [o.rank for o in outs] == [1, 0]
    assert outs[0].exit_code == -9 and "SIGKILL" in outs[0].error and outs[1].error == VICTIM
    f = describe_failure({o.rank: o for o in outs}, [1, 0], Path("/nonexistent"), {})
    assert f["root_cause_rank"] == 1 and f["signal"] == "SIGKILL"


def test_of_two_ranks_that_failed_the_first_to_fail_is_the_root_cause_not_the_lowest():
    # rank 1 crashed; rank 0 failed afterwards in the collective, and exited first in msrun's
    # poll order (it names the lowest local rank it finds dead)
    victim = "RuntimeError: Connection reset by peer"
    outs = node_outcomes([0, 1], 1, MSRUN_HEAD + died(11650, 1),
                         {0: rank_log(0, 11650, crash=victim, code=1), 1: rank_log(1, 11652, crash=CRASH_1, code=1)},
                         {0: 130.0, 1: 120.0})
    assert [o.rank for o in outs] == [1, 0]
    assert outs[0].error == CRASH_1 and outs[1].error == victim


def test_clean_end_and_logs_that_cannot_be_read():
    outs = node_outcomes([0, 1], 0, MSRUN_HEAD, {0: rank_log(0, 1, code=0), 1: rank_log(1, 2, code=0)})
    assert [(o.rank, o.exit_code, o.error) for o in outs] == [(0, 0, ""), (1, 0, "")]
    # another host's logs are not here: msrun's status, as before
    outs = node_outcomes([2, 3], 1, None, {}, node=1)
    assert [(o.rank, o.exit_code, o.error) for o in outs] == [(2, 1, "msrun on node 1 exited 1"),
                                                                (3, 1, "msrun on node 1 exited 1")]


def test_a_clean_exit_msrun_saw_crash_at_teardown_keeps_msruns_status():
    outs = node_outcomes([0, 1], 1, MSRUN_HEAD + died(11652, -11),
                         {0: rank_log(0, 11650), 1: rank_log(1, 11652, code=0)})
    assert outs[0].rank == 1 and outs[0].exit_code == -11 and "SIGSEGV" in outs[0].error


def test_the_msrun_worker_group_reports_each_rank_root_cause_first(tmp_path, monkeypatch):
    """Through the worker group, as the supervision loop collects a node's end."""
    import ray

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "msrun_node0.log").write_text(MSRUN_HEAD + died(11652, 1))
    (logs / "rank_0.log").write_text(rank_log(0, 11650))
    (logs / "rank_1.log").write_text(rank_log(1, 11652, crash=CRASH_1, code=1))
    monkeypatch.setattr(ray, "get", lambda ref, **kw: {"node": 0, "exit_code": 1, "seconds": 9.0, "pid": 7})
    group = MsrunWorkerGroup(from_dict({"backend": "msrun"}), None, logs, None, print)
    outs = group.outcomes(object(), RefOwner(OwnerKind.NODE, 0))
    assert [o.rank for o in outs] == [1, 0] and outs[0].error == CRASH_1 and outs[1].error == VICTIM
    assert read_node_outcomes(logs, [0, 1], 1, 0)[0].rank == 1
    f = describe_failure({o.rank: o for o in outs}, [o.rank for o in outs], logs, {0: 2, 1: 2}, FailureKind.CRASH)
    assert f["root_cause_rank"] == 1 and f["log_tail"].startswith("[rank 1] pid 11652 starting")


@pytest.mark.parametrize("code", [0, 2])
def test_a_rank_that_reported_its_own_exit_keeps_it(code):
    outs = node_outcomes([0], code, MSRUN_HEAD, {0: rank_log(0, 5, code=code)})
    assert outs[0].exit_code == code and (outs[0].error == "" if code == 0 else outs[0].error == "exit code 2")


def test_the_agents_log_scanner_finds_msruns_give_up_line_across_reads(tmp_path):
    """The node agent reads msrun's log as msrun appends to it; the line may arrive in pieces."""
    from mindpulse.frameworks.msrun_text import KILLED_OTHERS
    from mindpulse.node.msrun_output import LogScanner

    log = tmp_path / "msrun_node0.log"
    scan = LogScanner(str(log), KILLED_OTHERS)
    assert not scan.found()  # no file yet
    log.write_text("$ msrun --worker_num=2\nStart worker process with rank id:0 ...\n")
    assert not scan.found()
    cut = len(KILLED_OTHERS) // 2
    with log.open("a") as f:
        f.write("[WARNING] ME(1:2,MainProcess): " + KILLED_OTHERS[:cut])
    assert not scan.found()
    with log.open("a") as f:
        f.write(KILLED_OTHERS[cut:] + "\n")
    assert scan.found()
    # a log that only mentions a worker's failure is not msrun giving up
    other = tmp_path / "other.log"
    other.write_text("Worker process 12 exit with exception. Error code: 1.\n")
    assert not LogScanner(str(other), KILLED_OTHERS).found()
