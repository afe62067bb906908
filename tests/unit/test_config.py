"""Config: every error path names the dotted field, the bad value and what is allowed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mindpulse.config import (
    Backend,
    ConfigError,
    Device,
    Mode,
    apply_overrides,
    default_config_path,
    describe_fields,
    from_dict,
    load_config,
)

ROOT = Path(__file__).resolve().parents[2]


def test_default_config_is_the_local_cpu_demo():
    cfg, path = load_config(None)
    assert path == (ROOT / "cluster_configs" / "local_cpu.yaml").resolve()
    assert cfg.backend is Backend.RAY and cfg.world.device is Device.CPU
    assert cfg.world.world_size == 2
    assert cfg.job.recipe is not None and cfg.job.recipe.name == "llama_finetune"
    assert cfg.ray.address == ""


def test_empty_config_gets_defaults():
    cfg = from_dict({})
    assert cfg.output.root == "runs"
    assert cfg.train.mode is Mode.PYNATIVE
    assert cfg.job.recipe is not None  # neither recipe nor script: the built-in recipe


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"trian": {}}, "trian: unknown key"),
        ({"train": {"stpes": 3}}, "train.stpes: unknown key"),
        ({"train": {"steps": -1}}, "train.steps: -1 is not allowed"),
        ({"train": {"steps": "ten"}}, "train.steps: 'ten' is not allowed; use an integer"),
        ({"train": {"steps": True}}, "train.steps: True is not allowed"),
        ({"train": {"lr": 0}}, "train.lr: 0.0 is not allowed"),
        ({"train": {"lr": "fast"}}, "train.lr: 'fast' is not allowed; use a number"),
        ({"train": {"mode": "eager"}}, "train.mode: 'eager' is not allowed; use one of 'pynative', 'graph'"),
        ({"train": {"batch_size": 0}}, "train.batch_size: 0 is not allowed"),
        ({"train": {"epochs": 0}}, "train.epochs"),
        ({"train": {"dataset_sink_mode": "yes"}}, "train.dataset_sink_mode: 'yes' is not allowed; use true or false"),
        ({"train": {"sink_size": 0}}, "train.sink_size"),
        ({"world": {"device": "tpu"}}, "world.device: 'tpu' is not allowed; use one of 'cpu', 'ascend', 'gpu'"),
        ({"world": {"nodes": 0}}, "world.nodes: 0 is not allowed"),
        ({"world": {"ranks_per_node": -2}}, "world.ranks_per_node"),
        ({"world": 5}, "world: expected a mapping"),
        ({"backend": "slurm"}, "backend: 'slurm' is not allowed; use one of 'ray', 'msrun'"),
        ({"name": "../escape"}, "name: '../escape' is not allowed"),
        ({"name": "a/b"}, "name: 'a/b' is not allowed"),
        ({"name": ""}, "name: '' is not allowed"),
        ({"monitor": {"collect_freq": 0}}, "monitor.collect_freq"),
        ({"monitor": {"per_print_step": 0}}, "monitor.per_print_step"),
        ({"monitor": {"decision_every": 1}}, "monitor.decision_every: removed"),
        ({"monitor": {"max_lag_steps": -1}}, "monitor.max_lag_steps"),
        ({"monitor": {"decision_timeout_s": 0}}, "monitor.decision_timeout_s"),
        ({"monitor": {"hang_timeout_s": -1}}, "monitor.hang_timeout_s"),
        ({"output": {"root": ""}}, "output.root: must not be empty"),
        ({"job": {"script": "x.py", "recipe": {"name": "llama_finetune"}}},
         "job: give one of job.recipe, job.script or job.mindformers, not job.recipe and job.script"),
        ({"job": {"recipe": {"name": "gpt9"}}}, "job.recipe.name: 'gpt9' is not allowed; use one of 'llama_finetune'"),
        ({"job": {"recipe": {"hidden_size": 30, "num_heads": 4}}}, "job.recipe.hidden_size: 30 is not divisible"),
        ({"job": {"recipe": {"seq_length": 0}}}, "job.recipe.seq_length"),
        ({"job": {"args": ["--x"]}}, "job.args: only allowed together with job.script"),
        ({"job": {"args": "--x"}}, "job.args: expected a list"),
        ({"ray": {"adress": "auto"}}, "ray.adress: unknown key"),
    ],
)
def test_bad_values_name_the_field(raw, needle):
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    assert needle in str(err.value), str(err.value)


def test_unknown_key_lists_allowed_keys():
    with pytest.raises(ConfigError) as err:
        from_dict({"train": {"stpes": 3}})
    assert "allowed here:" in str(err.value) and "steps" in str(err.value)


def test_overrides_parse_yaml_values_and_create_sections():
    raw = apply_overrides({}, ["train.steps=20", "train.lr=1e-4", "ray.address=auto", "job.args=[--a, b]"])
    assert from_dict({"train": raw["train"]}).train.lr == 1e-4
    raw["train"]["lr"] = float(raw["train"]["lr"])
    assert raw == {"train": {"steps": 20, "lr": 1e-4}, "ray": {"address": "auto"}, "job": {"args": ["--a", "b"]}}
    with pytest.raises(ConfigError, match="use --set dotted.key=value"):
        apply_overrides({}, ["train.steps"])
    with pytest.raises(ConfigError, match="train is not a section"):
        apply_overrides({"train": 3}, ["train.steps=1"])
    with pytest.raises(ConfigError, match="dotted path"):
        apply_overrides({}, ["train..steps=1"])


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(lst)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="cannot read|not valid YAML"):
        load_config(binary)


def test_every_field_is_documented():
    rows = describe_fields()
    paths = {r[0] for r in rows}
    for needed in ("name", "backend", "ray.address", "world.nodes", "world.ranks_per_node", "world.device",
                   "job.script", "job.args", "train.steps", "train.epochs", "train.batch_size", "train.lr",
                   "train.seed", "train.mode", "monitor.collect_freq", "monitor.per_print_step",
                   "monitor.max_lag_steps", "output.root"):
        assert needed in paths
    undocumented = [r[0] for r in rows if not r[2]]
    assert not undocumented, f"fields without a docstring: {undocumented}"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["launch", "--set", "train.steps=-3"], "train.steps: -3 is not allowed"),
        (["launch", "--set", "world.device=tpu"], "world.device: 'tpu'"),
        (["launch", "/nonexistent/x.yaml"], "no such config file"),
        (["launch", "--set", "nonsense"], "use --set dotted.key=value"),
    ],
)
def test_cli_bad_config_exits_2_and_starts_nothing(tmp_path, args, needle):
    proc = subprocess.run([sys.executable, "-m", "mindpulse.launcher.cli", *args, "--set",
                           f"output.root={tmp_path / 'runs'}"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr
    assert not (tmp_path / "runs").exists(), "a run directory was made for a bad config"


def test_cli_usage_error_exits_2():
    proc = subprocess.run([sys.executable, "-m", "mindpulse.launcher.cli", "frobnicate"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2


def test_default_config_path_exists():
    assert default_config_path().exists()


def test_readme_documents_every_field_with_its_default():
    readme = (ROOT / "README.md").read_text()
    # the config reference's rows: | `path` | `default` | meaning |
    table = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([\w.]+)` \| `(.*?)` \| ", readme, re.M)}
    fields = {p: d for p, d, _ in describe_fields()}
    missing = [p for p in fields if p not in table]
    assert not missing, f"README's config reference lacks {missing}"
    wrong = {p: (table[p], d) for p, d in fields.items() if table[p] != d}
    assert not wrong, f"README's config reference gives other defaults than the code (README, code): {wrong}"


# ---- floats must be finite (NaN/Inf in a timeout kills or deafens the job) ---------------------

def _float_fields(cls: type) -> list[list]:
    """Paths (field names, 0 for the first item of a list of dataclasses) of every float field."""
    import dataclasses
    import typing

    out: list[list] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) is not list and args:
            tp = args[0]  # X | None
        if tp is float:
            out.append([f.name])
        elif dataclasses.is_dataclass(tp):
            out += [[f.name, *sub] for sub in _float_fields(tp)]
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            out += [[f.name, 0, *sub] for sub in _float_fields(typing.get_args(tp)[0])]
    return out


def _nest(path: list, value) -> tuple[dict, str]:
    """The raw config setting `path` to `value`, and its dotted name as errors spell it."""
    node: object = value
    for part in reversed(path):
        node = [node] if part == 0 else {part: node}
    dotted = ".".join(str(p) for p in path).replace(".0.", "[0].")
    return node, dotted  # type: ignore[return-value]


FLOAT_FIELDS = _float_fields(__import__("mindpulse.config", fromlist=["RunConfig"]).RunConfig)


def test_float_field_walk_finds_the_nested_ones():
    dotted = {_nest(p, 0)[1] for p in FLOAT_FIELDS}
    assert {"train.lr", "monitor.hang_timeout_s", "monitor.decision_timeout_s", "monitor.straggler_threshold",
            "monitor.telemetry_interval_s", "anomalies[0].threshold", "anomalies[0].factor", "anomalies[0].z",
            "anomalies[0].for_s", "anomalies[0].tolerance"} <= dotted, dotted


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), "nan", "-Infinity", 10 ** 400])
@pytest.mark.parametrize("path", FLOAT_FIELDS, ids=lambda p: _nest(p, 0)[1])
def test_every_float_field_must_be_finite(path, bad):
    raw, dotted = _nest(path, bad)
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    assert str(err.value).startswith(f"{dotted}: ") and "use a finite number (not NaN or infinity)" in str(err.value)


def test_yaml_nan_and_inf_are_refused(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("monitor: {hang_timeout_s: .nan}\n")
    with pytest.raises(ConfigError, match=r"^monitor.hang_timeout_s: nan is not allowed; use a finite number"):
        load_config(cfg)
    cfg.write_text("anomalies:\n  - {rule: threshold, metric: loss, threshold: -.inf}\n")
    with pytest.raises(ConfigError, match=r"^anomalies\[0\].threshold: -inf is not allowed"):
        load_config(cfg)
    cfg.write_text("{}\n")
    with pytest.raises(ConfigError, match=r"^monitor.decision_timeout_s: inf is not allowed"):
        load_config(cfg, ["monitor.decision_timeout_s=.inf"])
    assert load_config(cfg, ["monitor.decision_timeout_s=1e3"])[0].monitor.decision_timeout_s == 1000.0


# ---- metric names: a typo must not silently never fire --------------------------------------------

def test_reduced_metrics_match_the_reducer():
    """config cannot import the aggregator: its copy of ReducedStep's metric names must not drift."""
    import dataclasses
    import typing

    from mindpulse.config import METRIC_ALIASES, REDUCED_METRICS
    from mindpulse.reduction.reducer import ReducedStep
    from mindpulse.registry.metrics import aliases as registry_aliases

    def numeric(tp) -> bool:  # int, float, or either | None
        if typing.get_origin(tp) is None:
            return tp in (int, float)
        args = typing.get_args(tp)
        return type(None) in args and all(a in (int, float, type(None)) for a in args)

    hints = typing.get_type_hints(ReducedStep)
    numeric_fields = {f.name for f in dataclasses.fields(ReducedStep) if numeric(hints[f.name])}
    assert set(REDUCED_METRICS) == numeric_fields
    # every alias names a reduced field (the registry's, mindpulse/registry/metrics.py)
    assert set(METRIC_ALIASES) == set(registry_aliases())
    assert set(registry_aliases().values()) <= set(REDUCED_METRICS)
    red = ReducedStep(nonfinite_ranks=[], **{n: 2 for n in REDUCED_METRICS})
    assert all(red.metric(n) is not None for n in (*REDUCED_METRICS, *METRIC_ALIASES))


