"""The rank's check of the MindSpore and MindFormers it is about to import
(workers/framework_check.py): which frameworks a job needs, where `import` would find each
and its version (read from the package's own source: a source tree has no metadata of its
own), `job.mindformers.source` put ahead of an installed copy, and the refusal's message.
The packages here are small real packages on disk, found by Python's own import search."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from mindpulse.config import from_dict
from mindpulse.frameworks.framework_support import Fit, Framework, FrameworkVersionError, needed
from mindpulse.workers import framework_check
from mindpulse.workers.framework_check import check, find, put_first

MF = Framework.MINDFORMERS
MS = Framework.MINDSPORE


def _package(root: Path, name: str, *, version_py: str | None = None, init: str = "") -> Path:
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(init)
    if version_py is not None:
        (pkg / "version.py").write_text(f"__version__ = {version_py!r}\n")
    return pkg


@pytest.fixture
def path_first(monkeypatch):
    """Put folders first on sys.path for one test (and forget what was found through them)."""

    def put(folder: Path) -> None:
        monkeypatch.syspath_prepend(str(folder))
        importlib.invalidate_caches()

    monkeypatch.delitem(sys.modules, "mindspore", raising=False)
    monkeypatch.delitem(sys.modules, "mindformers", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    return put


def _job(**job):
    return from_dict({"job": job}, source="test").job


def test_which_frameworks_each_job_needs(tmp_path):
    (tmp_path / "t.py").write_text("")
    assert needed(_job()) == (MS, MF), "the built-in recipe trains MindFormers' LLaMA"
    assert needed(_job(mindformers={"config": "x.yaml"})) == (MS, MF)
    assert needed(_job(script=str(tmp_path / "t.py"))) == (MS,)
    assert needed(_job(), task="card_check") == (MS,), "the card check runs MindSpore alone"


def test_versions_are_read_from_the_package_that_import_would_load(tmp_path, path_first):
    _package(tmp_path, "mindspore", version_py="2.6.0", init="from mindspore.version import __version__\n")
    _package(tmp_path, "mindformers", init='"""docs"""\nimport os\n__version__ = "1.9.0"\nraise RuntimeError\n')
    path_first(tmp_path)
    ms, mf = find(MS), find(MF)
    assert (ms.version, ms.origin) == ("2.6.0", str(tmp_path / "mindspore"))
    assert (mf.version, mf.origin) == ("1.9.0", str(tmp_path / "mindformers")), \
        "read from the source, without running the package (which would raise here)"
    assert "mindformers" not in sys.modules and "mindspore" not in sys.modules, "the check imported a framework"


def test_a_missing_framework_is_found_missing(tmp_path, path_first, monkeypatch):
    monkeypatch.setitem(sys.modules, "mindformers", None)  # what `import` answers for a package that is not there
    found = find(MF)
    assert (found.version, found.origin) == (None, None)


def test_a_tree_put_first_wins_over_the_installed_copy(tmp_path, path_first):
    installed, tree = tmp_path / "site", tmp_path / "clone"
    _package(installed, "mindformers", init='__version__ = "1.8.0"\n')
    _package(tree, "mindformers", init='__version__ = "1.9.0"\n')
    path_first(installed)
    assert find(MF).origin == str(installed / "mindformers")
    put_first(str(tree))
    try:
        found = find(MF)
        assert (found.version, found.origin) == ("1.9.0", str(tree / "mindformers"))
        import os

        assert os.environ["PYTHONPATH"] == f"{tree}{os.pathsep}/elsewhere", "subprocesses would not see the tree"
        put_first(str(tree))
        assert sys.path.count(str(tree)) == 1 and os.environ["PYTHONPATH"].count(str(tree)) == 1
    finally:
        sys.path.remove(str(tree))


def test_an_out_of_range_or_missing_framework_refuses_naming_node_version_range_and_fix(tmp_path, path_first,
                                                                                       monkeypatch):
    _package(tmp_path, "mindspore", version_py="2.6.0")
    path_first(tmp_path)
    monkeypatch.setitem(sys.modules, "mindformers", None)
    with pytest.raises(FrameworkVersionError) as err:
        check((MS, MF), node="gpu-node-7")
    text = str(err.value)
    assert [c.fit for c in err.value.checks] == [Fit.TOO_OLD, Fit.MISSING]
    assert f"node gpu-node-7: mindspore 2.6.0 (from {tmp_path / 'mindspore'}) is older than the supported " \
           "range >=2.7.0,<2.11; fix: install a mindspore in that range" in text, text
    assert "node gpu-node-7: no mindformers can be imported" in text and "job.mindformers.source" in text, text


def test_a_supported_pair_passes_and_names_where_each_came_from(tmp_path, path_first):
    _package(tmp_path, "mindspore", version_py="2.10.0")
    _package(tmp_path, "mindformers", init='__version__ = "1.8.0"\n')
    path_first(tmp_path)
    found = check((MS, MF), node="n")
    assert [f.line() for f in found] == [f"mindspore 2.10.0 from {tmp_path / 'mindspore'}",
                                         f"mindformers 1.8.0 from {tmp_path / 'mindformers'}"]


def test_a_package_without_a_version_in_its_source_falls_back_to_its_metadata(tmp_path, path_first):
    _package(tmp_path, "mindspore", init="from ._v import __version__\n")
    info = tmp_path / "mindspore-2.8.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mindspore\nVersion: 2.8.0\n")
    path_first(tmp_path)
    assert find(MS).version == "2.8.0"


def test_the_refusal_exit_code_is_the_usage_code():
    from mindpulse.launcher.spec import ExitCode

    assert framework_check.REFUSED_EXIT == int(ExitCode.USAGE)


def test_a_run_whose_rank_refused_its_framework_is_not_restarted(tmp_path):
    from mindpulse.launcher.failure_policy import Decision, FailurePolicy
    from mindpulse.launcher.spec import RankOutcome, RunResult, RunStatus

    def failed(error: str) -> RunResult:
        return RunResult(status=RunStatus.FAILED, outcomes={0: RankOutcome(0, exit_code=2, error=error)})

    policy = FailurePolicy(max_restarts=3, checkpoints_dir=tmp_path)
    refused = failed("FrameworkVersionError: node n: mindspore 2.6.0 is older than the supported range")
    assert policy.decide(refused, 0, False, None).decision is Decision.STOP, "a restart would refuse again"
    assert policy.decide(failed("RuntimeError: boom"), 0, False, None).decision is Decision.RESTART
