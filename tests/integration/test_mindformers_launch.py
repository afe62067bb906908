"""End to end: a MindFormers fine-tune from its own YAML (`job.mindformers`), two real ranks
running MindFormers' Trainer in data parallel on CPU, launched by `mindpulse launch`; and
`job.mindformers.source`, a MindFormers tree unpacked from a release into a folder, not
installed, which every rank imports ahead of the MindFormers installed in its environment.

The tree is MindFormers 1.9.0's `mindformers/` package and `configs/` folder taken out of its
published wheel (`pip download --no-deps mindformers==1.9.0`, kept under
`$XDG_CACHE_HOME/mindpulse/`): the layout a `git clone` has (MindFormers reads
`configs/general/run_general_task.yaml` beside its package). One line is added at the end of
its `__init__.py`, printing where the package was imported from, so each rank's log shows the
import itself, beside the rank's own start-up line that names where its MindFormers comes from."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT

from mindpulse.rundir.metrics_store import read_records

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
CONFIG = ROOT / "cluster_configs" / "mindformers_finetune.yaml"
MF_YAML = ROOT / "workers" / "recipes" / "mindformers" / "llama_tiny_finetune.yaml"
RELEASE = "1.9.0"
MARK = "mindformers imported from the source tree:"


def records(run_dir: Path) -> tuple[list[dict], list[dict]]:
    wire = list(read_records(run_dir / "metrics.msgpack"))
    return [o for o in wire if o.get("t") == "step"], [o for o in wire if o.get("t") == "reduced"]


# MindFormers' own model class, built from the YAML's model config, takes the best checkpoint
LOAD = textwrap.dedent("""\
    import json, sys
    import mindspore as ms
    import yaml
    from mindpulse.workers.lean_mindformers import model_classes
    LlamaConfig, LlamaForCausalLM = model_classes()
    mc = {k: v for k, v in yaml.safe_load(open(sys.argv[1]))["model"]["model_config"].items() if k != "type"}
    model = LlamaForCausalLM(LlamaConfig(**mc))
    not_loaded, _ = ms.load_param_into_net(model, ms.load_checkpoint(sys.argv[2]), strict_load=True)
    print(json.dumps({"not_loaded": not_loaded, "params": len(model.parameters_dict())}))