def test_recipe_metrics_are_what_its_evaluator_reports(monkeypatch):
    import types

    import numpy as np

    from mindpulse.config import RECIPE_METRICS
    from mindpulse.workers.recipes import llama_finetune

    stub = types.ModuleType("mindspore")
    stub.Tensor = np.asarray  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mindspore", stub)

    class Out:
        def asnumpy(self):
            return np.array([2.0])

    evaluate = llama_finetune.make_evaluator(lambda batch: Out(), np.zeros((4, 9), np.int32), 2, 0)
    assert tuple(evaluate()) == RECIPE_METRICS["llama_finetune"] == ("eval_loss", "eval_ppl")


SCRIPT = {"job": {"script": "train.py"}}
RULE = {"rule": "threshold", "op": ">", "threshold": 1.0}


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"anomalies": [dict(RULE, metric="lossx")]},
         "anomalies[0].metric: 'lossx' is not a metric this job reports; use one of loss, grad_norm_global, "
         "tflops, loss_scale, overflow, monitor_self_s, throughput, mfu, step, epoch"),
        ({"anomalies": [RULE, dict(RULE, metric="grad_nrom", enabled=False)]}, "anomalies[0].metric: a threshold"),
        ({"anomalies": [dict(RULE, metric="loss"), dict(RULE, metric="grad_nrom")]},
         "anomalies[1].metric: 'grad_nrom' is not a metric this job reports"),
        ({"eval": {"every_steps": 5}, "checkpoint": {"best_metric": "evall_loss"}},
         "checkpoint.best_metric: 'evall_loss' is not a metric this job reports; use one of"),
        ({"checkpoint": {"best_metric": "los"}}, "checkpoint.best_metric: 'los' is not a metric this job reports"),
        ({"anomalies": [dict(RULE, metric="eval_loss")]},
         "anomalies[0].metric: 'eval_loss' is reported by the llama_finetune recipe only when evaluation is on"),
        ({"eval": {"every_steps": 5}, "anomalies": [dict(RULE, metric="eval_acc")]},
         "anomalies[0].metric: 'eval_acc' is not a metric this job reports"),
        (dict(SCRIPT, anomalies=[dict(RULE, metric="eval_acc")]),
         "anomalies[0].metric: 'eval_acc' is not a metric this job reports"),
        (dict(SCRIPT, eval={"every_steps": 5}, checkpoint={"best_metric": "eval_loss"}),
         "checkpoint.best_metric: 'eval_loss' is not a metric this job reports"),
        (dict(SCRIPT, eval={"metrics": ["acc", "acc"]}), "eval.metrics[1]: 'acc' is listed twice"),
        (dict(SCRIPT, eval={"metrics": [""]}), "eval.metrics[0]: '' is not allowed"),
        (dict(SCRIPT, eval={"metrics": "acc"}), "eval.metrics: expected a list"),
        ({"eval": {"every_steps": 5, "metrics": ["eval_acc"]}},
         "eval.metrics[0]: 'eval_acc' is not reported by the llama_finetune recipe (it reports eval_loss, eval_ppl"),
        ({"anomalies": [{"rule": "card_overload", "metric": "temp"}]},
         "anomalies[0].metric: 'temp' is not allowed for card_overload; use one of temp_c, memory_pct, power_w"),
    ],
)
def test_unknown_metrics_name_the_field_and_the_known_names(raw, needle):
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    assert str(err.value).startswith(needle), str(err.value)


