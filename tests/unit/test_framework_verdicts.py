"""The verdicts on a node's probe, and the launch's refusal message built from them."""

from __future__ import annotations

import pytest

from mindpulse.config import RunConfig, load_config
from mindpulse.frameworks.ascend_versions import CannToolkit, NpuSmi, VersionFile
from mindpulse.frameworks.framework_probe import MindSporeInfo, NodeProbe, Package
from mindpulse.frameworks.framework_support import INSTALL_HINT, Framework, needed
from mindpulse.launcher.doctor import refusal, verdicts
from mindpulse.launcher.framework_check import Level, failures, judge, mindformers_source
from mindpulse.launcher.node_probes import NodeAnswer

SITE = "/venv/lib/python3.11/site-packages"


def cfg(*sets: str) -> RunConfig:
    c, _ = load_config(None, list(sets))
    return c


def healthy(ms: str = "2.9.0", mf: str | None = "1.9.0", built=("CPU", "GPU", "Ascend"), usable=("CPU",)) -> NodeProbe:
    return NodeProbe(
        host="node-a", python={"version": "3.11.7", "executable": "/venv/bin/python"},
        mindpulse=Package(version="0.1.0", path=f"{SITE}/mindpulse", origin="site-packages"),
        ray=Package(version="2.60.0"),
        mindspore=MindSporeInfo(version=ms, path=f"{SITE}/mindspore", origin="site-packages", built_for=list(built),
                                usable=list(usable)),
        mindformers=Package(version=mf, path=f"{SITE}/mindformers" if mf else None,
                            origin="site-packages" if mf else ""),
        msrun="/venv/bin/msrun")


def ascend_ready(p: NodeProbe) -> NodeProbe:
    p.cann = CannToolkit(version="8.3.RC1", path="/usr/local/Ascend/ascend-toolkit/8.3.RC1/aarch64-linux/"
                         "ascend_toolkit_install.info", layout="ascend-toolkit")
    p.driver = VersionFile(version="25.0.rc1.1", path="/usr/local/Ascend/driver/version.info")
    p.npu_smi = NpuSmi(path="/usr/local/sbin/npu-smi", version="25.0.rc1.1")
    p.mindspore.usable = ["CPU", "Ascend"]
    return p


def levels(rows) -> dict[str, Level]:
    return {v.item: v.level for v in rows}


def test_the_default_job_on_a_healthy_cpu_node_fits():
    rows = judge(cfg(), healthy(), "n0")
    assert not failures(rows), [v for v in failures(rows)]
    lv = levels(rows)
    assert lv["mindspore"] is Level.OK and lv["mindformers"] is Level.OK and lv["mindformers pair"] is Level.OK
    # no CANN, driver or npu-smi: said, and no failure for a cpu job
    assert lv["cann toolkit"] is Level.INFO and lv["npu driver"] is Level.INFO and lv["npu-smi"] is Level.INFO


@pytest.mark.parametrize("version,word", [("2.6.0", "2.6.0"), ("2.11.0", "2.11.0"), ("2.7.1+ascend", None)])
def test_mindspore_outside_the_range_fails_naming_what_was_found_and_the_range(version, word):
    rows = judge(cfg(), healthy(ms=version), "n0")
    ms = next(v for v in rows if v.item == "mindspore")
    if word is None:  # a CANN-matched local build of 2.7.1 is in range
        assert ms.level is Level.OK
        return
    assert ms.level is Level.FAIL and word in ms.found and ms.wanted == ">=2.7.0,<2.11"
    assert ms.fix == INSTALL_HINT


def test_missing_and_broken_mindspore():
    p = healthy()
    p.mindspore = MindSporeInfo(error="ModuleNotFoundError: No module named 'mindspore'", missing=True)
    ms = next(v for v in judge(cfg(), p, "n0") if v.item == "mindspore")
    assert ms.level is Level.FAIL and "not installed" in ms.found and ms.fix == INSTALL_HINT
    p.mindspore = MindSporeInfo(error="ImportError: libgomp.so.1: cannot open shared object file")
    ms = next(v for v in judge(cfg(), p, "n0") if v.item == "mindspore")
    assert ms.level is Level.FAIL and "libgomp" in ms.found and "repair" in ms.fix


def test_an_ascend_job_needs_cann_the_driver_and_mindspore_s_ascend_plugin():
    c = cfg("world.device=ascend")
    rows = judge(c, healthy(), "n0")
    bad = {v.item for v in failures(rows)}
    assert {"cann toolkit", "npu driver", "mindspore targets"} <= bad, bad
    assert levels(rows)["npu-smi"] is Level.WARN  # telemetry falls back: said, not refused
    assert not failures(judge(c, ascend_ready(healthy()), "n0"))


