"""A step metric is declared once, in the metric registry (mindpulse/registry/metrics.py), and every view
shows it: a synthetic count, `probe_count`, declared by one `StepMetric` and nothing else, is
reported by the ranks' code to their `RankSession.record` by name, and found on the console,
in TensorBoard, on `/metrics`, in `summary.json` and in the report (a count, not seconds). The
registry is read when the packet codec and the views are imported, so the metric is declared in
a fresh interpreter before anything else of mindpulse is imported; the ranks' sessions, the
aggregator, its sinks, the summary and the report run there as they do in a launch, without
Ray."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent('''
    import json, sys, time, urllib.request
    from pathlib import Path

    import mindpulse.registry.metrics as m

    # the one declaration
    m.STEP_METRICS = m.STEP_METRICS + (m.StepMetric(
        "probe_count", int, 0, doc="Probes this rank counted in this step.",
        reduce=(m.Reduction("probe_count", m.Reduce.SUM, "Probes counted in the step, summed over ranks.",
                            tb="probe/count", total="probe_count", total_words="counted probes",
                            prom=("probe_count", "sum")),),
        rank_tb="probe_count", rank_prom=("probe_count", "rank"),
        column=m.Column("probes", lambda p, red: str(p.probe_count), lambda red: f"all:{red.probe_count}"),
        source=m.Source.CALLER),)

    from mindpulse.aggregator.core import AggregatorCore
    from mindpulse.config import from_dict
    from mindpulse.launcher.rundir import write_config
    from mindpulse.launcher.spec import RankOutcome, RunResult, RunStatus
    from mindpulse.launcher.summary import RunHistory, write_summary
    from mindpulse.workers.channel import Channel
    from mindpulse.workers.session import RankSession


    class ToCore(Channel):
        """A rank's channel straight into the aggregator's core (a launch's relay and uplink
        in between carry the same packets)."""

        def _ship(self, batch, step=None):
            core.ingest(list(batch))

        def _decide(self, batch, step, expect):
            core.ingest(list(batch))
            return core.directive_for(step)

        def _fetch_lease(self, need):
            return core.lease(), 0.0

    root, port = Path(sys.argv[1]), int(sys.argv[2])
    run_dir = root / "run"
    cfg = from_dict({"name": "probe", "world": {"nodes": 1, "ranks_per_node": 2}, "train": {"steps": 3},
                     "output": {"root": str(root), "report": True}})
    core = AggregatorCore(run_dir, world_size=2, per_print_step=1, total_steps=3, settings={
        "tensorboard": True, "exporters": {"prometheus": {"port": port}}, "monitor": {"collect_freq": 1}})
    t0 = time.time() - 60
    ranks = [RankSession(None, rank=r, channel=ToCore(), batch_size=4) for r in range(2)]
    for s in range(1, 4):
        for r, rank in enumerate(ranks):
            rank.record(1.0 / s, step_time_s=0.1, probe_count=s + r)  # the rank's code reports it by name
    for rank in ranks:
        rank.channel.flush()
    console = core.drain_console()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        scraped = resp.read().decode()
    snap = core.snapshot()
    core.close()
    (run_dir / "logs").mkdir()
    write_config(run_dir, cfg)
    said = []
    ok = RunResult(RunStatus.SUCCEEDED, {r: RankOutcome(r, exit_code=0) for r in range(2)})
    write_summary(cfg, run_dir, ok, snap, RunHistory(logs_dir=run_dir / "logs"), {}, t0, said.append)
    print(json.dumps({"console": console, "metrics": scraped, "said": said}))
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_metric_declared_once_shows_in_every_view(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(_free_port())], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, f"the run with the synthetic metric failed:\n{proc.stderr[-4000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    run_dir = Path(tmp_path) / "run"
    # the console: the registry's column, each rank's cell and the cluster's (steps 1..3: 1+2, 2+3, 3+4)
    table = next(t for t in out["console"] if t.startswith("step 3/3"))
    assert "probes" in table and "all:7" in table, table
    # TensorBoard: the cluster's tag and each rank's
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"probe/count", "rank_0/probe_count", "rank_1/probe_count"} <= set(tags), tags
    assert [e.value for e in acc.Scalars("probe/count")] == [3.0, 5.0, 7.0]
    # /metrics: the cluster's series and each rank's, with the help text the metric's doc gives
    text = out["metrics"]
    assert 'mindpulse_probe_count{node="",rank="",run="run",stat="sum"} 7.0' in text, text
    assert 'mindpulse_probe_count{node="0",rank="1",run="run",stat="rank"} 4.0' in text, text
    assert "# HELP mindpulse_probe_count Probes counted in the step, summed over ranks." in text, text
    # summary.json: the run total (3 + 5 + 7)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["probe_count"] == 15, summary
    # the report (and the console's end summary): the total as a count, not seconds
    page = (run_dir / "report" / "report.html").read_text()
    assert "ranks counted probes 15 in all" in page, "the total is not in the report"
    said = "\n".join(out["said"])
    assert "ranks counted probes 15 in all" in said and "15.000 s" not in said, said


def test_a_total_is_written_in_its_metric_unit():
    from mindpulse.registry.metrics import total_words, with_unit

    assert with_unit(0.18, "s") == "0.180 s"
    assert with_unit(15, "") == "15" and with_unit(15.0, "") == "15", "a count is no duration"
    assert with_unit(12.5, "TFLOPS") == "12.5 TFLOPS"
    assert with_unit(None, "s") == "-" and with_unit(None, "") == "-"
    assert {(key, unit) for key, _, unit in total_words()} >= {("monitor_wait_s", "s"), ("monitor_self_s", "s")}
