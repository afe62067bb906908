"""The HTML report in a real headless browser: it renders, shows its plots and tables.

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

from mindpulse.protocol import EventPacket, StepPacket, TelemetryPacket
from mindpulse.views.report import PLOT_NAMES, build_report

pytestmark = pytest.mark.slow

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
WORLD = 2
STEPS = 30
T0 = 1_700_000_000.0
BROWSER_TIMEOUT_S = 120
ANOMALIES = [
    {"rule": "loss_spike", "step": 11, "rank": 1, "value": 9.5, "threshold": 3.0, "action": "warn",
     "message": "loss jumped on rank 1"},
    {"rule": "grad_explosion", "step": 24, "rank": None, "value": 1e6, "threshold": 1e4, "action": "stop",
     "message": "global grad norm too large"},
]
CHECKPOINTS = [
    {"path": "checkpoints/step_10.ckpt", "step": 10, "metric": 1.1, "kind": "best", "size": 4096,
     "sha256": "0123456789abcdef" * 4},
    {"path": "checkpoints/step_20.ckpt", "step": 20, "metric": 0.4, "kind": "periodic", "size": 4096,
     "sha256": "fedcba9876543210" * 4},
]


def _chromium() -> str | None:
    if os.access("/usr/bin/chromium", os.X_OK):
        return "/usr/bin/chromium"
    return shutil.which("chromium")


CHROMIUM = _chromium()
requires_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install -y chromium)")


def _stream() -> list:
    out: list = [EventPacket(rank=r, kind="start", ts=T0, pid=2000 + r, host="node-a") for r in range(WORLD)]
    out += [StepPacket(rank=r, step=0, fingerprint="fp-0", ts=T0) for r in range(WORLD)]
    for s in range(1, STEPS + 1):
        for r in range(WORLD):
            loss = 3.0 * math.exp(-s / 10) + 0.05 * r + (2.0 if (s, r) == (11, 1) else 0.0)
            out.append(StepPacket(rank=r, step=s, loss=loss, lr=1e-4, grad_norm=2.0 + 0.1 * s,
                                  grad_norm_local=1.0 + r + 0.05 * s, step_time_s=0.2 + 0.03 * r + 0.01 * (s % 3),
                                  samples=16, ts=T0 + s, fingerprint=f"fp-{s}" if s % 10 == 0 else None))
        if s % 2 == 0:
            out.append(TelemetryPacket(node="node-a", ts=T0 + s + 0.5, source="npu-smi", cards=[
                {"card": c, "name": "910B", "health": "OK", "util_pct": 60.0 + 10 * c + s % 7,
                 "memory_used_mb": 20000.0 + 50 * s, "memory_total_mb": 65536.0, "power_w": 180.0 + 5 * c + s,
                 "temp_c": 55.0 + c + s / 10, "ranks": [c]} for c in range(WORLD)]))
    return out


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("browser") / "run"
    run_dir.mkdir()
    (run_dir / "metrics.msgpack").write_bytes(b"".join(p.encode() for p in _stream()))
    (run_dir / "summary.json").write_text(json.dumps({
        "status": "anomaly_stop", "exit_code": 3, "name": "browser-demo", "world_size": WORLD,
        "steps_completed": STEPS, "first_loss": 2.7, "last_loss": 0.2, "best_loss": 0.2,
        "stop": {"rule": "grad_explosion", "step": 24, "message": "global grad norm too large"},
        "ranks": [{"rank": r, "last_step": STEPS, "exit_code": 0, "param_fingerprint": "fp-30",
                   "host": "node-a", "pid": 2000 + r} for r in range(WORLD)],
        "packets": {"accepted": 200, "rejected": 0},
    }))
    (run_dir / "anomalies.json").write_text(json.dumps(ANOMALIES))
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "manifest.json").write_text(json.dumps({"files": CHECKPOINTS}))
    (run_dir / "config.yaml").write_text("name: browser-demo\ntrain:\n  steps: 30\n")
    result = build_report(run_dir)
    html = Path(result["html"])
    assert html.exists()
    return html


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


@requires_chromium
def test_report_renders_in_headless_chromium(report, tmp_path):
    shot = tmp_path / "shot.png"
    res = _browser(["--window-size=1200,2400", f"--screenshot={shot}", report.as_uri()], tmp_path / "profile")
    assert shot.exists(), f"no screenshot (rc {res.returncode})\n{res.stderr[-3000:]}"
    data = shot.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1200, 2400)

    px = _pixels(shot)
    assert px.shape[:2] == (2400, 1200)
    assert px.var() > 0.005, f"the page looks blank (variance {px.var():.5f})"
    nonwhite = (px < 0.9).any(axis=-1)
    assert nonwhite.mean() > 0.01, f"almost no non-white pixels ({nonwhite.mean():.4f})"
    # the plots are drawn: coloured lines (matplotlib's default blue/orange), not only grey text
    r, g, b = px[..., 0], px[..., 1], px[..., 2]
    coloured = (abs(r - g) > 0.25) | (abs(g - b) > 0.25) | (abs(r - b) > 0.25)
    assert coloured.sum() > 500, f"no coloured pixels: plots missing? ({coloured.sum()})"
    # the status badge near the top (anomaly_stop → red on white)
    top = px[:300]
    red = (top[..., 0] > 0.6) & (top[..., 1] < 0.35) & (top[..., 2] < 0.35)
    assert red.sum() > 50, "status badge not rendered"


@requires_chromium
def test_report_dom_has_images_and_anomaly_table(report, tmp_path):
    res = _browser(["--dump-dom", report.as_uri()], tmp_path / "profile")
    dom = res.stdout
    assert res.returncode == 0 and "<html" in dom, f"rc {res.returncode}\n{res.stderr[-3000:]}"
    imgs = re.findall(r"<img\b[^>]*>", dom)
    assert len(imgs) >= 5 and len(imgs) == len(PLOT_NAMES)
    assert all('src="data:image/png;base64,' in tag for tag in imgs)
    assert {re.search(r'alt="([^"]+)"', t).group(1) for t in imgs} == {n[:-4] for n in PLOT_NAMES}
    assert "mindpulse report: browser-demo" in dom
    assert "anomaly_stop" in dom
    # the anomaly table: header and both records in table cells
    section = dom[dom.index(">Anomalies<"):dom.index(">Checkpoints<")]
    assert "<table" in section
    for key in ("rule", "step", "rank", "value", "threshold", "action", "message"):
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
    return m.group(1)


@requires_chromium
def test_report_images_decode_in_the_browser(report, tmp_path):
    """Every embedded PNG decodes to a real picture in the browser."""
    sizes = _probe(report, tmp_path, "images", "Array.from(document.images)"
                   ".map(i => i.complete + ':' + i.naturalWidth + 'x' + i.naturalHeight).join(' ')").split()
    assert len(sizes) == len(PLOT_NAMES)
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
