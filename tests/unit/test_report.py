"""Offline report: real packets in a real run directory → PNG plots and a self-contained HTML page."""

from __future__ import annotations

import json
import math
import re

import pytest

from mindpulse.aggregator.reducer import reduce_all
from mindpulse.protocol import EventPacket, StepPacket, TelemetryPacket
from mindpulse.views.report import PLOT_NAMES, build_report, final_tables

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
WORLD = 2
STEPS = 12
T0 = 1_700_000_000.0


def _step(rank: int, step: int, **kw) -> StepPacket:
    loss = kw.pop("loss", 3.0 / step + 0.1 * rank)
    return StepPacket(rank=rank, step=step, loss=loss, lr=1e-4, grad_norm=2.0 + 0.1 * step,
                      grad_norm_local=1.0 + rank + 0.05 * step, step_time_s=0.2 + 0.02 * rank,
                      samples=16, ts=T0 + step, fingerprint=f"fp-{step // 4}" if step % 4 == 0 else None, **kw)


def _stream(steps: int = STEPS, world: int = WORLD, telemetry: bool = True) -> list:
    out: list = [EventPacket(rank=r, kind="start", ts=T0, pid=1000 + r, host="node-a") for r in range(world)]
    out += [StepPacket(rank=r, step=0, fingerprint="fp-0", ts=T0) for r in range(world)]
    for s in range(1, steps + 1):
        out += [_step(r, s) for r in range(world)]
        if telemetry and s % 3 == 0:
            out.append(TelemetryPacket(node="node-a", ts=T0 + s + 0.5, source="npu-smi", cards=[
                {"card": c, "util_pct": 50.0 + s + c, "memory_used_mb": 20000.0 + 10 * s,
                 "memory_total_mb": 65536.0, "power_w": 200.0 + c, "temp_c": None if c else 60.0}
                for c in range(2)]))
    return out


def _write_metrics(run_dir, packets, tail: bytes = b"") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.msgpack").write_bytes(b"".join(p.encode() for p in packets) + tail)


ANOMALIES = [
    {"rule": "loss_spike", "step": 5, "rank": 1, "value": 9.5, "threshold": 3.0, "action": "warn",
     "message": "loss jumped <x3>"},
    {"rule": "grad_explosion", "step": 9, "rank": None, "value": 1e6, "threshold": 1e4, "action": "stop",
     "message": "global grad norm too large"},
]
CHECKPOINTS = [
    {"path": "checkpoints/step_4.ckpt", "step": 4, "metric": 0.91, "kind": "best", "size": 1234,
     "sha256": "ab" * 32},
    {"path": "checkpoints/step_12.ckpt", "step": 12, "metric": 0.4, "kind": "last", "size": 1234,
     "sha256": "cd" * 32},
]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full") / "run"
    _write_metrics(run_dir, _stream())
    (run_dir / "summary.json").write_text(json.dumps({
        "status": "anomaly_stop", "exit_code": 3, "name": "demo-run", "world_size": WORLD,
        "steps_completed": STEPS, "first_loss": 3.05, "last_loss": 0.3, "best_loss": 0.3,
        "stop": {"rule": "grad_explosion", "step": 9, "message": "global grad norm too large"},
        "ranks": [{"rank": r, "last_step": STEPS, "exit_code": 0, "param_fingerprint": "fp-3",
                   "host": "node-a", "pid": 1000 + r} for r in range(WORLD)],
        "packets": {"accepted": 100, "rejected": 0},
    }))
    (run_dir / "anomalies.json").write_text(json.dumps(ANOMALIES))
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "manifest.json").write_text(json.dumps({"files": CHECKPOINTS}))
    (run_dir / "config.yaml").write_text("name: demo-run\ntrain:\n  steps: 12\n  note: '<b>raw</b>'\n")
    for r in range(WORLD):
        (run_dir / "profile" / f"rank_{r}").mkdir(parents=True)
    result = build_report(run_dir)
    return run_dir, result


def _assert_png(path):
    data = open(path, "rb").read()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > 5000, (path, len(data))
    # width and height from the IHDR chunk
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 400 and height >= 200


def test_result_dict(full_run):
    run_dir, result = full_run
    assert result["out_dir"] == str(run_dir / "report")
    assert result["html"] == str(run_dir / "report" / "report.html")
    assert [p.rsplit("/", 1)[-1] for p in result["plots"]] == list(PLOT_NAMES)
    # step 0 (fingerprints) and steps 1..12 all complete
    assert result["steps"] == len(reduce_all([p for p in _stream() if isinstance(p, StepPacket)], WORLD))
    assert result["steps"] == STEPS + 1
    assert result["world_size"] == WORLD