@pytest.mark.parametrize(
    "raw",
    [
        {"anomalies": [dict(RULE, metric=m) for m in ("loss", "loss_max", "grad_norm", "grad_norm_global",
                                                       "step_time_max", "samples_per_s", "throughput", "lr")]},
        {"eval": {"every_steps": 5}, "anomalies": [dict(RULE, metric="eval_ppl")],
         "checkpoint": {"best_metric": "eval_loss"}},
        {"eval": {"per_epoch": True, "metrics": ["eval_loss"]}, "checkpoint": {"best_metric": "eval_ppl"}},
        dict(SCRIPT, eval={"every_steps": 5, "metrics": ["eval_acc", "tokens_per_s"]},
             anomalies=[dict(RULE, metric="tokens_per_s")], checkpoint={"best_metric": "eval_acc", "best_mode": "max"}),
        {"anomalies": [{"rule": "card_overload", "metric": "power_w", "threshold": 300},
                       {"rule": "loss_spike", "z": 8}]},
    ],
)
def test_known_metrics_pass(raw):
    from_dict(raw)


# ---- env: what mindpulse sets or relies on cannot be overridden ----------------------------------

@pytest.mark.parametrize(
    "key, instead",
    [
        ("MS_ROLE", "MS_WORKER"),
        ("MS_SCHED_HOST", "use msrun.master_addr"),
        ("MS_SCHED_PORT", "use msrun.master_port"),
        ("MS_WORKER_NUM", "use world.nodes and world.ranks_per_node"),
        ("MS_NODE_ID", "use world.nodes and world.ranks_per_node"),
        ("MS_TOPO_TIMEOUT", "use msrun.cluster_time_out"),
        ("MS_RETRY_INTERVAL_LOWER", "use msrun.heartbeat_interval_s"),
        ("MS_RETRY_INTERVAL_UPPER", "use msrun.heartbeat_interval_s"),
        ("RANK_ID", "use world.nodes and world.ranks_per_node"),
        ("RANK_SIZE", "use world.nodes and world.ranks_per_node"),
        ("RANK_TABLE_FILE", "not a RANK_TABLE_FILE"),
        ("DEVICE_ID", "use world.devices"),
        ("ASCEND_RT_VISIBLE_DEVICES", "use world.devices"),
        ("CUDA_VISIBLE_DEVICES", "use world.devices"),
        ("RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES", "use world.devices"),
        ("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "use world.devices"),
        ("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "cannot import MindSpore; it has no config key"),
        ("MINDPULSE_SETTINGS", "they have no config key"),
        ("MINDPULSE_NODE_RANK", "they have no config key"),
        ("GLOG_v", "set GLOG_v in that shell"),
    ],
)
def test_env_refuses_what_mindpulse_sets_naming_the_key_to_use(key, instead):
    with pytest.raises(ConfigError) as err:
        from_dict({"env": {key: "1"}})
    msg = str(err.value)
    assert msg.startswith(f"env.{key}: not allowed: ") and instead in msg, msg


@pytest.mark.parametrize("key", ["HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "LD_PRELOAD", "MS_ALLOC_CONF",
                                 "MS_DEV_RUNTIME_CONF", "GLOG_logtostderr", "GLOG_log_dir", "PATH", "PYTHONPATH",
                                 "ASCEND_GLOBAL_LOG_LEVEL", "OMP_NUM_THREADS"])
def test_env_keeps_what_users_set(key):
    assert from_dict({"env": {key: "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}}).env[key]


@pytest.mark.parametrize("backend", ["ray", "msrun"])
@pytest.mark.parametrize("device", ["cpu", "ascend", "gpu"])
def test_every_variable_mindpulse_gives_ranks_is_refused_in_env(backend, device):
    """The denylist covers what the launcher actually sets (a new variable there must be added)."""
    from mindpulse.config import env_reserved
    from mindpulse.config.rank_settings import NODE_RANK_ENV, SETTINGS_ENV
    from mindpulse.launcher.spec import rank_specs, scheduler_env
    from mindpulse.lifetime.rank_processes import WORKER_ENV

    cfg = from_dict({"backend": backend, "world": {"device": device, "nodes": 2}})
    keys = {k for s in rank_specs(cfg) for k in s.env} | set(scheduler_env(cfg)) | set(WORKER_ENV)
    keys |= {SETTINGS_ENV, NODE_RANK_ENV}
    assert {"MS_TOPO_TIMEOUT", "GLOG_v", "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"} <= keys
    assert [k for k in sorted(keys) if env_reserved(k) is None] == []


def test_env_name_must_be_a_variable_name():
    with pytest.raises(ConfigError, match=r"^env.A-B: not a valid environment variable name; use letters"):
        from_dict({"env": {"A-B": "1"}})


# ---- output.root reaches msrun's shell command -------------------------------------------------

@pytest.mark.parametrize("root", ["/data/x;rm -rf ~", "runs $(id)", "a|b", "a`b`", "a&b", "r>uns", "x'y", 'x"y',
                                  "x\ny", "a*b", "a#b"])
def test_msrun_output_root_without_shell_metacharacters(root):
    with pytest.raises(ConfigError) as err:
        from_dict({"backend": "msrun", "output": {"root": root}})
    assert str(err.value).startswith(f"output.root: {root!r} holds ") and "letters, digits and" in str(err.value)
    assert from_dict({"backend": "ray", "output": {"root": root}}).output.root == root  # no shell there
    assert from_dict({"backend": "msrun", "output": {"root": "/data/runs_2024-01,a+b:c@d%e=f~g/é"}})


def test_launch_checks_the_resolved_output_root(tmp_path):
    from mindpulse.launcher.rundir import make_run_dir

    cwd = tmp_path / "jobs;touch pwned"
    cwd.mkdir()
    cfg = from_dict({"backend": "msrun", "output": {"root": "runs"}})  # relative: fine as written
    with pytest.raises(ConfigError, match=r"^output.root: 'runs' \(resolved: .*jobs;touch pwned/runs'\) holds ' ;'"):
        make_run_dir(cfg, base=cwd)
    assert list(cwd.iterdir()) == [], "a run directory was made"
    link = tmp_path / "safe_link"
    link.symlink_to(cwd)
    cfg = from_dict({"backend": "msrun", "output": {"root": str(link)}})
    with pytest.raises(ConfigError, match=r"holds ' ;'"):
        make_run_dir(cfg)
    ray_cfg = from_dict({"backend": "ray", "output": {"root": "runs"}})
    assert make_run_dir(ray_cfg, base=cwd).parent == cwd / "runs"  # the ray backend has no shell
    assert make_run_dir(from_dict({"backend": "msrun"}), base=tmp_path / "ok").parent == tmp_path / "ok" / "runs"


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["monitor.hang_timeout_s=.nan"], "monitor.hang_timeout_s: nan is not allowed"),
        (["monitor.decision_timeout_s=.inf"], "monitor.decision_timeout_s: inf is not allowed"),
        (["anomalies=[{rule: threshold, metric: lossx, threshold: 1}]"], "anomalies[0].metric: 'lossx'"),
        (["checkpoint.best_metric=evall_loss"], "checkpoint.best_metric: 'evall_loss'"),
        (["env={MS_TOPO_TIMEOUT: '5'}"], "env.MS_TOPO_TIMEOUT: not allowed"),
        (["backend=msrun", "output.root=/tmp/a;b"], "output.root: '/tmp/a;b' holds"),
    ],
)
def test_cli_plan_exits_2_on_these(sets, needle):
    args = [a for s in sets for a in ("--set", s)]
    proc = subprocess.run([sys.executable, "-m", "mindpulse.launcher.cli", "plan", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stderr


def test_heartbeat_interval_must_not_be_negative():
    with pytest.raises(ConfigError, match=r"msrun\.heartbeat_interval_s"):
        from_dict({"msrun": {"heartbeat_interval_s": -1}})


def test_graph_mode_recipe_in_data_parallel_on_cpu_is_refused_before_launch():
    """MindSpore 2.9 cannot compile the recipe's data-parallel train step in GRAPH mode on
    CPU: the config says so at once instead of every rank failing after a minute."""
    with pytest.raises(ConfigError, match=r"^train\.mode: 'graph' is not supported .*use train\.mode=pynative"):
        from_dict({"train": {"mode": "graph"}, "world": {"ranks_per_node": 2}})
    from_dict({"train": {"mode": "graph"}, "world": {"ranks_per_node": 1}})
    from_dict({"train": {"mode": "graph"}, "world": {"ranks_per_node": 8, "device": "ascend"}})
    from_dict({"train": {"mode": "graph"}, "world": {"ranks_per_node": 2}, "job": {"script": "train.py"}})


def test_the_rank_and_the_aggregator_agree_on_periodic_checkpoint_steps():
    """Rank 0 waits for a verdict exactly at the steps where the aggregator asks for a
    periodic save: both read `mindpulse.config.rank_settings.periodic_due`."""
    from mindpulse.config import schedule_of

    for every in (0, 1, 3, 10):
        cfg, _ = load_config(None, [f"checkpoint.save_checkpoint_steps={every}"])
        sched = schedule_of(cfg)
        due = [s for s in range(0, 31) if cfg.checkpoint.periodic_due(s)]
        assert due == [s for s in range(0, 31) if sched.is_save_step(s)]
        assert due == ([] if every == 0 else list(range(every, 31, every)))
