"""A MindFormers job's config (mindpulse/config/mindformers_yaml.py) is read and checked without MindSpore:
each mistake is reported naming the file and the key, and the launcher's settings replace the
YAML's without changing the config they were applied to."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from mindpulse.config.mindformers_yaml import (
    LaunchSettings,
    MindFormersConfigError,
    apply_launch_settings,
    load_mf_config,
)

SHIPPED = Path(__file__).resolve().parents[2] / "workers" / "recipes" / "mindformers" / "llama_tiny_finetune.yaml"
DATA = SHIPPED.parent.parent / "data"


def _yaml(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    """A small MindFormers-shaped YAML whose input files exist next to it."""
    (tmp_path / "corpus.txt").write_bytes(b"hello world " * 20)
    (tmp_path / "base.ckpt").write_bytes(b"")
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


MINIMAL = """\
    run_mode: finetune
    load_checkpoint: base.ckpt
    output_dir: ./output
    model:
      model_config:
        num_layers: 2
        seq_length: 8
    parallel_config:
      data_parallel: 1
      model_parallel: 1
      pipeline_stage: 1
    runner_config:
      epochs: 1
    lr_schedule:
      type: CosineWithWarmUpLR
      total_steps: -1
    callbacks:
      - type: MFLossMonitor
    train_dataset: &train_dataset
      data_loader:
        type: MindDataset
        dataset_dir: corpus.txt
    train_dataset_task:
      type: CausalLanguageModelDataset
      dataset_config: *train_dataset
