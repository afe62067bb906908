"""`pip install mindpulse` never installs, upgrades or downgrades the user's MindSpore or
MindFormers (nor the numpy their MindSpore needs).

Shown twice: in the package's built metadata (no `Requires-Dist` of the core install names
either framework; the `mindspore` extra carries the tested pair), and by pip's own resolver,
`pip install --dry-run --report` of this checkout into an environment that holds another
MindSpore (2.10.0) and numpy 2, and into one that holds none: the report lists mindpulse to
install and neither framework nor numpy. The environment is tests/headless_venv.py's (core
dependencies, no framework); the other MindSpore and numpy are their installed metadata
(`*.dist-info`, what pip reads to know what an environment holds), first on its path.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT
from headless_venv import headless_venv

from mindpulse.frameworks.framework_support import Framework, check_version

pytestmark = [pytest.mark.slow]
FRAMEWORKS = {"mindspore", "mindformers"}


def _metadata(tmp: Path, python: Path) -> list[str]:
    """The Requires-Dist lines of the package built from this checkout (its wheel's METADATA)."""
    code = ("import sys; from setuptools import build_meta as b; "
            "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))")
    res = subprocess.run([str(python), "-c", code, str(tmp)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    meta = (tmp / res.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    return [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]


def test_the_core_install_requires_neither_framework_and_the_extra_carries_the_tested_pair(tmp_path):
    import sys

    requires = _metadata(tmp_path, Path(sys.executable))
    core = [r for r in requires if "extra ==" not in r]
    named = {r.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].split("~")[0].strip().lower()
             for r in core}
    assert not named & FRAMEWORKS, f"the core install requires {named & FRAMEWORKS}: {core}"
    numpy = [r for r in core if r.lower().startswith("numpy")]
    assert numpy and "<" not in numpy[0], f"the core install caps numpy (it could downgrade the user's): {numpy}"
    extra = [r.split(";")[0].replace(" ", "") for r in requires if "extra == \"mindspore\"" in r]
    assert any(r.startswith("mindspore>=2.9.0,<2.10") or r.startswith("mindspore<2.10,>=2.9.0") for r in extra), extra
    assert "mindformers==1.9.0" in extra and any(r.startswith("numpy") and "<2" in r for r in extra), extra
    # the tested pair is inside the supported range each rank checks
    assert check_version(Framework.MINDSPORE, "2.9.0").ok and check_version(Framework.MINDFORMERS, "1.9.0").ok


def _installed(folder: Path, name: str, version: str) -> None:
    info = folder / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


@pytest.mark.parametrize("holds", ["mindspore 2.10.0 and numpy 2", "no framework"])
def test_pip_would_install_neither_framework_into_an_environment(holds, tmp_path):
    venv = headless_venv()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if holds != "no framework":
        there = tmp_path / "site"
        _installed(there, "mindspore", "2.10.0")
        _installed(there, "numpy", "2.1.0")
        env["PYTHONPATH"] = str(there)
    py = str(venv / "bin" / "python")
    listed = subprocess.run([py, "-m", "pip", "list", "--format=json"], capture_output=True, text=True, env=env,
                            timeout=120)
    versions = {d["name"].lower(): d["version"] for d in json.loads(listed.stdout)}
    if holds == "no framework":
        assert not FRAMEWORKS & set(versions), f"the environment holds {FRAMEWORKS & set(versions)}"
    else:
        assert (versions.get("mindspore"), versions.get("numpy")) == ("2.10.0", "2.1.0"), versions
    report = tmp_path / "report.json"
    res = subprocess.run([py, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report), str(ROOT)],
                         capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    install = {i["metadata"]["name"].lower(): i["metadata"]["version"]
               for i in json.loads(report.read_text())["install"]}
    assert "mindpulse" in install, f"the report does not list mindpulse itself: {install}"
    touched = {n: v for n, v in install.items() if n in FRAMEWORKS | {"numpy"}}
    assert not touched, f"pip install mindpulse would install {touched} into an environment that holds {holds}"
