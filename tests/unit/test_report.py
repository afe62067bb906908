"""Offline report: real packets in a real run directory → PNG plots, a self-contained HTML page
that reads at a glance (status and why, the figures that matter, checkpoint links, the anomaly
timeline linked to the plots' markers, the raw data folded away) and the same summary as text."""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import statistics
from html.parser import HTMLParser

import pytest

from mindpulse.aggregator.core import AggregatorCore
from mindpulse.reduction.reducer import reduce_all
from mindpulse.views.report import PLOT_NAMES, build_report, final_tables, headline, load_run
from mindpulse.wire.protocol import EventPacket, StepPacket, TelemetryPacket

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
WORLD = 2
STEPS = 12
T0 = 1_700_000_000.0
EPOCH_NUMBER = re.compile(r"\b1[5-9]\d{8}(\.\d+)?\b")
"""An epoch time in seconds (2017..2033) printed as a number."""


def _step(rank: int, step: int, **kw) -> StepPacket:
    loss = kw.pop("loss", 3.0 / step + 0.1 * rank + (0.5 if step == STEPS else 0.0))  # the best is not the last
    return StepPacket(rank=rank, step=step, loss=loss, lr=1e-4, grad_norm=2.0 + 0.1 * step,
                      grad_norm_local=1.0 + rank + 0.05 * step, step_time_s=0.2 + 0.02 * rank,
                      samples=16, ts=T0 + step, fingerprint=f"fp-{step // 4}" if step % 4 == 0 else None, **kw)


def _stream(steps: int = STEPS, world: int = WORLD, telemetry: bool = True) -> list:
    out: list = [EventPacket(rank=r, kind="start", ts=T0, pid=1000 + r, host="node-a") for r in range(world)]
    out += [StepPacket(rank=r, step=0, fingerprint="fp-0", ts=T0) for r in range(world)]
    for s in range(1, steps + 1):
        out += [_step(r, s) for r in range(world)]
        if telemetry and s % 3 == 0:
            # an accelerator node: utilization, memory and power measured, temperature on card 0 only
            out.append(TelemetryPacket(node="node-a", ts=T0 + s + 0.5, source="npu-smi", cards=[
                {"card": c, "util_pct": 50.0 + s + c, "memory_used_mb": 20000.0 + 10 * s,
                 "memory_total_mb": 65536.0, "power_w": 200.0 + c, "temp_c": None if c else 60.0}
                for c in range(2)]))
    return out


def _write_metrics(run_dir, packets, tail: bytes = b"") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.msgpack").write_bytes(b"".join(p.encode() for p in packets) + tail)


def _checkpoints(run_dir, records: list[dict]) -> None:
    """A manifest as rank 0 writes it (bare file names), with the files it names."""
    ckpt = run_dir / "checkpoints"
    ckpt.mkdir(parents=True, exist_ok=True)
    for c in records:
        (ckpt / c["path"]).write_bytes(b"\0" * c["size"])
    best = [c for c in records if c["kind"] == "best"]
    body = {"version": 1, "files": records}
    if best:
        body["best"] = max(best, key=lambda c: c["time"])
    (ckpt / "manifest.json").write_text(json.dumps(body))


