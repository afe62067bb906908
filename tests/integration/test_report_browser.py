"""The HTML report in a real headless browser: it renders, shows its plots and tables, and its
first screen at 1280×800 answers the questions a user opens it with (status and why, the loss
figures, the best checkpoint link) with no raw JSON above the fold; the markers on the plots sit
on the drawn lines and lead to their rows.

Needs Debian's chromium (`apt-get install chromium`); skipped when it is not installed.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from mindpulse.views.report import PLOT_NAMES, build_report
from mindpulse.wire.protocol import EventPacket, StepPacket, TelemetryPacket

pytestmark = pytest.mark.slow

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
WORLD = 2
STEPS = 30
T0 = 1_700_000_000.0
BROWSER_TIMEOUT_S = 120
FIRST_SCREEN = (1280, 800)
ANOMALIES = [
    {"rule": "loss_spike", "step": 11, "rank": 1, "value": 9.5, "threshold": 3.0, "action": "warn",
     "message": "loss jumped on rank 1"},
    {"rule": "grad_explosion", "step": 24, "rank": None, "value": 1e6, "threshold": 1e4, "action": "stop",
     "message": "global grad norm too large"},
]
CHECKPOINTS = [
    {"path": "step_00000010-best.ckpt", "step": 10, "epoch": 1, "metric": 1.1, "metric_name": "loss", "kind": "best",
     "size": 4096, "sha256": "0123456789abcdef" * 4, "time": T0 + 10},
    {"path": "step_00000020-periodic.ckpt", "step": 20, "epoch": 1, "metric": 0.4, "metric_name": "loss",
     "kind": "periodic", "size": 4096, "sha256": "fedcba9876543210" * 4, "time": T0 + 20},
]
RAW_JSON = re.compile(r'[{\[]\s*"|"\s*:\s*[{\["\d]|\b(null|true|false)\b|\{\}|\[\]')
"""What JSON looks like: an object or list opening on a string, `"key": value`, its literals."""
EPOCH_NUMBER = re.compile(r"\b1[5-9]\d{8}(\.\d+)?\b")


def _chromium() -> str | None:
    if os.access("/usr/bin/chromium", os.X_OK):
        return "/usr/bin/chromium"
    return shutil.which("chromium")


CHROMIUM = _chromium()
requires_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install -y chromium)")


def _stream(steps: int = STEPS) -> list:
    out: list = [EventPacket(rank=r, kind="start", ts=T0, pid=2000 + r, host="node-a") for r in range(WORLD)]
    out += [StepPacket(rank=r, step=0, fingerprint="fp-0", ts=T0) for r in range(WORLD)]
    for s in range(1, steps + 1):
        for r in range(WORLD):
            loss = 3.0 * math.exp(-s / 10) + 0.05 * r + (2.0 if (s, r) == (11, 1) else 0.0)
            out.append(StepPacket(rank=r, step=s, loss=loss, lr=1e-4, grad_norm=2.0 + 0.1 * s,
                                  grad_norm_local=1.0 + r + 0.05 * s, step_time_s=0.2 + 0.03 * r + 0.01 * (s % 3),
                                  samples=16, tokens=16 * 64, ts=T0 + s,
                                  tflops=40.0 + 5 * r - (15.0 if (s, r) == (11, 1) else 0.0),
                                  loss_scale=1024.0 * 2.0 ** (s // 5), overflow=s == 12, overflow_steps=int(s >= 12),
                                  fingerprint=f"fp-{s}" if s % 10 == 0 else None))
        if s % 2 == 0:
            out.append(TelemetryPacket(node="node-a", ts=T0 + s + 0.5, source="npu-smi", cards=[
                {"card": c, "name": "910B", "health": "OK", "util_pct": 60.0 + 10 * c + s % 7,
                 "memory_used_mb": 20000.0 + 50 * s, "memory_total_mb": 65536.0, "power_w": 180.0 + 5 * c + s,
                 "temp_c": 55.0 + c + s / 10, "ranks": [c]} for c in range(WORLD)]))
    return out


def _summary(**kw) -> dict:
    """A summary.json with every field the launcher writes (its raw parts must stay folded away)."""
    base = {
        "status": "anomaly_stop", "exit_code": 3, "run_dir": "/runs/browser-demo-20261201-101500",
        "name": "browser-demo", "world_size": WORLD, "steps_completed": 25,
        "ranks": [{"rank": r, "last_step": 25, "param_fingerprint": "fp-20", "pid": 2000 + r, "host": "node-a",
                   "exit_code": 0, "error": "", "node": 0, "node_id": "ab" * 28} for r in range(WORLD)],
        "stop": {"rule": "grad_explosion", "rank": None, "value": 1e6, "threshold": 1e4,
                 "message": "global grad norm 1e+06 > 10000 at step 24", "step": 25, "decided_at": 24,
                 "save_last": False},
        "best_checkpoint": {"path": "/runs/browser-demo-20261201-101500/checkpoints/step_00000010-best.ckpt",
                            "step": 10, "metric": 1.1, "metric_name": "loss"},
        "anomalies": 2, "rule_errors": [], "resumed_from": None,
        "attempts": [{"attempt": 0, "status": "succeeded", "message": "", "resumed_from": None,
                      "logs": "/runs/browser-demo-20261201-101500/logs", "steps_completed": 25}],
        "aggregator_lost": False, "message": "", "first_loss": 2.7, "last_loss": 0.2, "best_loss": 0.2,
        "best_loss_step": 25, "fingerprints_equal": True, "monitor_wait_s": 0.1, "monitor_errors": 0,
        "packets": {"accepted": 200, "rejected": 0, "rejected_by_reason": {}, "duplicates": 0, "late": 0,
                    "incomplete_steps_evicted": 0, "dropped": 0, "aggregator_restarts": 0},
        "pids": {"ray_temp_dir": "/tmp/mindpulse-ray-qipmrmof/ray", "aggregator": 28538, "agents": {"0": 28593},
                 "scheduler": 28641, "ranks": {"0": 2000, "1": 2001}},
        "started": T0 - 20.0, "wall_time_s": 4 * 3600 + 125.0, "failure": None,
    }
    base.update(kw)
    return base


def _run_dir(root: Path, summary: dict, anomalies: list, checkpoints: list, steps: int = STEPS) -> Path:
    run_dir = root / "run"
    run_dir.mkdir()
    (run_dir / "metrics.msgpack").write_bytes(b"".join(p.encode() for p in _stream(steps)))
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "anomalies.json").write_text(json.dumps(anomalies))
    ckpt = run_dir / "checkpoints"
    ckpt.mkdir()
    for c in checkpoints:
        (ckpt / c["path"]).write_bytes(b"\0" * c["size"])
    (ckpt / "manifest.json").write_text(json.dumps({"version": 1, "files": checkpoints}))
    (run_dir / "config.yaml").write_text("name: browser-demo\nworld:\n  nodes: 1\n  ranks_per_node: 2\n"
                                         "  device: ascend\ntrain:\n  steps: 30\n")
    return run_dir


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """A run an anomaly rule stopped, with a warning before it and two checkpoints."""
    run_dir = _run_dir(tmp_path_factory.mktemp("browser"), _summary(), ANOMALIES, CHECKPOINTS)
    result = build_report(run_dir)
    html = Path(result["html"])
    assert html.exists()
    return html


@pytest.fixture(scope="module")
def failed_report(tmp_path_factory) -> Path:
    """A run that failed twice (one restart), with goodput accounting and the header's longest why."""
    tb = ("Traceback (most recent call last):\n  File \"/job/train.py\", line 88, in <module>\n    main()\n"
          "RuntimeError: injected crash (crash@1:17) in rank 1 at step 17\n")
    failure = {"kind": "crash", "root_cause_rank": 1, "ranks": [0, 1], "step": 16, "exit_code": 1, "signal": None,
               "error": "RuntimeError: injected crash (crash@1:17) in rank 1 at step 17",
               "log_tail": "[rank 1] injecting fault crash@1:17\n" + tb, "traceback": tb,
               "errors": [{"error": "RuntimeError: injected crash (crash@1:17) in rank 1 at step 17", "ranks": [1]}]}
    attempts = [{"attempt": a, "status": "failed", "message": "rank 1 failed: " + failure["error"],
                 "resumed_from": None if a == 0 else {"path": "/runs/x/checkpoints/step_00000010-best.ckpt",
                                                      "step": 10, "epoch": 1, "kind": "best"},
                 "logs": "/runs/x/logs", "steps_completed": 16, "failure": failure} for a in range(2)]
    wall = 4 * 3600 + 125.0
    summary = _summary(status="failed", exit_code=1, stop=None, failure=failure, attempts=attempts,
                       steps_completed=16, message="rank 1 failed: " + failure["error"],
                       goodput={"wall_s": wall, "productive_s": wall - 1500.0, "ettr": (wall - 1500.0) / wall,
                                "badput_s": {"restart": 900.0, "startup": 400.0, "checkpoint_save": 200.0}})
    run_dir = _run_dir(tmp_path_factory.mktemp("browser-failed"), summary, ANOMALIES[:1], CHECKPOINTS[:1], steps=16)
    result = build_report(run_dir)
    return Path(result["html"])


