"""Survive faults with real processes: a killed rank, a stopped (hung) rank, a killed launcher."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import NO_REPORT, ROOT, _run_processes, last_steps, mindpulse_cmd

from mindpulse.rundir.metrics_store import read_wire

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


class LiveRun:
    def __init__(self, tmp_path: Path, *args: str):
        self.out = tmp_path / "runs"
        self.before = set(_run_processes())
        self.proc = subprocess.Popen(mindpulse_cmd() + ["launch", "--set", f"output.root={self.out}",
                                                        "--set", "monitor.per_print_step=100", *NO_REPORT, *args],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)

    @property
    def run_dir(self) -> Path | None:
        dirs = list(self.out.iterdir()) if self.out.exists() else []
        return dirs[0] if dirs else None

    def wait_for_step(self, step: int, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            steps = last_steps(self.run_dir) if self.run_dir else {}
            if len(steps) >= 2 and min(steps.values()) >= step:
                return
            if self.proc.poll() is not None:
                pytest.fail(f"the run ended early:\n{self.proc.stdout.read()[-3000:]}")
            time.sleep(0.3)
        pytest.fail(f"the run never reached step {step}")

    def rank_pid(self, rank: int) -> int:
        text = (self.run_dir / "logs" / f"rank_{rank}.log").read_text(errors="replace")
        return int(re.search(rf"\[rank {rank}\] pid (\d+) starting", text).group(1))

    def finish(self, timeout: float) -> tuple[int, str, float]:
        t0 = time.time()
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, _ = self.proc.communicate()
            pytest.fail(f"the launcher did not exit within {timeout}s:\n{out[-3000:]}")
        return self.proc.returncode, out, time.time() - t0

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    def assert_nothing_left(self, extra_pids=()) -> None:
        time.sleep(2)
        s = self.summary()
        pids = list((s["pids"].get("ranks") or {}).values()) + list(extra_pids)
        tdir = s["pids"].get("ray_temp_dir") or "\0"
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        alive += [p for p, c in _run_processes().items() if p not in self.before and tdir in c]
        for p in alive:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        assert not alive, f"processes left behind: {alive}"


# the launcher must exit within 15 s of the kill
@pytest.mark.exclusive
def test_sigkill_of_rank_1_names_it_as_root_cause(tmp_path):
    run = LiveRun(tmp_path, "--set", "train.steps=200", "--set", "checkpoint.save_checkpoint_steps=2")
    run.wait_for_step(3)
    victim = run.rank_pid(1)
    os.kill(victim, signal.SIGKILL)
    code, out, seconds = run.finish(timeout=60)
    assert code == 1, out[-3000:]
    assert seconds < 15, f"the launcher took {seconds:.1f}s to exit after the kill"
    s = run.summary()
    f = s["failure"]
    assert s["status"] == "failed" and f["kind"] == "crash" and f["root_cause_rank"] == 1, f
    assert 1 in f["ranks"] and f["step"] >= 3
    assert "root cause rank 1" in out
    run.assert_nothing_left([victim])
    # the last checkpoint loads
    import mindspore as ms

    man = json.loads((run.run_dir / "checkpoints" / "manifest.json").read_text())
    newest = max(man["files"], key=lambda e: e["step"])
    params = ms.load_checkpoint(str(run.run_dir / "checkpoints" / newest["path"]))
    assert int(params["step"].asnumpy()) == newest["step"]


# the hang limit (10 s) is wall-clock time
@pytest.mark.exclusive
def test_sigstop_of_rank_1_is_reported_as_a_hang_with_stacks(tmp_path):
    run = LiveRun(tmp_path, "--set", "train.steps=300", "--set", "monitor.hang_timeout_s=10")
    run.wait_for_step(2)
    victim = run.rank_pid(1)
    os.kill(victim, signal.SIGSTOP)
    try:
        code, out, seconds = run.finish(timeout=10 + 10 + 60)
    finally:
        try:
            os.kill(victim, signal.SIGKILL)
        except OSError:
            pass
    assert code == 1, out[-3000:]
    s = run.summary()
    f = s["failure"]
    assert f["kind"] == "hang" and f["ranks"] == [1] and f["root_cause_rank"] == 1, f
    assert "HANG" in out and "stuck ranks [1]" in out
    # py-spy read both, the stopped one too: each stack is inside the training loop
    assert_in_training_loop(run.run_dir, 0)
    assert_in_training_loop(run.run_dir, 1)
    run.assert_nothing_left([victim])


TRAINING_LOOP_FRAME = re.compile(r"^\s+(Model\.)?_train_process \(.*mindspore/train/model\.py:\d+\)$", re.M)
"""py-spy's line for MindSpore's step loop (Model._train_process), which the recipe runs in."""


def assert_in_training_loop(run_dir: Path, rank: int) -> str:
    """py-spy's dump of the rank's Python stacks holds a frame of its training loop (not only
    the `rank R pid P` header the launcher writes itself); returns the dump."""
    text = (run_dir / "logs" / f"stacks_rank_{rank}.txt").read_text()
    assert TRAINING_LOOP_FRAME.search(text), f"rank {rank}'s stack dump shows no training loop frame:\n{text[-3000:]}"
    return text


# the hang is named 25-29 s after the last progress (auto limit on CPU ranks)
@pytest.mark.exclusive
def test_an_injected_hang_names_the_blocked_rank_not_the_one_waiting_for_it(tmp_path):
    """hang@1:12 on ~1.5 s steps (slow@1:1), under the default `monitor.hang_timeout_s: auto`:
    rank 1 blocks at step 12 with its heartbeat alive; rank 0 waits for it inside step 12 (its
    all-reduce). Only rank 1 is named, with stacks, within 70 s (auto on CPU ranks: 25 s, before
    MindSpore's CPU all-reduce gives up on the stuck peer at 30 s)."""
    run = LiveRun(tmp_path, "--set", "train.steps=300", "--inject", "slow@1:1", "--inject", "hang@1:12")
    code, out, seconds = run.finish(timeout=300)
    assert code == 1, out[-3000:]
    f = run.summary()["failure"]
    assert f["kind"] == "hang" and f["ranks"] == [1] and f["root_cause_rank"] == 1, f
    assert "stuck ranks [1] at steps [11]" in out and "heartbeats silent" not in out, out[-3000:]
    named = re.search(r"HANG: no rank made progress for (\d+)s", out)
    assert named and 25 <= int(named.group(1)) <= 29, out[-3000:]
    assert "(monitor.hang_timeout_s: auto)" in run.summary()["message"], run.summary()["message"]
    waiting = assert_in_training_loop(run.run_dir, 0)
    blocked = assert_in_training_loop(run.run_dir, 1)
    # the blocked rank is in the fault, before its step; the other one is inside the step
    assert re.search(r"^\s+(FaultInjector\.)?before_step \(.*workers/faults\.py:\d+\)$", blocked, re.M), blocked[-3000:]
    assert "workers/faults.py" not in waiting, waiting[-3000:]
    run.assert_nothing_left()


# a 4 s hang limit beside an 8 s write: a step slowed by another launch would be a hang
@pytest.mark.exclusive
def test_a_checkpoint_write_longer_than_the_hang_limit_is_not_a_hang(tmp_path):
    """slow_save@0:10: rank 0's best checkpoint at step 10 takes 8 s, twice the hang limit, while
    rank 1 waits in the next all-reduce: rank 0's heartbeat says it is saving, so no hang."""
    run = LiveRun(tmp_path, "--set", "train.steps=14", "--set", "monitor.hang_timeout_s=4",
                  "--inject", "slow_save@0:10")
    code, out, seconds = run.finish(timeout=300)
    assert code == 0, out[-3000:]
    s = run.summary()
    assert s["status"] == "succeeded" and s["steps_completed"] == 14 and s["failure"] is None, s["message"]
    # the clock scales a step's parts down to the wall time between its packets when they add up to
    # more (they are measured on each rank's own clock): a few ms off the 8 s write
    assert s["goodput"]["badput_s"]["checkpoint"] >= 8.0 * 0.99, s["goodput"]
    assert "injecting fault slow_save@0:10" in (run.run_dir / "logs" / "rank_0.log").read_text()
    run.assert_nothing_left()


# max_restarts after an injected crash: tests/integration/test_anomalies_checkpoints.py, with safetensors


RULE = "anomalies=[{rule: threshold, name: loss_high, metric: loss, op: '>', threshold: 100.0, action: warn}]"


def rules_cmd(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(mindpulse_cmd() + ["rules", str(run_dir), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_the_aggregator_killed_mid_run_loses_no_step_takes_a_rule_change_then_sigterm_is_like_ctrl_c(tmp_path):
    """One running job, what can happen to it in turn: the aggregator SIGKILLed at step 3 (Ray
    restarts it, it rebuilds itself from metrics.msgpack, no step is lost); a rule changed
    with `mindpulse rules` on the restarted aggregator (applied from the next reduced step, and
    a lowered loss threshold fires there); then SIGTERM to the launcher, as Ctrl-C: every rank
    stops after the same step, rank 0 saves `last`, exit 130, nothing left running."""
    run = LiveRun(tmp_path, "--set", "train.steps=200", "--set", RULE)
    run.wait_for_step(3)
    pid = json.loads((run.run_dir / "pids.json").read_text())["aggregator"]
    os.kill(pid, signal.SIGKILL)
    run.wait_for_step(7)
    listed = rules_cmd(run.run_dir)
    assert listed.returncode == 0, listed.stderr
    assert re.search(r"loss_high\s+threshold\s+warn\s+yes\s+metric=loss op=> threshold=100.0", listed.stdout), \
        listed.stdout
    bad = rules_cmd(run.run_dir, "set", "loss_high.threshold=abc")
    assert bad.returncode == 2 and "loss_high.threshold: 'abc' is not allowed; use a number" in bad.stderr
    changed = rules_cmd(run.run_dir, "set", "loss_high.threshold=0.01")
    assert changed.returncode == 0, changed.stdout + changed.stderr
    m = re.search(r"set loss_high\.threshold: 100\.0 -> 0\.01, from step (\d+) on", changed.stdout)
    assert m, changed.stdout
    applied_from = int(m.group(1))
    assert applied_from < 200, "the job was still running"
    deadline = time.time() + 120  # the warning is on record: now SIGTERM
    jsonl = run.run_dir / "anomalies.jsonl"
    while not (jsonl.exists() and "loss_high" in jsonl.read_text()) and time.time() < deadline:
        time.sleep(0.3)
    run.proc.send_signal(signal.SIGTERM)
    code, out, _ = run.finish(timeout=300)
    assert code == 130, out[-3000:]
    s = run.summary()
    assert s["status"] == "interrupted" and s["stop"]["rule"] == "interrupt", s["stop"]
    # every rank stopped after the same step, and rank 0 saved `last` of that step
    stopped = {x["last_step"] for x in s["ranks"]}
    assert len(stopped) == 1 and 7 <= min(stopped) < 200, f"ranks stopped at different steps: {s['ranks']}"
    last = stopped.pop()
    assert last_steps(run.run_dir) == {0: last, 1: last}
    man = json.loads((run.run_dir / "checkpoints" / "manifest.json").read_text())
    assert [f["step"] for f in man["files"] if f["kind"] == "last"] == [last], man["files"]
    # no step lost while the aggregator restarted
    seen = {(o["rank"], o["step"]) for o in read_wire(run.run_dir / "metrics.msgpack") if o.get("t") == "step"}
    missing = [(r, st) for r in range(2) for st in range(last + 1) if (r, st) not in seen]
    assert not missing, f"steps lost while the aggregator restarted: {missing}"
    assert s["packets"]["aggregator_restarts"] >= 1
    assert s["packets"]["dropped"] == 0, f"packets dropped while the aggregator restarted: {s['packets']}"
    assert "aggregator restarted" in out
    # the changed rule fired at the step the change applied from, and the change is on record
    firings = [a for a in json.loads((run.run_dir / "anomalies.json").read_text()) if a["rule"] == "loss_high"]
    assert [(a["step"], a["threshold"]) for a in firings] == [(applied_from, 0.01)], firings
    (c,) = s["rule_changes"]
    assert (c["step"], c["op"], c["rule"], c["field"], c["old"], c["new"]) == (
        applied_from, "set", "loss_high", "threshold", 100.0, 0.01), c
    assert c["command"] == "set loss_high.threshold=0.01" and c["time"] > s["started"]
    assert re.search(rf"RULE CHANGE at [\d-]+ [\d:]+, from step {applied_from} on: set loss_high\.threshold", out)
    # a finished run's rules do not change
    late = rules_cmd(run.run_dir, "set", "loss_high.threshold=5")
    assert late.returncode == 2 and "has finished (interrupted)" in late.stderr, late.stderr
    run.assert_nothing_left()


def test_msrun_names_the_crashed_rank_not_the_nodes_lowest(run_cli):
    """msrun's node fails as a whole, and msrun's own verdict names the lowest rank it finds
    dead: the root cause comes from each rank's own exit status and first error."""
    r = run_cli("launch", "--set", "backend=msrun", "--set", "train.steps=8", "--inject", "crash@1:3",
                "--set", "monitor.per_print_step=100", timeout=400)
    assert r.returncode == 1, r.output
    f = r.summary["failure"]
    assert f["kind"] == "crash" and f["root_cause_rank"] == 1 and f["exit_code"] == 1, f
    assert f["error"] == "RuntimeError: injected crash (crash@1:3) in rank 1 at step 3", f
    assert "injected crash" in f["traceback"] and "[rank 1] finished with exit code 1" in f["log_tail"]
    assert f["errors"] == [{"error": f["error"], "ranks": [1]}], f
    ranks = {x["rank"]: x for x in r.summary["ranks"]}
    assert ranks[1]["exit_code"] == 1 and ranks[0]["exit_code"] is None, ranks
    assert "stopped after another rank failed" in ranks[0]["error"]
    assert "root cause rank 1" in r.stdout
    assert (r.run_dir / "logs" / "mindformers" / "rank_1" / "info.log").exists(), "msrun's ranks lost LOG_MF_PATH"
    # msrun killed rank 0 and then waited for its scheduler, which waits for the killed rank's
    # heartbeats to time out: the node agent ended both instead of waiting
    msrun_log = (r.run_dir / "logs" / "msrun_node0.log").read_text(errors="replace")
    assert "kill all other workers" in msrun_log and "ending msrun and its scheduler now" in msrun_log, \
        msrun_log[-3000:]
