"""`pip install .` (a wheel, not the editable checkout) into a fresh virtual environment, then
`mindpulse launch` from another folder runs the default job: the package carries its configs,
the recipe's data and base checkpoint, the kernel source and the MindFormers YAML."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def test_a_wheel_installed_elsewhere_runs_the_default_job(run_cli, tmp_path):
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheels), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheels.glob("mindpulse-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    # the dependencies (MindSpore, MindFormers, Ray: minutes to install) come from this
    # environment's site-packages, added as a plain path: its editable mindpulse is not
    (site / "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    py = venv / "bin" / "python"
    inst = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--ignore-installed", "-q", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stderr[-3000:]
    where = subprocess.run([str(py), "-c", "import mindpulse; print(mindpulse.__file__)"], capture_output=True,
                           text=True, timeout=60, cwd=tmp_path)
    assert where.stdout.strip().startswith(str(site)), f"not the installed copy: {where.stdout} {where.stderr}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = run_cli("launch", "--set", "train.steps=3", "--set", "monitor.per_print_step=3", timeout=600,
                exe=[str(venv / "bin" / "mindpulse")], cwd=elsewhere)
    assert r.returncode == 0, r.output
    s = r.summary
    assert s["status"] == "succeeded" and s["steps_completed"] == 3 and s["name"] == "local-cpu", s
    assert s["first_loss"] < 3.0, "the base checkpoint was not loaded (a random model's loss is ~5.5)"
    import yaml

    init_from = yaml.safe_load((r.run_dir / "config.yaml").read_text())["job"]["recipe"]["init_from"]
    assert init_from.startswith(str(site)), f"the base checkpoint came from {init_from}, not the installed package"
    assert not list(elsewhere.iterdir()), f"the launch wrote into the folder it ran in: {list(elsewhere.iterdir())}"
