"""The node probe's rank-Python part on real subprocesses, with small packages on the path.

The packages stand in for a MindSpore outside the range, one that hangs or crashes at import,
and a MindFormers source tree; the real MindSpore's probe runs in tests/integration/test_doctor.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mindpulse.frameworks.framework_probe import NodeProbe, probe_node


def package(root: Path, name: str, body: str) -> Path:
    (root / name).mkdir(parents=True, exist_ok=True)
    (root / name / "__init__.py").write_text(body)
    return root


def probe(tmp_path: Path, **kw) -> NodeProbe:
    kw.setdefault("root", str(tmp_path / "no-ascend"))
    kw.setdefault("run_npu_smi", False)
    kw.setdefault("python", sys.executable)
    return probe_node(**kw)


def test_a_mindspore_on_the_rank_path_is_what_the_probe_reports(tmp_path):
    fake = package(tmp_path / "fake", "mindspore", '__version__ = "2.6.0"\n')
    p = probe(tmp_path, env={"PYTHONPATH": str(fake)})
    assert p.error == "", p.error
    assert p.mindspore.version == "2.6.0" and p.mindspore.path == str(fake / "mindspore")
    assert p.mindspore.origin == "source tree" and p.mindspore.built_for == []
    assert p.mindspore.usable is None, "a package without MindSpore's internals cannot say its usable targets"
    assert p.python["executable"] == sys.executable
    assert p.mindpulse.path and p.mindpulse.version, p.mindpulse
    assert p.ray.version, "Ray's version is read from the ranks' Python"
    assert p.cann.version is None and p.driver.version is None  # the root prefix holds no Ascend files


def base_python() -> Path:
    """The interpreter this venv was made from: it has neither MindSpore nor mindpulse."""
    exe = Path(sys.base_prefix) / "bin" / "python3"
    if not exe.exists():
        pytest.skip(f"no base interpreter at {exe}")
    return exe


def test_a_python_without_mindspore_or_mindpulse(tmp_path):
    p = probe(tmp_path, python=str(base_python()))
    assert p.error == "", p.error
    assert p.mindspore.missing and p.mindspore.version is None, p.mindspore
    assert "No module named 'mindspore'" in p.mindspore.error
    assert not p.mindpulse.found, "the base interpreter has no mindpulse: the ranks could not start"


def test_a_broken_mindspore_is_not_a_missing_one(tmp_path):
    broken = package(tmp_path / "broken", "mindspore", 'raise ImportError("libmindspore_core.so: cannot open")\n')
    p = probe(tmp_path, env={"PYTHONPATH": str(broken)})
    assert p.mindspore.version is None and not p.mindspore.missing
    assert "libmindspore_core.so" in p.mindspore.error
    inner = package(tmp_path / "inner", "mindspore", "import mindspore_dependency_not_here\n")
    p = probe(tmp_path, env={"PYTHONPATH": str(inner)})
    assert not p.mindspore.missing, "a module missing inside mindspore is a broken install, not a missing one"
    assert "mindspore_dependency_not_here" in p.mindspore.error


def test_a_hang_at_import_becomes_a_reported_failure(tmp_path):
    slow = package(tmp_path / "slow", "mindspore", "import time\ntime.sleep(60)\n")
    p = probe(tmp_path, env={"PYTHONPATH": str(slow)}, timeout=3)
    assert "did not finish within 3 s" in p.error, p.error
    assert p.mindpulse.path, "what was read before the hang is kept"
    assert p.seconds < 30


def test_a_crash_at_import_names_the_signal_and_keeps_the_parts_before_it(tmp_path):
    crash = package(tmp_path / "crash", "mindspore", "import os\nos.abort()\n")
    p = probe(tmp_path, env={"PYTHONPATH": str(crash)})
    assert "killed by signal SIGABRT after its mindformers part" in p.error, p.error
    assert p.mindpulse.path and p.python


def test_job_mindformers_source_is_first_on_the_rank_path(tmp_path):
    src = package(tmp_path / "mf-clone", "mindformers", '"""MindFormers."""\n__version__ = "1.8.0"\n')
    p = probe(tmp_path, mindformers_source=str(src))
    assert p.mindformers.version == "1.8.0", p.mindformers
    assert p.mindformers.path == str(src / "mindformers")
    assert p.mindformers.origin == "job.mindformers.source"


def test_the_probe_travels_as_a_dict(tmp_path):
    fake = package(tmp_path / "fake", "mindspore", '__version__ = "2.10.0"\n')
    p = probe(tmp_path, env={"PYTHONPATH": str(fake)})
    back = NodeProbe.from_dict(p.to_dict())
    assert back == p and back.mindspore.version == "2.10.0"


def test_a_local_call_that_is_cancelled_leaves_no_process(tmp_path):
    """A launch refused before it read the probe's answer (Ray did not start) ends the probe."""
    import time

    from mindpulse.frameworks.framework_probe import probe_node_dict
    from mindpulse.launcher.node_probes import call_local

    slow = package(tmp_path / "slow", "mindspore", "import time\ntime.sleep(60)\n")
    call = call_local(probe_node_dict, {"env": {"PYTHONPATH": str(slow)}, "python": sys.executable,
                                        "root": str(tmp_path), "run_npu_smi": False})
    deadline = time.time() + 20
    while not call._procs and time.time() < deadline:
        time.sleep(0.05)
    assert call._procs, "the probe's process did not start"
    proc = call._procs[0]
    call.cancel()
    assert proc.poll() is not None, "the probe's process still runs after cancel"
    [answer] = call.wait(10)
    assert "killed by signal SIGKILL" in answer.result["error"], answer