def test_a_mindspore_built_without_the_ascend_plugin_is_refused_for_an_ascend_job():
    p = ascend_ready(healthy(built=("CPU",), usable=("CPU",)))
    t = next(v for v in judge(cfg("world.device=ascend"), p, "n0") if v.item == "mindspore targets")
    assert t.level is Level.FAIL and "built for CPU" in t.found and "Ascend" in t.fix


def test_an_ascend_plugin_that_does_not_load_is_refused_with_the_load_error():
    p = ascend_ready(healthy())
    p.mindspore.usable = ["CPU"]
    p.mindspore.load_error = "Load dynamic library: libmindspore_ascend.so.2 failed. libge_runner.so: cannot open"
    t = next(v for v in judge(cfg("world.device=ascend"), p, "n0") if v.item == "mindspore targets")
    assert t.level is Level.FAIL and "libge_runner.so" in t.found and "set_env.sh" in t.fix


def test_mindformers_range_and_pair():
    rows = judge(cfg(), healthy(mf="1.6.0"), "n0")
    mf = next(v for v in rows if v.item == "mindformers")
    assert mf.level is Level.FAIL and mf.wanted == ">=1.7.0,<2.0" and "mindformers 1.9.0 with mindspore 2.9.0" in mf.fix
    # MindFormers 1.8.0 was released with MindSpore 2.7.2: on 2.9.0 a warning, not a refusal
    rows = judge(cfg(), healthy(mf="1.8.0"), "n0")
    pair = next(v for v in rows if v.item == "mindformers pair")
    assert pair.level is Level.WARN and "2.7.2" in pair.found and not failures(rows)
    rows = judge(cfg(), healthy(ms="2.7.1", mf="1.8.0"), "n0")
    assert levels(rows)["mindformers pair"] is Level.OK  # 2.7.1 is the 2.7 line 1.8.0 names


def test_missing_mindformers_fails_only_for_a_mindformers_job(tmp_path):
    p = healthy(mf=None)
    assert "mindformers" in {v.item for v in failures(judge(cfg(), p, "n0"))}  # the default recipe needs it
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    c = cfg(f"job.script={script}", "job.recipe=null")
    assert Framework.MINDFORMERS not in needed(c.job)
    assert not failures(judge(c, p, "n0")) and "mindformers" not in levels(judge(c, p, "n0"))


def test_mindformers_source_is_read_when_the_config_has_the_key():
    c = cfg()
    assert mindformers_source(c) == ""  # no job.mindformers at all

    class WithSource:  # the key branch `pack` adds to MindFormersJobConfig
        source = "/src/mindformers-1.8.0"

    c.job.mindformers = WithSource()  # type: ignore[assignment]
    assert mindformers_source(c) == "/src/mindformers-1.8.0"
    assert Framework.MINDFORMERS in needed(c.job)


def test_msrun_backend_needs_msrun_beside_the_rank_python():
    p = healthy()
    p.msrun = None
    row = next(v for v in judge(cfg("backend=msrun"), p, "n0") if v.item == "msrun")
    assert row.level is Level.FAIL and "msrun is installed with MindSpore" in row.fix
    assert "msrun" not in levels(judge(cfg(), p, "n0"))  # the ray backend does not run it


def test_no_mindpulse_in_the_rank_python_fails():
    p = healthy()
    p.mindpulse = Package()
    row = next(v for v in judge(cfg(), p, "n0") if v.item == "mindpulse")
    assert row.level is Level.FAIL and "pip install mindpulse" in row.fix


def test_a_python_that_did_not_report_and_a_hang_after_mindspore():
    p = NodeProbe(error="the ranks' Python /x/python cannot be started: [Errno 2] No such file or directory")
    rows = judge(cfg(), p, "n0")
    assert [v.item for v in rows] == ["python"] and rows[0].level is Level.FAIL and "cannot be started" in rows[0].found
    p = healthy()
    p.error = "the ranks' Python did not finish within 120 s (a hang at import?)"
    assert "probe" in {v.item for v in failures(judge(cfg(), p, "n0"))}


def test_the_refusal_names_the_node_what_was_found_the_range_the_fix_and_doctor():
    got = [NodeAnswer(name="10.0.0.7 (node-b)", result=healthy(ms="2.6.0").to_dict()),
           NodeAnswer(name="10.0.0.8", error="no answer within 180 s")]
    text = refusal(verdicts(cfg(), got), "cluster.yaml")
    assert "node 10.0.0.7 (node-b): mindspore 2.6.0" in text and "(supported: >=2.7.0,<2.11)" in text
    assert "fix: " + INSTALL_HINT in text
    assert "node 10.0.0.8: probe no answer within 180 s" in text
    assert text.rstrip().endswith("run `mindpulse doctor cluster.yaml` to see everything each node has")


def test_no_eligible_node_is_a_failure():
    judged = verdicts(cfg(), [])
    assert failures(judged[0][1]) and "no alive node" in judged[0][1][0].found