def _browser(args: list[str], profile: Path) -> subprocess.CompletedProcess:
    """Run headless chromium once; its process group is killed on a timeout."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={profile}", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=BROWSER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"chromium did not finish within {BROWSER_TIMEOUT_S}s\n{err[-3000:]}")
    finally:
        if proc.poll() is None:  # pragma: no cover - only after an unexpected error above
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _pixels(path: Path):
    """The screenshot as an (H, W, channels) float array in [0, 1]."""
    import numpy as np

    try:
        from PIL import Image

        with Image.open(path) as im:
            return np.asarray(im.convert("RGB"), dtype=float) / 255.0
    except ImportError:
        import matplotlib.image as mpimg

        return np.asarray(mpimg.imread(str(path)), dtype=float)[..., :3]


def _screenshot(report: Path, tmp_path: Path, width: int, height: int):
    shot = tmp_path / f"shot-{width}x{height}.png"
    res = _browser([f"--window-size={width},{height}", f"--screenshot={shot}", report.as_uri()], tmp_path / "profile")
    assert shot.exists(), f"no screenshot (rc {res.returncode})\n{res.stderr[-3000:]}"
    data = shot.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")) == (width, height)
    return _pixels(shot)


def _drawn(report: Path) -> int:
    """How many plots the page shows as pictures."""
    return report.read_text(encoding="utf-8").count("data:image/png;base64,")


@requires_chromium
def test_report_renders_in_headless_chromium(report, tmp_path):
    px = _screenshot(report, tmp_path, 1200, 2400)
    assert px.shape[:2] == (2400, 1200)
    assert px.var() > 0.005, f"the page looks blank (variance {px.var():.5f})"
    nonwhite = (px < 0.9).any(axis=-1)
    assert nonwhite.mean() > 0.01, f"almost no non-white pixels ({nonwhite.mean():.4f})"
    # the plots are drawn: coloured lines (matplotlib's default blue/orange), not only grey text
    r, g, b = px[..., 0], px[..., 1], px[..., 2]
    coloured = (abs(r - g) > 0.25) | (abs(g - b) > 0.25) | (abs(r - b) > 0.25)
    assert coloured.sum() > 500, f"no coloured pixels: plots missing? ({coloured.sum()})"
    # the status badge near the top (anomaly_stop → red on white)
    top = px[:120]
    red = (top[..., 0] > 0.6) & (top[..., 1] < 0.35) & (top[..., 2] < 0.35)
    assert red.sum() > 50, "status badge not rendered"


@requires_chromium
def test_report_dom_has_images_and_anomaly_table(report, tmp_path):
    res = _browser(["--dump-dom", report.as_uri()], tmp_path / "profile")
    dom = res.stdout
    assert res.returncode == 0 and "<html" in dom, f"rc {res.returncode}\n{res.stderr[-3000:]}"
    imgs = re.findall(r"<img\b[^>]*>", dom)
    assert len(imgs) == len(PLOT_NAMES), "every plot of this run has something measured to show"
    assert all('src="data:image/png;base64,' in tag for tag in imgs)
    assert {re.search(r'alt="([^"]+)"', t).group(1) for t in imgs} == {n[:-4] for n in PLOT_NAMES}
    assert "<title>anomaly_stop · browser-demo · mindpulse report</title>" in dom
    # the anomaly timeline: header and both records in table cells
    section = dom[dom.index('<section id="anomalies">'):dom.index('<section id="checkpoints">')]
    assert "<table" in section
    for key in ("marker", "step", "rule", "rank", "value", "threshold", "action", "message"):
        assert f"<th>{key}</th>" in section
    for a in ANOMALIES:
        assert f"<td>{a['rule']}</td>" in section and f"<td>{a['message']}</td>" in section
        assert f"<td>{a['step']}</td>" in section and f"<td>{a['action']}</td>" in section


def _probe(report: Path, tmp_path: Path, name: str, js: str, *args: str) -> str:
    """Load a copy of the report with a script that writes `js`'s value into the DOM once the
    page has loaded; returns that value."""
    probe = report.with_name(f"probe-{name}.html")
    script = ("<script>window.addEventListener('load', () => { const out = document.createElement('pre');"
              f" out.id = 'probe'; out.textContent = String({js}); document.body.appendChild(out); }});</script>")
    probe.write_text(report.read_text(encoding="utf-8").replace("</body>", script + "</body>"), encoding="utf-8")
    try:
        res = _browser(["--dump-dom", "--virtual-time-budget=5000", *args, probe.as_uri()], tmp_path / "profile")
    finally:
        probe.unlink()
    m = re.search(r'<pre id="probe">([^<]*)</pre>', res.stdout)
    assert m, f"the probe script did not run (rc {res.returncode})\n{res.stderr[-3000:]}"
    import html

    return html.unescape(m.group(1))


@requires_chromium
def test_report_images_decode_in_the_browser(report, tmp_path):
    """Every embedded PNG decodes to a real picture in the browser."""
    sizes = _probe(report, tmp_path, "images", "Array.from(document.images)"
                   ".map(i => i.complete + ':' + i.naturalWidth + 'x' + i.naturalHeight).join(' ')").split()
    assert len(sizes) == _drawn(report) == len(PLOT_NAMES)
    for s in sizes:
        complete, dims = s.split(":")
        w, h = (int(x) for x in dims.split("x"))
        assert complete == "true" and w >= 400 and h >= 200, sizes


@requires_chromium
@pytest.mark.parametrize("width", [700, 1200])
def test_report_fits_the_window_width(report, tmp_path, width):
    """Nothing runs past the right edge (long hashes wrap; plots scale down); wide text
    tables scroll inside their own box."""
    value = _probe(report, tmp_path, f"width-{width}",
                   "document.documentElement.scrollWidth + ' ' + window.innerWidth + ' ' + "
                   "Math.max(...Array.from(document.images).map(i => i.getBoundingClientRect().right))",
                   f"--window-size={width},1000")
    scroll, inner, img_right = (float(x) for x in value.split())
    assert inner == width
    assert scroll <= inner, f"the page is {scroll}px wide in a {inner}px window"
    assert img_right <= inner


_FIRST_SCREEN_JS = """JSON.stringify((() => {
  const H = window.innerHeight, W = window.innerWidth;
  const box = (id) => {
    const el = document.getElementById(id);
    if (!el) return null;
    const r = el.getBoundingClientRect(), first = el.getClientRects()[0] || r;  // a wrapped link: its first line
    const hit = document.elementFromPoint(first.left + first.width / 2, first.top + first.height / 2);
    return {top: r.top, bottom: r.bottom, left: r.left, right: r.right, text: el.innerText,
            href: el.getAttribute('href'), on_top: !!hit && (hit === el || el.contains(hit)),
            visible: getComputedStyle(el).visibility !== 'hidden' && r.width > 0 && r.height > 0};
  };
  const seen = [];
  const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  while (walk.nextNode()) {
    const n = walk.currentNode;
    if (!n.textContent.trim() || n.parentElement.closest('#probe')) continue;
    const range = document.createRange();
    range.selectNodeContents(n);
    const rects = Array.from(range.getClientRects()).filter(r => r.width > 0 && r.height > 0);
    if (rects.some(r => r.top < H && r.bottom > 0)) seen.push(n.textContent.trim());
  }
  return {H, W, scrollY: window.scrollY, above_fold: seen,
          status: box('status'), why: box('why'), detail: box('why-detail'), loss: box('loss-figures'),
          best: box('best-checkpoint'), goodput: box('goodput'),
          raw_open: Array.from(document.querySelectorAll('details')).filter(d => d.open).length};
})())"""


def _first_screen(report: Path, tmp_path: Path) -> dict:
    w, h = FIRST_SCREEN
    return json.loads(_probe(report, tmp_path, "first-screen", _FIRST_SCREEN_JS, f"--window-size={w},{h}"))


@requires_chromium
@pytest.mark.parametrize("which", ["report", "failed_report"])
def test_first_screen_answers_at_a_glance(which, request, tmp_path):
    """At 1280×800, without scrolling: the status, why, the loss figures and the best checkpoint
    link are on the screen and not covered; nothing on that screen is raw JSON or an epoch number."""
    report = request.getfixturevalue(which)
    got = _first_screen(report, tmp_path)
    # headless chromium's --dump-dom keeps room for a browser's toolbars in the window: the
    # viewport is the part of a 1280x800 window a user sees, which is all that may be relied on
    assert got["W"] == FIRST_SCREEN[0] and 600 <= got["H"] <= FIRST_SCREEN[1] and got["scrollY"] == 0, got
    for key in ("status", "why", "loss", "best"):
        b = got[key]
        assert b is not None, f"{which}: the page has no #{key} element"
        assert b["visible"] and b["on_top"], f"{which}: #{key} is hidden or covered: {b}"
        assert 0 <= b["top"] and b["bottom"] <= got["H"] and 0 <= b["left"] and b["right"] <= got["W"], \
            f"{which}: #{key} is not on the first screen ({got['W']}x{got['H']} of a {FIRST_SCREEN} window): {b}"
    status = "anomaly_stop" if which == "report" else "failed"
    assert got["status"]["text"].strip() == status
    if which == "report":
        assert "Stopped by rule grad_explosion at step 24" in got["why"]["text"]
        assert got["detail"]["text"].strip() == "global grad norm 1e+06 > 10000 at step 24"
    else:
        assert "Rank 1 failed at step 16 (the root cause), exit code 1 (after 1 restart)" in got["why"]["text"]
        assert got["detail"]["text"].strip() == "RuntimeError: injected crash (crash@1:17) in rank 1 at step 17"
        assert got["goodput"] is not None and "ETTR 89.7%" in got["goodput"]["text"]
    numbers = re.findall(r"\d+\.\d{4}", got["loss"]["text"])
    assert len(numbers) == 3 and all(w in got["loss"]["text"] for w in ("first", "best", "last")), got["loss"]
    assert got["best"]["href"] == "../checkpoints/step_00000010-best.ckpt", got["best"]
    assert got["best"]["text"] == "step_00000010-best.ckpt"
    assert (report.parent / got["best"]["href"]).resolve().exists(), "the best checkpoint link leads nowhere"
    # no raw JSON or epoch numbers above the fold; the raw data is folded away
    fold = "\n".join(got["above_fold"])
    assert not RAW_JSON.search(fold), f"raw JSON on the first screen: {RAW_JSON.search(fold).group(0)!r}\n{fold}"
    assert not EPOCH_NUMBER.search(fold), f"an epoch number on the first screen:\n{fold}"
    assert "ray_temp_dir" not in fold and "summary.json" not in fold, fold
    assert got["raw_open"] == 0, "a folded section is open"


_MARKERS_JS = """JSON.stringify((() => {
  const out = [];
  for (const a of document.querySelectorAll('#plot-loss a.mk')) {
    const r = a.getBoundingClientRect(), img = a.parentElement.querySelector('img').getBoundingClientRect();
    const x = r.left + r.width / 2, y = r.top + r.height / 2;
    const hit = document.elementFromPoint(x, y);
    out.push({kind: a.classList[1], href: a.getAttribute('href'), x: x + window.scrollX,
              top: r.top + window.scrollY, bottom: r.bottom + window.scrollY,
              inside: r.top >= img.top - 0.5 && r.bottom <= img.bottom + 0.5 && x > img.left && x < img.right,
              clickable: hit === a});
  }
  const first = document.querySelector('#plot-loss a.mk.anomaly');
  first.click();
  const target = document.querySelector(':target');
  return {markers: out, hash: location.hash, target: target ? target.tagName + '#' + target.id : null,
          back: target ? target.querySelector('a.marker').getAttribute('href') : null};
})())"""


@requires_chromium
def test_plot_markers_sit_on_their_lines_and_lead_to_their_rows(report, tmp_path):
    """Each anomaly marker's link lies over the red line drawn at its step (checked in a
    screenshot of the same layout); clicking it opens its timeline row, which links back."""
    w, h = 1280, 2000
    got = json.loads(_probe(report, tmp_path, "markers", _MARKERS_JS, f"--window-size={w},{h}"))
    marks = got["markers"]
    assert sorted((m["kind"], m["href"]) for m in marks) == [
        ("anomaly", "#anomaly-11"), ("anomaly", "#anomaly-24"), ("checkpoint", "#ckpt-10"),
        ("checkpoint", "#ckpt-20")], marks
    assert all(m["inside"] and m["clickable"] for m in marks), f"a marker link lies outside its plot or is covered: " \
                                                               f"{marks}"
    assert got["hash"] == "#anomaly-11" and got["target"] == "TR#anomaly-11", got
    assert got["back"] == "#plot-loss", "the timeline row links back to the plot"
    px = _screenshot(report, tmp_path, w, h)
    for m in marks:
        x = int(round(m["x"]))
        top, bottom = int(m["top"]) + 2, int(m["bottom"]) - 2
        assert bottom <= h, f"the loss plot is not inside the {w}x{h} screenshot: {m}"
        strip = px[top:bottom, max(0, x - 3):x + 4]
        r, g, b = strip[..., 0], strip[..., 1], strip[..., 2]
        if m["kind"] == "anomaly":
            hits = ((r > 0.6) & (r - g > 0.25) & (r - b > 0.25)).sum()
        else:
            hits = ((g > 0.4) & (g - r > 0.15) & (g - b > 0.1)).sum()
        assert hits >= 15, f"no {m['kind']} line under the marker link at x={x} ({hits} pixels): {m}"