""")


def test_mindformers_finetune_from_its_yaml(run_cli, tmp_path):
    r = run_cli("launch", str(CONFIG), "--set", "output.report=false", timeout=600)
    assert r.returncode == 0, r.output
    s = r.summary
    assert s["status"] == "succeeded" and s["steps_completed"] == 30, s
    pk, red = records(r.run_dir)
    by_step = {o["step"]: o for o in red}
    assert sorted(by_step)[-1] == 30
    # the loss falls: reduced mean loss of the first 3 steps against the last 3
    first = statistics.fmean(by_step[i]["loss_mean"] for i in (1, 2, 3))
    last = statistics.fmean(by_step[i]["loss_mean"] for i in (28, 29, 30))
    assert last < first, f"loss did not fall: {first:.4f} -> {last:.4f}"
    # grad norm (MindFormers' clip norm, after the all-reduce) and the loss scale every step
    steps = [o for o in pk if o["step"] > 0]
    assert {o["step"] for o in steps} == set(range(1, 31)) and {o["rank"] for o in steps} == {0, 1}
    assert all(o["grad_norm"] is not None and o["grad_norm"] > 0 for o in steps)
    assert all(o["loss_scale"] == 1.0 and o["overflow"] is False for o in steps)
    assert all(by_step[i]["grad_norm"] is not None and by_step[i]["loss_scale_min"] == 1.0 for i in range(1, 31))
    assert len({o["lr"] for o in steps}) > 5, "the learning rate schedule did not reach the packets"
    assert s["loss_scale"]["min"] == 1.0 and s["overflow_steps"] == {"total": 0, "per_rank": {}}
    # MindFormers' own logs (its MFLossMonitor) in the run's log folder, one per rank
    for rank in (0, 1):
        info = (r.run_dir / "logs" / "mindformers" / f"rank_{rank}" / "info.log").read_text()
        assert "loss:" in info and "per_step_time" in info or "step:[" in info, info[-2000:]
        log = (r.run_dir / "logs" / f"rank_{rank}.log").read_text()
        assert "MindFormers model LlamaForCausalLM: 115008 trainable parameters" in log, log[-3000:]
    # the best checkpoint: in the manifest, and loadable by MindFormers' model
    best = s["best_checkpoint"]
    assert best and Path(best["path"]).exists()
    manifest = json.loads((r.run_dir / "checkpoints" / "manifest.json").read_text())
    assert any(Path(e["path"]).name == Path(best["path"]).name and e["kind"] == "best" for e in manifest["files"]), \
        manifest
    script = tmp_path / "load.py"
    script.write_text(LOAD)
    proc = subprocess.run([sys.executable, str(script), str(MF_YAML), best["path"]], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["not_loaded"] == []
    # `mindpulse plan` shows what every rank handed MindFormers
    plan = run_cli("plan", str(CONFIG), timeout=120)
    assert plan.returncode == 0, plan.output
    assert "MindFormers config of every rank" in plan.stdout and "data_parallel: 2" in plan.stdout
    assert "stop_step: 30" in plan.stdout and "device_target: CPU" in plan.stdout


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


def test_a_source_tree_ranks_import_first_stops_both_ranks_on_a_nan_with_the_overrides_in_effect(run_cli, tmp_path):
    """One launch from a MindFormers source tree (`job.mindformers.source`, the release this suite
    installs, so the run is the installed one's): every rank imports the tree's MindFormers, not
    the installed one; the YAML's overrides take effect; a NaN gradient on rank 1 stops both."""
    tree = _unpacked_tree(tmp_path / "mindformers-src")
    installed = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                                "print(u.find_spec('mindformers').submodule_search_locations[0])"],
                               capture_output=True, text=True, timeout=120).stdout.strip()
    assert installed and not installed.startswith(str(tree)), "MindFormers must also be installed here"
    r = run_cli("launch", str(CONFIG), "--set", "train.steps=10", "--set", "output.report=false",
                "--set", "job.mindformers.overrides={model.model_config.num_layers: 1}",
                "--set", f"job.mindformers.source={tree}", "--inject", "nan_grad@1:4", timeout=600)
    assert r.returncode == 3, r.output
    s = r.summary
    assert s["status"] == "anomaly_stop" and s["stop"]["rule"] == "nonfinite" and s["stop"]["decided_at"] == 4
    assert [x["last_step"] for x in s["ranks"]] == [s["stop"]["step"]] * 2 and s["stop"]["step"] == 5
    for rank in (0, 1):
        log = (r.run_dir / "logs" / f"rank_{rank}.log").read_text()
        # one layer: 115008 - 41088 parameters
        assert "MindFormers model LlamaForCausalLM: 73920 trainable parameters" in log, log[-3000:]
        assert f"mindformers {RELEASE} from {tree / 'mindformers'}" in log, log[-3000:]
        assert f"{MARK} {tree / 'mindformers' / '__init__.py'}" in log, log[-3000:]
        assert installed not in log.split(MARK)[0], "the installed MindFormers was named before the tree's import"
    assert (r.run_dir / "config.yaml").read_text().count(str(tree)) == 1, "the run's config does not name the tree"
    # MindFormers' cell skipped the NaN step (its overflow check); at a scale of 1 that is an anomaly
    pk, _ = records(r.run_dir)
    assert {o["rank"]: o["overflow"] for o in pk if o["step"] == 4} == {0: True, 1: True}


@pytest.mark.parametrize("args, needle", [
    (["--set", "job.mindformers.config=/nonexistent/finetune.yaml"], "no such MindFormers YAML file"),
    (["--set", "job.mindformers.run_mode=predict"], "job.mindformers.run_mode: 'predict' is not allowed"),
    (["--set", "job.mindformers.overrides={model.model_config.num_layerz: 1}"],
     "override 'model.model_config.num_layerz': the YAML has no such key"),
    (["--set", "job.mindformers.overrides={train_dataset.data_loader.dataset_dir: no_such_corpus.txt}"],
     "train_dataset.data_loader.dataset_dir:"),
    (["--set", "job.mindformers.overrides={parallel_config.model_parallel: 2}"], "parallel_config.model_parallel: 2"),
    (["--set", "job.mindformers.config=BROKEN"], "not valid YAML"),
])
def test_bad_mindformers_input_is_refused_before_anything_starts(run_cli, tmp_path, args, needle):
    broken = tmp_path / "broken.yaml"
    broken.write_text("run_mode: finetune\nmodel: [unclosed\n")
    args = [a.replace("BROKEN", str(broken)) for a in args]
    r = run_cli("launch", str(CONFIG), *args, timeout=120)
    assert r.returncode == 2, r.output
    assert needle in r.stderr, r.output
    assert r.run_dir is None, "a refused launch left a run directory"
