"""What polls the aggregator while the fan-in benchmark runs (bench/fanin.py): the launcher's
supervisor (its polls and hang checks, at the launcher's periods) and Prometheus (a scrape of
the endpoint at a fixed interval), each a thread beside the run."""

from __future__ import annotations

import threading
import time

import ray

POLL_S = 0.5
"""The launcher's supervisor polls the aggregator this often (launcher/supervision.py WAIT_S)."""
HANG_CHECK_S = 2.0
"""...and asks its hang check this often (HANG_CHECK_EVERY_S)."""


class Scraper:
    """Prometheus' part: GET the aggregator's /metrics every `every_s` seconds (the first at
    once) while the run goes, as a scrape job would; the aggregator's CPU includes serving them."""

    def __init__(self, url: str, every_s: float):
        self.url, self.every_s, self.times = url, every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import urllib.request

        while not self._stop.is_set():
            t = time.perf_counter()
            try:
                with urllib.request.urlopen(self.url, timeout=10) as resp:
                    resp.read()
                self.times.append(time.perf_counter() - t)
            except OSError:
                pass  # the endpoint is not up yet (or gone): the next scrape tries again
            self._stop.wait(self.every_s)

    def close(self) -> list[float]:
        self._stop.set()
        self._thread.join(timeout=15)
        return list(self.times)


class Driver:
    """The launcher's supervisor while the ranks run: `poll` every POLL_S (the console's new
    lines, tables included, and the progress) and `hang_check` every HANG_CHECK_S, with the
    arguments the launcher passes for the default config (`launcher/attempt.py`)."""

    def __init__(self, aggregator, stale_s: float):
        self.agg, self.stale_s = aggregator, stale_s
        self.polls: list[float] = []
        self.checks: list[float] = []
        self.lines = self.chars = 0
        self.tracker_lines: list[str] = []
        """What the console said of the trackers (where each logs, one that failed): the first few."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        last_check = 0.0
        while not self._stop.wait(POLL_S):
            t = time.perf_counter()
            try:
                info = ray.get(self.agg.poll.remote(), timeout=10)
                self.polls.append(time.perf_counter() - t)
                self.lines += len(info["console"])
                self.chars += sum(len(x) for x in info["console"])
                self.tracker_lines += [x for x in info["console"] if len(self.tracker_lines) < 10 and any(
                    w in x for w in ("MLflow", "SwanLab", "tracker did not start", "Sink failed in"))]
            except Exception:  # as the launcher: no answer this tick, asked again at the next
                self.polls.append(10.0)
            if time.monotonic() - last_check >= HANG_CHECK_S:
                last_check = time.monotonic()
                t = time.perf_counter()
                try:
                    ray.get(self.agg.hang_check.remote(None, self.stale_s), timeout=10)
                    self.checks.append(time.perf_counter() - t)
                except Exception:  # as the launcher: no verdict this tick
                    self.checks.append(10.0)

    def close(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=15)
        return {"polls": len(self.polls), "poll_max_ms": round(max(self.polls, default=0) * 1000, 1),
                "hang_checks": len(self.checks), "hang_check_max_ms": round(max(self.checks, default=0) * 1000, 1),
                "console_lines": self.lines, "console_chars": self.chars, "tracker_lines": self.tracker_lines}
