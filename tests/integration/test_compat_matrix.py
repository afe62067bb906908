"""The oldest supported pair and the newest MindSpore, each in its own environment holding only
that framework (mindpulse installed beside it with `--no-deps`): one real short launch per path,
judged as `make compat` judges its cells (compat/features.py). The main environment covers the
pair in between (MindFormers 1.9.0 + MindSpore 2.9) in the rest of the suite.

The environments are cached (`~/.cache/mindpulse/compat/`, `MINDPULSE_COMPAT_CACHE`): on a fresh
machine the first test of a pair builds its venv (downloads MindSpore and, for the oldest pair,
MindFormers' requirements) before it launches; docs/compat.md gives the build's time."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "compat"))

import features  # noqa: E402
import matrix  # noqa: E402
import venvs  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.cluster,
              # a cold cache downloads and installs a pair's framework and mindpulse's dependencies
              pytest.mark.timeout(venvs.PIP_TIMEOUT_S + features.LAUNCH_TIMEOUT_S)]

STEPS = 3
OLDEST, NEWEST = (pair for pair, _ in matrix.oldest_and_newest())
# one launch per path: the oldest pair on each of its three paths (the MindFormers APIs of the
# YAML path and the recipe differ most from the main environment's), the newest MindSpore on the
# script path whose attach reaches furthest into MindSpore (Model.train's callbacks and train cell)
CASES = [(OLDEST, matrix.Feature.SCRIPT_MODEL_TRAIN), (OLDEST, matrix.Feature.MINDFORMERS_YAML),
         (OLDEST, matrix.Feature.RECIPE), (NEWEST, matrix.Feature.SCRIPT_MODEL_TRAIN)]


@pytest.fixture(scope="module")
def built():
    cache: dict[str, venvs.Venv] = {}

    def get(pair: venvs.Pair) -> venvs.Venv:
        if pair.name not in cache:
            cache[pair.name] = venvs.ensure(pair, log=lambda m: print(m, flush=True))
        return cache[pair.name]

    return get


@pytest.mark.parametrize("pair, feature", CASES, ids=[f"{p.name}-{f.value}" for p, f in CASES])
def test_a_supported_pair_runs_its_path(run_cli, built, tmp_path, pair, feature):
    venv = built(pair)
    assert _framework(venv) == (pair.mindspore, pair.mindformers), "the venv holds another framework"
    r = run_cli(*features.launch_args(feature, STEPS, tmp_path), exe=features.cli(venv), timeout=600)
    passed, reason = features.judge(feature, r.returncode, r.run_dir, STEPS, r.stdout + r.stderr)
    assert passed, f"{pair.name} {feature.value}: {reason}\n{r.output}"


def _framework(venv: venvs.Venv) -> tuple[str | None, str | None]:
    """The MindSpore and MindFormers versions installed in the venv (None: not installed)."""
    import subprocess

    code = ("import importlib.metadata as m\nfor n in ('mindspore', 'mindformers'):\n    try: print(m.version(n))\n"
            "    except m.PackageNotFoundError: print('-')")
    got = subprocess.run([str(venv.python), "-c", code], capture_output=True, text=True, timeout=120)
    ms, mf = (None if v == "-" else v for v in got.stdout.split())
    return ms, mf