def test_plots_are_valid_pngs(full_run):
    _, result = full_run
    for path in result["plots"]:
        _assert_png(path)


def test_html_is_self_contained_and_complete(full_run):
    run_dir, result = full_run
    page = open(result["html"], encoding="utf-8").read()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == len(PLOT_NAMES)
    assert not re.search(r'(src|href)="https?:', page)  # nothing fetched from outside
    assert "anomaly_stop" in page and "demo-run" in page
    for a in ANOMALIES:
        assert a["rule"] in page
    assert "loss jumped &lt;x3&gt;" in page  # escaped, not markup
    for c in CHECKPOINTS:
        assert c["path"] in page and c["sha256"] in page
    assert re.search(r"<td>4</td><td>best</td>", page) and re.search(r"<td>12</td><td>last</td>", page)
    assert "steps: 12" in page and "&lt;b&gt;raw&lt;/b&gt;" in page
    assert 'href="../profile/rank_0/"' in page and 'href="../profile/rank_1/"' in page
    assert "fp-3" in page  # the last fingerprint in the final cluster table


def test_final_tables_text(full_run):
    run_dir, _ = full_run
    text = final_tables(run_dir)
    assert "anomaly_stop" in text
    assert "loss_spike" in text and "grad_explosion" in text
    assert "step_12.ckpt" in text
    lines = [ln.split() for ln in text.splitlines()]
    assert ["0", str(STEPS)] in [ln[:2] for ln in lines] and ["1", str(STEPS)] in [ln[:2] for ln in lines]


def test_crashed_run_without_summary_and_torn_tail(tmp_path):
    run_dir = tmp_path / "crashed"
    packets = _stream(steps=8, world=3, telemetry=False)
    # rank 2 died before step 8: step 8 is incomplete; the last record is torn mid-write
    packets = [p for p in packets if not (isinstance(p, StepPacket) and p.rank == 2 and p.step == 8)]
    torn = _step(0, 9).encode()[:-7]
    # a NaN on one rank must not break the plots
    packets.append(_step(1, 9, loss=math.nan))
    _write_metrics(run_dir, packets, tail=torn)
    out = tmp_path / "elsewhere"
    result = build_report(run_dir, out_dir=out)
    assert result["out_dir"] == str(out)
    assert result["world_size"] == 3  # inferred from the packets
    assert result["steps"] == 8  # steps 0..7 complete
    for path in result["plots"]:
        _assert_png(path)
    page = (out / "report.html").read_text()
    assert "summary.json is missing" in page
    assert page.count("data:image/png;base64,") == len(PLOT_NAMES)
    text = final_tables(run_dir)
    assert "unknown" in text and "no summary.json" in text


def test_empty_metrics_says_no_data(tmp_path):
    run_dir = tmp_path / "empty"
    run_dir.mkdir()
    (run_dir / "metrics.msgpack").write_bytes(b"")
    result = build_report(run_dir)
    assert result["steps"] == 0 and result["world_size"] == 0
    for path in result["plots"]:
        assert open(path, "rb").read(8) == PNG_SIGNATURE
    page = open(result["html"], encoding="utf-8").read()
    assert "No data" in page
    assert "no anomalies recorded" in page and "no checkpoints recorded" in page
    assert "no data" in final_tables(run_dir).lower()


def test_damaged_optional_files_are_reported_not_fatal(tmp_path):
    run_dir = tmp_path / "damaged"
    _write_metrics(run_dir, _stream(steps=3))
    (run_dir / "summary.json").write_text("{not json")
    (run_dir / "anomalies.json").write_text(json.dumps({"unexpected": True}))
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "manifest.json").write_text(json.dumps([1, 2]))
    result = build_report(run_dir)
    page = open(result["html"], encoding="utf-8").read()
    assert "summary.json could not be read" in page
    assert result["steps"] == 4 and result["world_size"] == WORLD


def test_damaged_bytes_are_skipped_and_noted(tmp_path):
    run_dir = tmp_path / "damaged-middle"
    packets = _stream(steps=6)
    blob = bytearray(b"".join(p.encode() for p in packets))
    at = len(b"".join(p.encode() for p in packets[:7]))
    blob[at] = 0xC1  # the map header of one step packet: never valid msgpack
    run_dir.mkdir()
    (run_dir / "metrics.msgpack").write_bytes(bytes(blob))
    result = build_report(run_dir)
    assert result["steps"] == 6  # the damaged packet's step is incomplete; every later one is read
    page = open(result["html"], encoding="utf-8").read()
    assert re.search(r"metrics.msgpack: \d+ damaged byte\(s\) skipped in 1 stretch\(es\)", page)
    assert "1 stretch(es)" in final_tables(run_dir)
