"""The Prometheus endpoint and the shipped Grafana dashboard against a real Prometheus: one
2-rank launch serves its metrics while a Prometheus started here (loopback, its own
storage) scrapes them every second, with a NaN injected on rank 1 that the nonfinite rule
only warns about. Afterwards PromQL over Prometheus' HTTP API finds each rank's loss, the
anomaly, the cards; `promtool check metrics` passes on a scrape taken during the run; and
every expression of every panel and annotation of `dashboards/grafana/mindpulse.json`
evaluates without error against that Prometheus. The endpoint closes with the aggregator,
right after the ranks' last step (launcher/attempt.py `finish`), so the queries ask for the
time of Prometheus' newest scrape of the run, not "now"."""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "grafana" / "mindpulse.json"
STEPS = 30
NAN_STEP = 15
"""Half-way: Prometheus has scraped finite losses before it and the anomaly's counter after it
for many seconds (a step of the 2-rank CPU run takes about a second here)."""
GRAFANA_VARIABLES = {
    # Grafana's own variables, as it would expand them for a 1 s scrape interval
    "$__rate_interval": "4s",
    "$__interval_ms": "2000",
    "$__interval": "2s",
    "$__range_s": "300",
    "$__range_ms": "300000",
    "$__range": "5m",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Prometheus:
    url: str
    """Prometheus' own HTTP API, http://127.0.0.1:PORT."""
    target_port: int
    """The port its scrape config expects the run's endpoint on."""
    log: Path

    def log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return ""


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    """A real Prometheus on loopback scraping 127.0.0.1:TARGET every second; ended whatever the test's outcome."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the prometheus binary is not installed (apt-get install prometheus): nothing to scrape with")
    target_port, web_port = free_port(), free_port()
    while web_port == target_port:
        web_port = free_port()
    home = tmp_path / "prometheus"
    home.mkdir()
    config = home / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: mindpulse\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n")
    log = home / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={home / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{web_port}", "--log.level=warn"],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    prom = Prometheus(f"http://127.0.0.1:{web_port}", target_port, log)
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, f"prometheus exited ({proc.returncode}):\n{prom.log_tail()}"
            try:
                with urllib.request.urlopen(prom.url + "/-/ready", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:  # not listening yet
                pass
            assert time.time() < deadline, f"prometheus not ready within 60 s:\n{prom.log_tail()}"
            time.sleep(0.3)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


class Scraper(threading.Thread):
    """Scrapes the run's endpoint as Prometheus does, keeping the newest good text: the run's
    endpoint lives only as long as its aggregator."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.last_good = ""
        self.good = 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=5) as resp:
                    text = resp.read().decode()
                if resp.status == 200 and "mindpulse_loss{" in text:
                    self.last_good = text
                    self.good += 1
            except OSError:  # not up yet, or already closed
                pass
            self._done.wait(0.5)

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=30)


def api(prom: Prometheus, path: str, **params: Any) -> dict[str, Any]:
    """A Prometheus API call's JSON (its error answers, HTTP 400/422, included)."""
    url = f"{prom.url}{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:
        return json.load(exc)


def query(prom: Prometheus, expr: str, at: float) -> list[dict[str, Any]]:
    body = api(prom, "/api/v1/query", query=expr, time=f"{at:.3f}")
    assert body.get("status") == "success", (expr, body)
    return body["data"]["result"]