ANOMALIES = [
    {"rule": "loss_spike", "step": 5, "rank": 1, "value": 9.5, "threshold": 3.0, "action": "warn",
     "message": "loss jumped <x3>"},
    {"rule": "grad_explosion", "step": 9, "rank": None, "value": 1e6, "threshold": 1e4, "action": "stop",
     "message": "global grad norm too large"},
]
CHECKPOINTS = [
    {"path": "step_00000004-best.ckpt", "step": 4, "epoch": 1, "metric": 0.91, "metric_name": "loss", "kind": "best",
     "size": 3 * 1024 * 1024 // 2, "sha256": "ab" * 32, "time": T0 + 4},
    {"path": "step_00000012-last.ckpt", "step": 12, "epoch": 1, "metric": 0.4, "metric_name": "loss", "kind": "last",
     "size": 2048, "sha256": "cd" * 32, "time": T0 + 12},
]
STARTED = T0 - 30.0
WALL_S = 2 * 3600 + 3 * 60 + 4.0
SUMMARY = {
    "status": "anomaly_stop", "exit_code": 3, "name": "demo-run", "world_size": WORLD,
    "steps_completed": 10, "first_loss": 3.05, "last_loss": 0.3, "best_loss": 0.3, "best_loss_step": 12,
    "stop": {"rule": "grad_explosion", "rank": None, "value": 1e6, "threshold": 1e4, "step": 10, "decided_at": 9,
             "message": "global grad norm 1e+06 > 10000 at step 9", "save_last": False},
    "best_checkpoint": {"path": "/elsewhere/run/checkpoints/step_00000004-best.ckpt", "step": 4, "metric": 0.91,
                        "metric_name": "loss"},
    "ranks": [{"rank": r, "last_step": STEPS, "exit_code": 0, "param_fingerprint": "fp-3", "host": "node-a",
               "pid": 1000 + r, "error": "", "node": 0} for r in range(WORLD)],
    "attempts": [{"attempt": 0, "status": "succeeded", "message": "", "resumed_from": None, "steps_completed": 10}],
    "packets": {"accepted": 100, "rejected": 0},
    "pids": {"ray_temp_dir": "/tmp/mindpulse-ray-xyz/ray", "ranks": {"0": 1000, "1": 1001}},
    "monitor_wait_s": 0.25, "fingerprints_equal": True,
    "started": STARTED, "wall_time_s": WALL_S, "failure": None,
}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full") / "run"
    _write_metrics(run_dir, _stream())
    (run_dir / "summary.json").write_text(json.dumps(SUMMARY))
    (run_dir / "anomalies.json").write_text(json.dumps(ANOMALIES))
    _checkpoints(run_dir, CHECKPOINTS)
    (run_dir / "config.yaml").write_text("name: demo-run\nworld:\n  nodes: 1\n  ranks_per_node: 2\n  device: ascend\n"
                                         "train:\n  steps: 12  # <b>raw</b>\n")
    for r in range(WORLD):
        (run_dir / "profile" / f"rank_{r}").mkdir(parents=True)
    result = build_report(run_dir)
    return run_dir, result


def _page(result) -> str:
    return open(result["html"], encoding="utf-8").read()


class _Ids(HTMLParser):
    """Every element's id, the hrefs of links, and the text inside each id'd element."""

    def __init__(self):
        super().__init__()
        self.ids: dict[str, str] = {}
        self.hrefs: list[str] = []
        self._open: list[tuple[str, str | None]] = []
        self.text: dict[str, str] = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids[a["id"]] = tag
            self.text.setdefault(a["id"], "")
        if tag == "a" and a.get("href"):
            self.hrefs.append(a["href"])
        if tag not in ("img", "br", "meta", "link", "input"):
            self._open.append((tag, a.get("id")))

    def handle_endtag(self, tag):
        while self._open:
            t, _ = self._open.pop()
            if t == tag:
                break

    def handle_data(self, data):
        for _, ident in self._open:
            if ident:
                self.text[ident] += data


def _parse(page: str) -> _Ids:
    p = _Ids()
    p.feed(page)
    return p


def _assert_png(path):
    data = open(path, "rb").read()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > 5000, (path, len(data))
    width, height = _png_size(path)
    assert width >= 400 and height >= 200


def _png_size(path) -> tuple[int, int]:
    data = open(path, "rb").read(24)
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _when(ts: float) -> str:
    t = dt.datetime.fromtimestamp(ts).astimezone()
    return t.strftime("%Y-%m-%d %H:%M:%S")


# ------------------------------------------------------------------------------ the files


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
    page = _page(result)
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == len(result["drawn"]) and result["drawn"], result["drawn"]
    assert not re.search(r'(src|href)="https?:', page), "the page fetches something from outside"
    assert "anomaly_stop" in page and "demo-run" in page
    for a in ANOMALIES:
        assert a["rule"] in page
    assert "loss jumped &lt;x3&gt;" in page, "a message from the run must be escaped, not markup"
    for c in CHECKPOINTS:
        assert c["path"] in page and c["sha256"] in page
    assert "steps: 12" in page and "&lt;b&gt;raw&lt;/b&gt;" in page
    assert 'href="../profile/rank_0/"' in page and 'href="../profile/rank_1/"' in page
    assert "fp-3" in page  # the last fingerprint in the ranks table


# ------------------------------------------------------------------------------ the header


def test_header_says_status_and_why_first(full_run):
    _, result = full_run
    page = _page(result)
    ids = _parse(page)
    assert ids.text["status"].strip() == "anomaly_stop"
    why = ids.text["why"]
    assert "stopped by rule grad_explosion at step 9" in why.lower() and "after step 10" in why, why
    assert ids.text["why-detail"].strip() == SUMMARY["stop"]["message"]
    # the order of the page: status, why, the figures, then the plots and tables, raw data last
    order = [page.index(f'id="{i}"') for i in ("status", "why", "figures", "plots", "anomalies", "checkpoints",
                                                "attempts", "ranks", "raw")]
    assert order == sorted(order), "the page's sections are out of order"


def test_header_figures_in_human_units(full_run):
    run_dir, result = full_run
    ids = _parse(_page(result))
    assert ids.text["wall-time"].split("WALL")[0]  # rendered
    wall = ids.text["wall-time"]
    assert "2 h 03 min" in wall, wall
    assert _when(STARTED) in wall and "→" in wall, f"start and end must be dates: {wall}"
    assert ids.text["steps"].startswith("steps") and "10 / 12" in ids.text["steps"]
    # loss: first → best (step) → last of the reduced mean, each with its step
    data = load_run(run_dir)
    means = {r.step: r.loss_mean for r in data.reduced if r.step > 0}
    best_step = min(means, key=means.get)
    loss = " ".join(ids.text["loss-figures"].split())
    assert f"{means[1]:.4f} first · step 1" in loss, loss
    assert f"{means[best_step]:.4f} best · step {best_step}" in loss, loss
    assert f"{means[STEPS]:.4f} last · step {STEPS}" in loss, loss
    sps = statistics.median(r.samples_per_s for r in data.reduced if r.step > 0)
    shown = f"{sps:,.0f}" if sps >= 100 else f"{sps:.1f}"  # whole samples from 100/s on
    assert f"{shown} samples/s" in ids.text["throughput"], ids.text["throughput"]
    world = ids.text["world"]
    assert "2 ranks" in world and "1 node × 2, ascend" in world, world
    assert "node-a/0" in world and "node-a/1" in world, f"cards must be named node/card: {world}"


def test_best_and_latest_checkpoints_are_relative_links(full_run):
    run_dir, result = full_run
    page = _page(result)
    best = re.search(r'<a id="best-checkpoint" href="([^"]+)"[^>]*>([^<]+)</a>', page)
    assert best, "no best checkpoint link in the header"
    assert best.group(1) == "../checkpoints/step_00000004-best.ckpt" and best.group(2) == "step_00000004-best.ckpt"
    assert (run_dir / "report" / best.group(1)).resolve() == (run_dir / "checkpoints" / CHECKPOINTS[0]["path"])
    ids = _parse(page)
    assert "step 4, loss 0.9100, 1.5 MiB" in ids.text["best"], ids.text["best"]
    latest = re.search(r'<a id="latest-checkpoint" href="([^"]+)"', page)
    assert latest and latest.group(1) == "../checkpoints/step_00000012-last.ckpt"
    assert "step 12, loss 0.4000, 2.0 KiB, last" in ids.text["latest"], ids.text["latest"]
    # the checkpoint table links each file too, and every row is a marker's target
    assert 'id="ckpt-4"' in page and 'id="ckpt-12"' in page
    assert page.count('href="../checkpoints/step_00000012-last.ckpt"') >= 2


def test_no_raw_json_or_epoch_numbers_before_the_raw_data(full_run):
    _, result = full_run
    page = _page(result)
    head, raw = page[:page.index('<section id="raw">')], page[page.index('<section id="raw">'):]
    assert not re.search(r'\{&quot;|\{"[a-z_]+"\s*:', head), "raw JSON outside the folded raw data"
    assert not EPOCH_NUMBER.search(re.sub(r"base64,[A-Za-z0-9+/=]+", "", head)), "an epoch time shown as a number"
    assert "ray_temp_dir" not in head and "mindpulse-ray-xyz" not in head
    # folded away at the bottom: summary.json as it is, and the resolved config
    assert re.search(r'<details id="raw-summary"><summary>summary.json</summary><pre>', raw)
    assert "&quot;ray_temp_dir&quot;: &quot;/tmp/mindpulse-ray-xyz/ray&quot;" in raw
    assert re.search(r'<details id="raw-config"><summary>config.yaml', raw)
    assert "<details open" not in page


def test_anomaly_timeline_links_to_the_plot_markers_and_back(full_run):
    _, result = full_run
    page = _page(result)
    section = page[page.index('<section id="anomalies">'):page.index('<section id="checkpoints">')]
    for key in ("marker", "step", "rule", "rank", "value", "action"):
        assert f"<th>{key}</th>" in section
    # one row per record, in step order, each step an anchor the plots link to
    rows = re.findall(r"<tr( id=\"[^\"]+\")?><td>(.*?)</td><td>(\d+)</td><td>([a-z_]+)</td>", section)
    assert [(r[2], r[3]) for r in rows] == [("5", "loss_spike"), ("9", "grad_explosion")], rows
    assert rows[0][0] == ' id="anomaly-5"' and rows[1][0] == ' id="anomaly-9"'
    assert 'href="#plot-loss"' in rows[0][1] and ">A1<" in rows[0][1]
    assert 'href="#plot-grad_norm"' in rows[1][1] and ">A2<" in rows[1][1]
    # the loss plot carries a clickable strip over each anomaly and checkpoint line
    fig = page[page.index('id="plot-loss"'):page.index("</figure>", page.index('id="plot-loss"'))]
    marks = re.findall(r'<a class="mk (\w+)" href="#([\w-]+)" title="([^"]*)"[^>]*style="left:([\d.]+)%;'
                       r'top:([\d.]+)%;height:([\d.]+)%"', fig)
    kinds = {(k, h) for k, h, *_ in marks}
    assert kinds == {("anomaly", "anomaly-5"), ("anomaly", "anomaly-9"), ("checkpoint", "ckpt-4"),
                     ("checkpoint", "ckpt-12")}, kinds
    by_href = {h: (float(left), float(top), float(height), title) for _, h, title, left, top, height in marks}
    # the strips lie inside the image, in step order from left to right
    assert all(0 < v[0] < 100 and 0 <= v[1] < 50 and 20 < v[2] <= 100 for v in by_href.values()), by_href
    assert by_href["ckpt-4"][0] < by_href["anomaly-5"][0] < by_href["anomaly-9"][0] < by_href["ckpt-12"][0]
    assert by_href["anomaly-5"][3].startswith("A1 · step 5: loss_spike rank 1 (warn)")


def test_telemetry_shows_only_what_was_measured(full_run):
    _, result = full_run
    page = _page(result)
    fig = page[page.index('id="plot-telemetry"'):page.index("</figure>", page.index('id="plot-telemetry"'))]
    # temperature is reported by card 0: four panels; nothing said missing
    assert "not reported" not in fig
    width, height = _png_size(result["plots"][PLOT_NAMES.index("telemetry.png")])
    assert height > 600, "four measured metrics make two rows of panels"


def test_a_host_without_power_and_temperature_gets_no_empty_panels(tmp_path):
    run_dir = tmp_path / "cpu"
    packets = _stream(telemetry=False)
    packets += [TelemetryPacket(node="node0-vm", ts=T0 + s, source="psutil", cards=[
        {"card": -1, "name": "cpu", "util_pct": 90.0 + s % 3, "memory_used_mb": 2000.0 + s,
         "memory_total_mb": 24000.0, "power_w": None, "temp_c": None, "source": "psutil"}]) for s in range(1, 13)]
    _write_metrics(run_dir, packets)
    result = build_report(run_dir)
    page = _page(result)
    fig = page[page.index('id="plot-telemetry"'):page.index("</figure>", page.index('id="plot-telemetry"'))]
    assert "not reported by this device (psutil): power (W), temperature (°C)" in fig
    width, height = _png_size(result["plots"][PLOT_NAMES.index("telemetry.png")])
    assert height < 500, f"two measured metrics must make one row of panels, not a 2x2 grid ({width}x{height})"
    ids = _parse(page)
    assert "node0-vm/cpu" in ids.text["world"], "the host is named node/cpu, as the console's card table names it"
    assert "node0-vm:-1" not in page


def test_a_plot_with_nothing_measured_is_a_line_not_an_empty_figure(tmp_path):
    run_dir = tmp_path / "no-grads"
    packets = [StepPacket(rank=r, step=s, loss=1.0 / (s + 1), step_time_s=0.1, samples=4, ts=T0 + s)
               for s in range(6) for r in range(WORLD)]
    _write_metrics(run_dir, packets)
    result = build_report(run_dir)
    page = _page(result)
    assert "grad_norm.png" not in result["drawn"] and "telemetry.png" not in result["drawn"]
    fig = page[page.index('id="plot-grad_norm"'):page.index("</figure>", page.index('id="plot-grad_norm"'))]
    assert "<img" not in fig and "not reported" in fig, fig
    fig = page[page.index('id="plot-telemetry"'):page.index("</figure>", page.index('id="plot-telemetry"'))]
    assert "<img" not in fig and "no card telemetry" in fig, fig
    for path in result["plots"]:  # the files are still there, saying why
        assert open(path, "rb").read(8) == PNG_SIGNATURE


def test_goodput_is_shown_only_when_the_summary_has_it(tmp_path, full_run):
    _, result = full_run
    assert 'id="goodput"' not in _page(result) and "ETTR" not in _page(result)
    run_dir = tmp_path / "goodput"
    _write_metrics(run_dir, _stream(steps=6))
    wall = 8 * 3600.0
    badput = {"restart": 1200.0, "checkpoint_save": 600.0, "startup": 480.0, "hang_detection": 30.0,
              "data_stall": 20.0, "eval": 10.0, "other": 0.0}
    unaccounted = 90.0  # the goodput accounting's own name for time between the measured parts
    productive = wall - sum(badput.values()) - unaccounted
    summary = dict(SUMMARY, status="succeeded", stop=None, steps_completed=6,
                   goodput={"wall_s": wall, "productive_s": productive, "ettr": productive / wall,
                            "badput_s": badput, "unaccounted_s": unaccounted})
    (run_dir / "summary.json").write_text(json.dumps(summary))
    res = build_report(run_dir)
    page = _page(res)
    ids = _parse(page)
    box = ids.text["goodput"]
    assert "ETTR 91.6%" in box and "productive 7 h 19 min of 8 h 00 min" in box, box
    assert "1 min 30 s unaccounted" in box
    # the largest causes first, in human units with their share; the small ones summed
    html_box = page[page.index('id="goodput"'):page.index("</section>", page.index('id="goodput"'))]
    items = [re.sub(r"<[^>]+>", "", li) for li in re.findall(r"<li>(.*?)</li>", html_box)]
    assert items == ["restart 20 min 00 s (4.2%)", "checkpoint_save 10 min 00 s (2.1%)", "startup 8 min 00 s (1.7%)",
                     "3 more 1 min 00 s (0.2%)"], items  # a zero cause is no badput
    # a bar of productive time and each cause, in proportion to the wall time
    widths = [float(w) for w in re.findall(r'<span class="g-[\w ]+" style="width:([\d.]+)%"', html_box)]
    assert widths[0] == pytest.approx(100 * productive / wall, abs=0.01)
    assert widths[1] == pytest.approx(100 * 1200 / wall, abs=0.01)
    assert sum(widths) == pytest.approx(100.0, abs=0.05)
    assert page.index('id="goodput"') < page.index('id="plots"'), "goodput belongs to the header"
    text = final_tables(run_dir)
    assert "goodput" in text and "ETTR 91.6%: productive 7 h 19 min of 8 h 00 min; badput: restart 20 min 00 s " \
        "(4.2%), checkpoint_save 10 min 00 s (2.1%), startup 8 min 00 s (1.7%), 3 more 1 min 00 s; " \
        "unaccounted 1 min 30 s" in text, text


# ----------------------------------------------------------------------------- console text


def test_console_summary_in_the_pages_order(full_run):
    run_dir, _ = full_run
    text = final_tables(run_dir)
    lines = text.splitlines()
    assert lines[0] == "run demo-run: anomaly_stop — stopped by rule grad_explosion at step 9; every rank stopped " \
                       "after step 10", lines[0]
    assert lines[1].strip() == SUMMARY["stop"]["message"]
    labels = [ln.strip().split("  ")[0] for ln in lines[2:] if ln.startswith("  ")]
    assert labels[:7] == ["wall time", "steps", "loss (mean)", "throughput", "world", "best checkpoint",
                          "latest checkpoint"], labels
    assert f"2 h 03 min  ({_when(STARTED)} → " in text
    assert not EPOCH_NUMBER.search(text), "times must be dates, not epoch numbers"
    assert "checkpoints/step_00000004-best.ckpt" in text
    assert "loss_spike" in text and "grad_explosion" in text
    assert text.index("anomalies (timeline)") < text.index("ranks\n")
    rows = [ln.split() for ln in text.splitlines()]
    assert ["0", str(STEPS)] in [ln[:2] for ln in rows] and ["1", str(STEPS)] in [ln[:2] for ln in rows]


def test_failed_run_names_the_root_cause_and_its_first_error_line(tmp_path):
    run_dir = tmp_path / "failed"
    _write_metrics(run_dir, _stream(steps=7, telemetry=False))
    tb = ("Traceback (most recent call last):\n  File \"train.py\", line 3, in <module>\n"
          "RuntimeError: injected crash (crash@1:8) in rank 1 at step 8\n")
    failure = {"kind": "crash", "root_cause_rank": 1, "ranks": [0, 1], "step": 7, "exit_code": 1, "signal": None,
               "error": "RuntimeError: injected crash (crash@1:8) in rank 1 at step 8\nmore detail",
               "log_tail": "line a\nline b", "traceback": tb,
               "errors": [{"error": "RuntimeError: injected crash (crash@1:8) in rank 1 at step 8", "ranks": [1]}]}
    (run_dir / "summary.json").write_text(json.dumps(dict(
        SUMMARY, status="failed", exit_code=1, stop=None, steps_completed=7, failure=failure, best_checkpoint=None,
        message="rank 1 failed: RuntimeError: injected crash (crash@1:8) in rank 1 at step 8")))
    result = build_report(run_dir)
    page = _page(result)
    ids = _parse(page)
    assert ids.text["status"].strip() == "failed"
    assert "Rank 1 failed at step 7 (the root cause), exit code 1" in ids.text["why"]
    assert ids.text["why-detail"].strip() == "RuntimeError: injected crash (crash@1:8) in rank 1 at step 8"
    assert "none saved" in ids.text["best"] and 'id="best-checkpoint"' not in page
    # the failure's detail, its traceback folded
    fail = page[page.index('<section id="failure">'):page.index('<section id="plots">')]
    assert "<details><summary>traceback of rank 1</summary><pre>Traceback" in fail
    text = final_tables(run_dir)
    assert text.splitlines()[0] == "run demo-run: failed — rank 1 failed at step 7 (the root cause), exit code 1"
    assert text.splitlines()[1].strip() == "RuntimeError: injected crash (crash@1:8) in rank 1 at step 8"
    assert re.search(r"\n  best checkpoint +none saved\n", text), text


def test_hang_and_interrupt_say_why(tmp_path):
    run_dir = tmp_path / "hang"
    _write_metrics(run_dir, _stream(steps=4, telemetry=False))
    failure = {"kind": "hang", "root_cause_rank": 1, "ranks": [1], "step": 4, "exit_code": None, "signal": None,
               "error": "no progress for 300 s (monitor.hang_timeout_s)", "traceback": "", "log_tail": "",
               "errors": []}
    (run_dir / "summary.json").write_text(json.dumps(dict(SUMMARY, status="failed", stop=None, failure=failure)))
    h = headline(load_run(run_dir))
    assert h.why == "hung: no progress from rank(s) 1 at step 4; root cause rank 1"
    assert h.detail == "no progress for 300 s (monitor.hang_timeout_s)"
    stop = {"rule": "interrupt", "step": 4, "decided_at": 3, "save_last": True, "message": "interrupted"}
    (run_dir / "summary.json").write_text(json.dumps(dict(SUMMARY, status="interrupted", stop=stop)))
    h = headline(load_run(run_dir))
    assert h.status == "interrupted" and h.status_class == "other"
    assert h.why == "interrupted (Ctrl-C or a signal); every rank stopped after step 4, a last checkpoint was saved"


def _aggregated(run_dir, steps, attempt: int, world: int = WORLD) -> None:
    """Packets through the real aggregator (its attempt markers and reduced records)."""
    core = AggregatorCore(run_dir, world_size=world, settings={"tensorboard": False, "attempt": attempt,
                                                               "monitor": {"collect_freq": 5}})
    for s in steps:
        core.ingest([_step(r, s, loss=2.0 / (s + 1) + 0.3 * attempt + 0.01 * r).encode() if s else
                     StepPacket(rank=r, step=0, fingerprint="fp", ts=T0).encode() for r in range(world)])
    core.close()


def test_restarted_run_has_an_attempts_table_linked_from_the_plots(tmp_path):
    run_dir = tmp_path / "restarted"
    _aggregated(run_dir, range(0, 11), attempt=0)  # attempt 0 failed after step 10
    _aggregated(run_dir, range(6, 16), attempt=1)  # attempt 1 resumed from the checkpoint of step 6
    failure = {"kind": "crash", "root_cause_rank": 1, "ranks": [1], "step": 10, "exit_code": 1, "signal": None,
               "error": "RuntimeError: boom", "traceback": "", "log_tail": "", "errors": []}
    attempts = [
        {"attempt": 0, "status": "failed", "message": "rank 1 failed: RuntimeError: boom", "resumed_from": None,
         "steps_completed": 10, "failure": failure},
        {"attempt": 1, "status": "succeeded", "message": "", "steps_completed": 15,
         "resumed_from": {"path": str(run_dir / "checkpoints" / "step_00000006-periodic.ckpt"), "step": 6}},
    ]
    (run_dir / "summary.json").write_text(json.dumps(dict(SUMMARY, status="succeeded", stop=None,
                                                          steps_completed=15, attempts=attempts)))
    (run_dir / "config.yaml").write_text("train:\n  steps: 15\n")
    result = build_report(run_dir)
    page = _page(result)
    assert "<h2>Attempts</h2>" in page
    ids = _parse(page)
    assert ids.text["why"].strip() == "Completed all 15 steps after 1 restart."
    section = page[page.index('<section id="attempts">'):page.index('<section id="ranks">')]
    rows = re.findall(r'<tr id="attempt-(\d)">(.*?)</tr>', section)
    assert [r[0] for r in rows] == ["0", "1"], section
    cells0 = re.findall(r"<td[^>]*>(.*?)</td>", rows[0][1])
    cells1 = re.findall(r"<td[^>]*>(.*?)</td>", rows[1][1])
    assert cells0[2:4] == ["failed", "0 → 5"] and "rank 1 at step 10: RuntimeError: boom" in cells0[5], cells0
    assert cells0[6] == "5", "attempt 0's steps 6..10 were run again"
    assert cells1[2:5] == ["succeeded", "6 → 15", "step_00000006-periodic.ckpt (step 6)"], cells1
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", cells0[1]) or "UTC" in cells0[1], cells0[1]
    # the restart's marker on the plots links to its row
    assert re.search(r'<a class="mk attempt" href="#attempt-1" title="attempt 1 resumed at step 6"', page)
    text = final_tables(run_dir)
    assert "in 2 attempts" in text and "attempts (each step from the newest attempt that ran it)" in text
    # the loss figures follow the timeline: attempt 1's values from step 6 on
    h = headline(load_run(run_dir))
    assert h.loss_first.step == 1 and h.loss_last.step == 15
    assert h.loss_last.value == pytest.approx(2.0 / 16 + 0.3 + 0.005)


def test_large_world_draws_ranges_and_lists_only_the_failed_ranks(tmp_path):
    world = 40
    run_dir = tmp_path / "large"
    packets = [StepPacket(rank=r, step=s, loss=1.0 / (s + 1) + 0.001 * r, grad_norm=1.0, grad_norm_local=1.0,
                          step_time_s=0.1 + 0.001 * r, samples=4, ts=T0 + s) for s in range(1, 9) for r in range(world)]
    packets += [TelemetryPacket(node=f"node{n}", ts=T0 + s, source="npu-smi", cards=[
        {"card": c, "name": "910B", "util_pct": 80.0 + c, "memory_used_mb": 1000.0, "power_w": 100.0, "temp_c": 50.0}
        for c in range(8)]) for s in range(1, 9) for n in range(5)]
    _write_metrics(run_dir, packets)
    ranks = [{"rank": r, "last_step": 8, "exit_code": 0 if r != 17 else 1, "error": "" if r != 17 else "OOM"}
             for r in range(world)]
    (run_dir / "summary.json").write_text(json.dumps(dict(SUMMARY, status="succeeded", stop=None, world_size=world,
                                                          ranks=ranks)))
    result = build_report(run_dir)
    for path in result["plots"]:
        _assert_png(path)
    ids = _parse(_page(result))
    assert "40 cards (910B ×40, via npu-smi)" in ids.text["world"], ids.text["world"]
    text = final_tables(run_dir)
    section = text[text.index("ranks that failed"):]
    assert section.splitlines()[0] == "ranks that failed (1 of 40)"
    assert [ln.split()[0] for ln in section.splitlines()[3:] if ln.strip() and ln[0].isdigit()] == ["17"]


def test_summary_only_read_is_cheap_and_says_what_it_knows(full_run):
    run_dir, _ = full_run
    data = load_run(run_dir, metrics=False)
    assert not data.metrics_read and data.reduced == [] and data.world_size == WORLD
    h = headline(data)
    assert h.status == "anomaly_stop" and h.steps_done == 10
    assert h.loss_text() == "3.0500 → best 0.3000 (step 12) → last 0.3000"
    assert h.best is not None and h.best.name == "step_00000004-best.ckpt"
    text = final_tables(data)
    assert "throughput         -" in text and "cards" not in text


# ---------------------------------------------------------------------- damaged and partial


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
    assert page.count("data:image/png;base64,") == len(result["drawn"])
    ids = _parse(page)
    assert ids.text["status"].startswith("unknown")
    assert "did not finish" in ids.text["why"].lower() and "last complete step is 7" in ids.text["why"]
    assert "from the metrics (no summary.json)" in ids.text["wall-time"]
    text = final_tables(run_dir)
    assert "unknown" in text and "no summary.json" in text


def test_empty_metrics_says_no_data(tmp_path):
    run_dir = tmp_path / "empty"
    run_dir.mkdir()
    (run_dir / "metrics.msgpack").write_bytes(b"")
    result = build_report(run_dir)
    assert result["steps"] == 0 and result["world_size"] == 0 and result["drawn"] == []
    for path in result["plots"]:
        assert open(path, "rb").read(8) == PNG_SIGNATURE
    page = _page(result)
    assert "No data" in page
    assert "no anomalies recorded" in page and "no checkpoints" in page
    assert "no data" in final_tables(run_dir).lower()


def test_damaged_optional_files_are_reported_not_fatal(tmp_path):
    run_dir = tmp_path / "damaged"
    _write_metrics(run_dir, _stream(steps=3))
    (run_dir / "summary.json").write_text("{not json")
    (run_dir / "anomalies.json").write_text(json.dumps({"unexpected": True}))
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "manifest.json").write_text(json.dumps([1, 2]))
    result = build_report(run_dir)
    page = _page(result)
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
    page = _page(result)
    assert re.search(r"metrics.msgpack: \d+ damaged byte\(s\) skipped in 1 stretch\(es\)", page)
    assert "1 stretch(es)" in final_tables(run_dir)


