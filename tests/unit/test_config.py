"""Config: every error path names the dotted field, the bad value and what is allowed."""

from __future__ import annotations

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
        ({"monitor": {"decision_every": 0}}, "monitor.decision_every"),
        ({"monitor": {"decision_timeout_s": 0}}, "monitor.decision_timeout_s"),
        ({"monitor": {"hang_timeout_s": -1}}, "monitor.hang_timeout_s"),
        ({"output": {"root": ""}}, "output.root: must not be empty"),
        ({"job": {"script": "x.py", "recipe": {"name": "llama_finetune"}}},
         "job: give either job.recipe or job.script"),
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
                   "monitor.decision_every", "output.root"):
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


def test_readme_documents_every_field():
    readme = (ROOT / "README.md").read_text()
    missing = [p for p, _, _ in describe_fields() if f"`{p}`" not in readme]
    assert not missing, f"README's config reference lacks {missing}"