def dashboard_queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expr) of every panel target (rows' panels included) and annotation."""
    out: list[tuple[str, str]] = []

    def panels(items: list[dict[str, Any]]) -> None:
        for p in items:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((f"panel {p.get('title')!r} {t.get('refId')}", t["expr"]))
            panels(p.get("panels", []))

    panels(dash["panels"])
    for a in dash["annotations"]["list"]:
        expr = a.get("expr") or (a.get("target") or {}).get("expr")
        if expr:
            out.append((f"annotation {a['name']!r}", expr))
    return out


def expand(expr: str, run: str) -> str:
    """A dashboard expression with Grafana's variables replaced by what Grafana would send."""
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace("${" + name[1:] + "}", value).replace(name, value)
    expr = expr.replace("${run}", run).replace("$run", run)
    assert "$" not in expr, f"a variable the test does not expand: {expr}"
    return expr


def test_a_real_prometheus_scrapes_a_run_and_every_dashboard_query_evaluates(run_cli, prometheus):
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 36 and dash["title"] == "mindpulse"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["run"]["definition"] == "label_values(mindpulse_run_info, run)"

    scraper = Scraper(f"http://127.0.0.1:{prometheus.target_port}/metrics")
    scraper.start()
    try:
        r = run_cli("launch", "--set", f"train.steps={STEPS}",
                    "--set", f"exporters.prometheus.port={prometheus.target_port}",
                    "--set", "anomalies=[{rule: nonfinite, action: warn}]",
                    "--inject", f"nan_loss@1:{NAN_STEP}", "--set", "monitor.per_print_step=50", timeout=600)
    finally:
        scraper.stop()
    assert r.returncode == 0, r.output
    assert f"metrics for Prometheus: http://127.0.0.1:{prometheus.target_port}/metrics" in r.stdout, r.output
    run = r.run_dir.name

    # what Prometheus stored: its samples of the step counter say when it scraped the run. The
    # endpoint closed with the run, so Prometheus marked its series stale: query at the newest scrape
    steps = api(prometheus, "/api/v1/query", query=f'mindpulse_steps_total{{run="{run}"}}[1h]',
                time=f"{time.time():.3f}")
    assert steps.get("status") == "success", steps
    series = steps["data"]["result"]
    assert len(series) == 1, (series, prometheus.log_tail())
    samples = [(float(t), float(v)) for t, v in series[0]["values"]]
    assert len(samples) >= 10, f"Prometheus scraped the run {len(samples)} times: {samples}"
    at, last_steps = samples[-1]
    assert last_steps > NAN_STEP, samples

    # each rank's loss, finite before the NaN and present (NaN) after it
    loss = query(prometheus, f'mindpulse_loss{{run="{run}",stat="rank"}}', at)
    assert {x["metric"]["rank"] for x in loss} == {"0", "1"}, loss
    before = [t for t, v in samples if 2 <= v < NAN_STEP]
    assert before, samples
    early = query(prometheus, f'mindpulse_loss{{run="{run}",stat="rank"}}', before[-1])
    assert {x["metric"]["rank"] for x in early} == {"0", "1"}, early
    assert all(math.isfinite(float(x["value"][1])) for x in early), early
    # the injected NaN: counted on rank 1, and the nonfinite rule's warning
    fired = query(prometheus, f'mindpulse_anomalies_total{{run="{run}",rule="nonfinite"}} >= 1', at)
    assert fired and fired[0]["metric"]["action"] == "warn", fired
    assert query(prometheus, f'mindpulse_nonfinite_total{{run="{run}",rank="1"}} >= 1', at)
    # the cards of the run's one node
    cards = query(prometheus, f'mindpulse_card_utilization_ratio{{run="{run}"}}', at)
    assert cards and all(x["metric"]["host"] and x["metric"]["id"] for x in cards), cards
    info = query(prometheus, f'mindpulse_run_info{{run="{run}"}}', at)
    assert info and info[0]["metric"]["world_size"] == "2", info

    # a scrape taken while the run went on passes Prometheus' own lint
    assert scraper.good >= 3 and scraper.last_good, f"{scraper.good} good scrapes"
    promtool = shutil.which("promtool")
    assert promtool, "prometheus is installed without promtool"
    lint = subprocess.run([promtool, "check", "metrics"], input=scraper.last_good, capture_output=True, text=True,
                          timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr

    # the dashboard: its run variable lists the run, and every query evaluates without error
    values = api(prometheus, "/api/v1/label/run/values", **{"match[]": "mindpulse_run_info"},
                 start=f"{samples[0][0]:.3f}", end=f"{at:.3f}")
    assert values.get("status") == "success" and run in values["data"], values
    queries = dashboard_queries(dash)
    assert len(queries) >= 30, queries
    errors, empty = [], []
    for where, expr in queries:
        body = api(prometheus, "/api/v1/query", query=expand(expr, run), time=f"{at:.3f}")
        if body.get("status") != "success":
            errors.append((where, expr, body.get("error")))
        elif not body["data"]["result"]:
            empty.append((where, expr))
    assert not errors, "\n".join(map(str, errors))
    # the panels a healthy run must fill: losses, step times, stragglers, last step ages, cards
    must = re.compile(r"mindpulse_(loss|step_duration_seconds|straggler_score|last_step_timestamp_seconds"
                      r"|node_last_step_timestamp_seconds|card_utilization_ratio|card_memory_used_bytes|run_info)\b")
    assert not [q for q in empty if must.search(q[1])], empty