def test_the_loss_scale_is_plotted(tmp_path):
    """A dynamic loss scale that grew from 1024 to ~7e16 (as a held-out MindFormers run's did),
    with a step an overflow skipped, is a figure of the report; a run whose ranks ran no
    loss-scale cell gets the figure's one-line reason instead."""
    from mindpulse.views.report.plots import draw_plots

    def scale(s: int) -> float:
        return 1024.0 * 2.0 ** (46 * (s - 1) / (STEPS - 1))

    packets = [_step(r, s, loss_scale=scale(s), overflow=s == 7, overflow_steps=int(s >= 7))
               for s in range(1, STEPS + 1) for r in range(WORLD)]
    run_dir = tmp_path / "run"
    _write_metrics(run_dir, packets)
    (tmp_path / "out").mkdir()
    (tmp_path / "out2").mkdir()
    plots = {p.path.name: p for p in draw_plots(load_run(run_dir), tmp_path / "out")}
    plot = plots["loss_scale.png"]
    assert plot.drawn, plot.message
    assert (tmp_path / "out" / "loss_scale.png").read_bytes().startswith(PNG_SIGNATURE)
    red = load_run(run_dir).reduced
    assert red[-1].loss_scale_min == pytest.approx(scale(STEPS)) and scale(STEPS) > 7e16, "the scale reduced"

    plain = tmp_path / "plain"
    _write_metrics(plain, [_step(r, s) for s in range(1, 4) for r in range(WORLD)])
    none = {p.path.name: p for p in draw_plots(load_run(plain), tmp_path / "out2")}["loss_scale.png"]
    assert not none.drawn and "no loss scale reported" in none.message, none
