"""A file the head had but a rank's node lacks, end to end: a real launch whose script is
removed once the head's checks passed (as on a host that does not share the folder). Every
rank stops at its start naming `job.script`, the path and its node, the run fails as `input`
and is not restarted (a restart would find the same file missing)."""

from __future__ import annotations

import json
import socket
import subprocess
import time

import psutil
import pytest
from conftest import NO_REPORT, ROOT, _run_processes, mindpulse_cmd, run_leftovers, run_pids

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def test_a_script_missing_where_the_ranks_run_is_named_with_its_node_and_not_restarted(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script ran: the rank-start check did not stop it')\n")
    out = tmp_path / "runs"
    before = set(_run_processes())
    proc = subprocess.Popen(mindpulse_cmd() + ["launch", "--set", f"job.script={script}", "--set", "max_restarts=1",
                                               "--set", f"output.root={out}", "--set", "preflight.enabled=false",
                                               *NO_REPORT],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    run_dir = None
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("mindpulse: run directory "):
                # the head's checks passed; Ray, the node agents and the ranks start after this line
                script.unlink()
                run_dir = out / line.split()[-1].rsplit("/", 1)[-1]
                break
        rest, _ = proc.communicate(timeout=300)
        text = "".join(lines) + rest
        assert run_dir is not None, text
        assert proc.returncode == 1, text
        summary = json.loads((run_dir / "summary.json").read_text())
        failure = summary["failure"]
        assert failure["kind"] == "input", failure
        where = f"on node 0 ({socket.gethostname()})"
        assert [g["ranks"] for g in failure["errors"]] == [[0, 1]], failure["errors"]
        assert failure["errors"][0]["error"].startswith(f"InputMissing: job.script: {script} does not exist {where}")
        assert "FAILED (input): a file the config names is missing where ranks run" in text, text
        assert "the script ran" not in text
        assert len(summary["attempts"]) == 1, f"an input failure was restarted: {summary['attempts']}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        deadline = time.time() + 20
        left = run_leftovers(before, run_dir, run_pids(run_dir))
        while left and time.time() < deadline:
            time.sleep(0.5)
            left = run_leftovers(before, run_dir, run_pids(run_dir))
        for pid in left:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        assert not left, f"processes left running after the launcher exited: {left}"
