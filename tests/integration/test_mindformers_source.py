"""`job.mindformers.source`: a MindFormers tree unpacked from a release into a folder, not
installed, is what every rank imports, ahead of the MindFormers installed in its environment.

The tree is MindFormers 1.9.0's `mindformers/` package and `configs/` folder taken out of its
published wheel (`pip download --no-deps mindformers==1.9.0`, kept under
`$XDG_CACHE_HOME/mindpulse/`): the layout a `git clone` has (MindFormers reads
`configs/general/run_general_task.yaml` beside its package). One line is added at the end of
its `__init__.py`, printing where the package was imported from, so each rank's log shows the
import itself, beside the rank's own start-up line that names where its MindFormers comes from."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
CONFIG = ROOT / "cluster_configs" / "mindformers_finetune.yaml"
RELEASE = "1.9.0"
MARK = "mindformers imported from the source tree:"


def _release_wheel() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mindpulse" / "wheels"
    found = sorted(cache.glob(f"mindformers-{RELEASE}-*.whl"))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(cache),
                              f"mindformers=={RELEASE}"], capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        found = sorted(cache.glob(f"mindformers-{RELEASE}-*.whl"))
    assert found, f"no mindformers {RELEASE} wheel in {cache}"
    return found[-1]


def _unpacked_tree(into: Path) -> Path:
    with zipfile.ZipFile(_release_wheel()) as whl:
        whl.extractall(into, [n for n in whl.namelist() if n.startswith(("mindformers/", "configs/"))])
    init = into / "mindformers" / "__init__.py"
    init.write_text(init.read_text() + f"\nprint({MARK!r}, __file__, flush=True)\n")
    return into


def test_ranks_import_mindformers_from_the_source_tree_ahead_of_the_installed_one(run_cli, tmp_path):
    tree = _unpacked_tree(tmp_path / "mindformers-src")
    installed = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                                "print(u.find_spec('mindformers').submodule_search_locations[0])"],
                               capture_output=True, text=True, timeout=120).stdout.strip()
    assert installed and not installed.startswith(str(tree)), "MindFormers must also be installed here"
    r = run_cli("launch", str(CONFIG), "--set", "train.steps=3", "--set", "monitor.per_print_step=1",
                "--set", f"job.mindformers.source={tree}", timeout=600)
    assert r.returncode == 0, r.output
    assert r.summary["status"] == "succeeded" and r.summary["steps_completed"] == 3, r.summary
    for rank in (0, 1):
        log = (r.run_dir / "logs" / f"rank_{rank}.log").read_text()
        assert f"mindformers {RELEASE} from {tree / 'mindformers'}" in log, log[-3000:]
        assert f"{MARK} {tree / 'mindformers' / '__init__.py'}" in log, log[-3000:]
        assert installed not in log.split(MARK)[0], "the installed MindFormers was named before the tree's import"
    assert (r.run_dir / "config.yaml").read_text().count(str(tree)) == 1, "the run's config does not name the tree"
