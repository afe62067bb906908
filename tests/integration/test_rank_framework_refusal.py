"""A real rank process (`python -m mindpulse.workers.rank_main --job job.json`, the command msrun
runs and the code the Ray rank actor calls) whose path finds an unsupported MindSpore, or no
framework at all, refuses at start: exit 2 and one line naming its host, what it found and
where, the range and the fix, never a ModuleNotFoundError's traceback. The unsupported
MindSpore is a real package on disk, first on the rank's PYTHONPATH, that reports 2.6.0 in
MindSpore's own layout (`mindspore/version.py`); the missing one is a real environment that
holds neither framework (tests/headless_venv.py, what a CPU-only head installs)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from mindpulse.config import from_dict
from mindpulse.launcher.spec import rank_settings

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def _job_json(tmp: Path, **job) -> Path:
    cfg = from_dict({"job": job, "output": {"root": str(tmp / "runs")}}, source="test")
    settings = rank_settings(cfg, run_dir=str(tmp), run_id="t", attempt=0, aggregator="none", ray_address="",
                             relays={}, resume=None)
    path = tmp / "job.json"
    path.write_text(settings.to_json())
    return path


def _rank(job: Path, pythonpath: Path, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MINDPULSE_SETTINGS")}
    full.update(PYTHONPATH=str(pythonpath), RANK_ID="0", **env)
    return subprocess.run([sys.executable, "-m", "mindpulse.workers.rank_main", "--job", str(job)],
                          capture_output=True, text=True, timeout=120, env=full, cwd=ROOT)


def _old_mindspore(root: Path) -> Path:
    pkg = root / "mindspore"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from mindspore.version import __version__\n")
    (pkg / "version.py").write_text("__version__ = '2.6.0'\n")
    return root


def test_a_rank_that_finds_an_unsupported_mindspore_exits_2_naming_node_version_range_and_fix(tmp_path):
    fake = _old_mindspore(tmp_path / "shadow")
    res = _rank(_job_json(tmp_path), fake)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out[-3000:]
    host = socket.gethostname()
    assert (f"[rank 0] mindpulse: node {host}: mindspore 2.6.0 (from {fake / 'mindspore'}) is older than the "
            "supported range >=2.7.0,<2.11; fix: install a mindspore in that range") in res.stderr, out[-3000:]
    assert "Traceback" not in out and "ModuleNotFoundError" not in out, out[-3000:]
    assert "[rank 0] finished with exit code 2" in res.stdout, res.stdout[-2000:]


@pytest.mark.parametrize("module", ["mindpulse.workers.rank_main", "mindpulse.workers.scheduler"])
def test_the_scheduler_refuses_the_same_mindspore(module, tmp_path):
    """msrun starts the scheduler through rank_main; the ray backend's node agent starts its module."""
    fake = _old_mindspore(tmp_path / "shadow")
    job = _job_json(tmp_path)
    full = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    full.update(PYTHONPATH=str(fake), MS_ROLE="MS_SCHED", MINDPULSE_SETTINGS=str(job))
    res = subprocess.run([sys.executable, "-m", module, *(["--job", str(job)] if module.endswith("rank_main") else [])],
                         capture_output=True, text=True, timeout=120, env=full, cwd=ROOT)
    assert res.returncode == 2, (res.stdout + res.stderr)[-3000:]
    assert f"mindpulse scheduler: node {socket.gethostname()}: mindspore 2.6.0" in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr


def test_a_recipe_rank_where_neither_framework_is_installed_names_both(tmp_path):
    from headless_venv import headless_venv

    python = headless_venv() / "bin" / "python"
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MINDPULSE_SETTINGS")}
    res = subprocess.run([str(python), "-m", "mindpulse.workers.rank_main", "--job", str(_job_json(tmp_path))],
                         capture_output=True, text=True, timeout=120, env=dict(full, RANK_ID="0"), cwd=ROOT)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out[-3000:]
    host = socket.gethostname()
    # the recipe trains MindFormers' LLaMA: both are named, with the fix for each
    assert f"node {host}: no mindspore can be imported (supported: >=2.7.0,<2.11); fix: install the MindSpore " \
           "that matches this node's CANN toolkit" in res.stderr, out[-3000:]
    assert f"node {host}: no mindformers can be imported (supported: >=1.7.0,<2.0)" in res.stderr, out[-3000:]
    assert "job.mindformers.source" in res.stderr and "Traceback" not in out, out[-3000:]