"""


def test_the_shipped_yaml_loads_with_its_inputs_resolved_against_its_folder():
    cfg = load_mf_config(SHIPPED)
    assert cfg.get("run_mode") == "finetune"
    assert cfg.get("load_checkpoint") == str(DATA / "base_llama_tiny.ckpt")
    assert cfg.get("train_dataset.data_loader.dataset_dir") == str(DATA / "corpus_train.txt")
    assert cfg.get("runner_wrapper.type") == "MFTrainOneStepCell"
    assert cfg.get("runner_wrapper.scale_sense") == 1.0
    assert cfg.get("runner_wrapper.use_clip_grad") is True
    assert {"type": "MFLossMonitor"} in cfg.get("callbacks")
    assert cfg.get("context.device_target") == "CPU"


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(MindFormersConfigError, match=r"nope\.yaml: no such MindFormers YAML file"):
        load_mf_config(tmp_path / "nope.yaml")


def test_unparsable_yaml_names_the_file(tmp_path):
    path = _yaml(tmp_path, "run_mode: [finetune\nmodel: {\n")
    with pytest.raises(MindFormersConfigError, match=r"job\.yaml: not valid YAML"):
        load_mf_config(path)


def test_a_yaml_that_is_not_a_mapping_is_refused(tmp_path):
    with pytest.raises(MindFormersConfigError, match=r"job\.yaml: a MindFormers YAML is a mapping"):
        load_mf_config(_yaml(tmp_path, "- run_mode\n"))


def test_an_override_of_a_key_the_yaml_lacks_names_the_key(tmp_path):
    with pytest.raises(MindFormersConfigError,
                       match=r"job\.yaml: override 'model\.model_config\.num_layerz': the YAML has no such key"):
        load_mf_config(_yaml(tmp_path, MINIMAL), {"model.model_config.num_layerz": 4})


def test_an_override_replaces_the_value_and_reaches_the_yaml_alias(tmp_path):
    cfg = load_mf_config(_yaml(tmp_path, MINIMAL), {"model.model_config.num_layers": 4, "callbacks.0.type": "X",
                                                    "train_dataset.data_loader.type": "TFRecordDataset"})
    assert cfg.get("model.model_config.num_layers") == 4
    assert cfg.get("callbacks") == [{"type": "X"}]
    # train_dataset_task.dataset_config is the YAML alias of train_dataset: one object, as MindFormers reads it
    assert cfg.get("train_dataset_task.dataset_config.data_loader.type") == "TFRecordDataset"


@pytest.mark.parametrize("text, overrides", [(MINIMAL.replace("finetune", "predict"), None),
                                             (MINIMAL, {"run_mode": "eval"}),
                                             (MINIMAL.replace("    run_mode: finetune\n", ""), None)])
def test_a_run_mode_other_than_train_or_finetune_is_refused(tmp_path, text, overrides):
    with pytest.raises(MindFormersConfigError, match=r"job\.yaml: run_mode: .* set it to one of train, finetune"):
        load_mf_config(_yaml(tmp_path, text), overrides)


def test_a_dataset_path_that_does_not_exist_names_the_key(tmp_path):
    with pytest.raises(MindFormersConfigError,
                       match=r"job\.yaml: train_dataset\.data_loader\.dataset_dir: .*missing\.txt does not exist"):
        load_mf_config(_yaml(tmp_path, MINIMAL.replace("corpus.txt", "missing.txt")))


def test_a_file_dataset_without_a_path_is_refused(tmp_path):
    with pytest.raises(MindFormersConfigError, match=r"train_dataset\.data_loader: MindDataset reads files"):
        load_mf_config(_yaml(tmp_path, MINIMAL), {"train_dataset.data_loader.dataset_dir": ""})


def test_a_checkpoint_that_does_not_exist_names_the_key(tmp_path):
    with pytest.raises(MindFormersConfigError, match=r"job\.yaml: load_checkpoint: .*gone\.ckpt does not exist"):
        load_mf_config(_yaml(tmp_path, MINIMAL), {"load_checkpoint": "gone.ckpt"})


def test_base_config_files_are_merged_under_the_yaml(tmp_path):
    base = {"run_mode": "train", "model": {"model_config": {"num_layers": 8, "hidden_size": 32}}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    cfg = load_mf_config(_yaml(tmp_path, "base_config: base.yaml\n" + textwrap.dedent(MINIMAL)))
    assert cfg.get("model.model_config") == {"num_layers": 2, "hidden_size": 32, "seq_length": 8}
    assert cfg.get("run_mode") == "finetune"


def test_launch_settings_replace_the_yamls_and_leave_the_config_unchanged(tmp_path):
    cfg = load_mf_config(_yaml(tmp_path, MINIMAL))
    before = repr(cfg.values)
    (tmp_path / "other.ckpt").write_bytes(b"")
    out = apply_launch_settings(cfg, LaunchSettings(output_dir=str(tmp_path / "out"), world_size=2, device_target="CPU",
                                                    log_dir=str(tmp_path / "logs"), max_steps=12,
                                                    load_checkpoint="other.ckpt"))
    assert repr(cfg.values) == before, "apply_launch_settings changed its input"
    assert out.get("use_parallel") is True and out.get("parallel_config.data_parallel") == 2
    assert out.get("context.device_target") == "CPU"
    assert out.get("output_dir") == str(tmp_path / "out") and out.log_dir == str(tmp_path / "logs")
    assert out.get("load_checkpoint") == str(tmp_path / "other.ckpt")
    # MindFormers' own stop callback, beside the YAML's; the schedule spans the capped run
    assert out.get("callbacks") == [{"type": "MFLossMonitor"}, {"type": "TrainCallBack", "stop_step": 12}]
    assert out.get("runner_config.stop_step") == 12 and out.get("lr_schedule.total_steps") == 12
    one = apply_launch_settings(out, LaunchSettings(output_dir=str(tmp_path / "out"), max_steps=3))
    assert one.get("use_parallel") is False and one.get("parallel_config.data_parallel") == 1
    assert [c for c in one.get("callbacks") if c["type"] == "TrainCallBack"] == [{"type": "TrainCallBack",
                                                                                  "stop_step": 3}]


@pytest.mark.parametrize("key", ["parallel_config.model_parallel", "parallel_config.pipeline_stage"])
def test_model_or_pipeline_parallelism_is_refused_naming_the_key(tmp_path, key):
    cfg = load_mf_config(_yaml(tmp_path, MINIMAL), {key: 2})
    with pytest.raises(MindFormersConfigError, match=rf"job\.yaml: {key}: 2; .*set it to 1"):
        apply_launch_settings(cfg, LaunchSettings(output_dir=str(tmp_path), world_size=2))


def test_a_launch_checkpoint_that_does_not_exist_is_refused(tmp_path):
    cfg = load_mf_config(_yaml(tmp_path, MINIMAL))
    with pytest.raises(MindFormersConfigError, match=r"load_checkpoint: .*absent\.ckpt does not exist"):
        apply_launch_settings(cfg, LaunchSettings(output_dir=str(tmp_path), load_checkpoint="absent.ckpt"))


def test_reading_a_config_does_not_import_mindspore():
    code = ("import sys; from mindpulse.config.mindformers_yaml import load_mf_config; "
            f"load_mf_config({str(SHIPPED)!r}); "
            "bad = sorted(m for m in ('mindspore', 'mindformers') if m in sys.modules); print(bad); "
            "sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"loading the config imported {proc.stdout.strip()}:\n{proc.stderr[-2000:]}"


def test_the_compute_dtype_of_mfus_peak_is_read_from_the_yaml(tmp_path):
    """MFU's peak is taken in the dtype the model computes in (mindpulse/reporting/card_peaks.py)."""
    from mindpulse.config import from_dict
    from mindpulse.launcher.mindformers_plan import compute_dtype
    from mindpulse.reporting.card_peaks import peak_dtype

    def job(config: Path, overrides: dict | None = None):
        return from_dict({"job": {"mindformers": {"config": str(config), "overrides": overrides or {}}}})

    run_dir = str(tmp_path / "run")
    assert compute_dtype(job(SHIPPED), run_dir) == "float32"
    bf16 = job(SHIPPED, {"model.model_config.compute_dtype": "bfloat16"})
    assert compute_dtype(bf16, run_dir) == "bfloat16" and peak_dtype("", compute_dtype(bf16, run_dir)) == "bfloat16"
    unset = job(_yaml(tmp_path, MINIMAL))
    assert compute_dtype(unset, run_dir) == "" and peak_dtype("", "") == "float16"
    assert compute_dtype(job(tmp_path / "gone.yaml"), run_dir) == "", "unreadable now: no dtype, no crash"
    assert compute_dtype(from_dict({}), run_dir) is None
