"""A MindFormers YAML as mindpulse runs it, read and checked without importing MindFormers.

Shared by the driver (a config mistake is refused at launch in milliseconds, exit 2, naming
the file and the key; `mindpulse plan` shows what each rank will run) and the ranks (which
apply the same settings before MindFormers' `Trainer` is built: workers/mindformers_job.py).

1. `load_mf_config`: reads the YAML (merged over its `base_config` files as MindFormers merges
   them) and the caller's overrides (dotted keys, which must exist in the YAML), resolves
   relative input paths against the YAML's folder, checks run_mode and the input paths.
2. `apply_launch_settings`: what the launcher owns (device target, world size, output and log
   folders, a step cap, the checkpoint to start from) replaces the YAML's values; a YAML that
   asks for model, pipeline or context parallelism is refused (data parallel only).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from mindpulse.common.errors import MindpulseError

RUN_MODES = ("train", "finetune")
"""The run modes this job trains with; MindFormers' eval and predict modes are not training runs."""

BASE_CONFIG = "base_config"
"""MindFormers' key for YAML files this one is merged over (paths relative to its folder)."""

CHECKPOINT_KEY = "load_checkpoint"
DATA_LOADER_KEY = "train_dataset.data_loader"
DATASET_PATH_KEYS = ("dataset_dir", "dataset_files")
"""The data loader's keys that name files: MindFormers' MindDataset/TFRecordDataset read one of them."""
FILE_DATASETS = ("MindDataset", "TFRecordDataset")

DATA_PARALLEL_ONLY = ("parallel_config.model_parallel", "parallel_config.pipeline_stage",
                      "parallel_config.context_parallel")
"""Parallel dimensions the launcher does not lay out: each must be 1 (data parallel only)."""

BYTE_CORPUS_SUFFIX = ".txt"
"""A dataset_dir with this suffix is a byte-level text corpus, converted to MindRecord at start."""

STOP_CALLBACK = "TrainCallBack"
"""MindFormers' registered callback that ends training at `stop_step` (run_context.request_stop)."""


class MindFormersConfigError(MindpulseError, ValueError):
    """A MindFormers YAML (or an override of it) that this job cannot run; says what to change."""


@dataclass(frozen=True)
class MFJobConfig:
    """A MindFormers YAML as this job runs it: `values` is what `MindFormerConfig(yaml)` reads
    from the file (plain nested dicts and lists, before MindFormers fills in its defaults), with
    the overrides and launch settings applied and input paths absolute. `to_mindformer_config`
    makes MindFormers' own object of it."""

    source: Path
    values: dict[str, Any]
    log_dir: str | None = None
    """MindFormers' log folder (its LOG_MF_PATH); None: MindFormers' default, <output_dir>/log."""

    def get(self, dotted: str, default: Any = None) -> Any:
        """The value at a dotted key (`model.model_config.seq_length`), or `default`."""
        found, value = _lookup(self.values, dotted)
        return value if found else default

    def with_values(self, changes: Mapping[str, Any]) -> MFJobConfig:
        """A copy with the dotted keys set (the keys' parents must exist)."""
        values = copy.deepcopy(self.values)
        for key, value in changes.items():
            _assign(values, key, value, self.source)
        return replace(self, values=values)


@dataclass(frozen=True)
class LaunchSettings:
    """What the launcher owns in a MindFormers run; the YAML's values for these are replaced."""

    output_dir: str
    world_size: int = 1
    device_target: str | None = None
    """MindSpore's device target ("CPU", "Ascend", "GPU"); None keeps the YAML's context.device_target."""
    log_dir: str | None = None
    """MindFormers' log folder (LOG_MF_PATH); None: <output_dir>/log, or LOG_MF_PATH when set."""
    max_steps: int | None = None
    """Stop after this many steps at most (None: the YAML's epochs decide); the YAML's epochs
    still end a run whose data runs out first."""
    load_checkpoint: str | None = None
    """The checkpoint to start from instead of the YAML's load_checkpoint (None: keep the YAML's;
    a relative path is read from the YAML's folder)."""


# --- reading the YAML ------------------------------------------------------------------------


def load_mf_config(path: str | os.PathLike[str], overrides: Mapping[str, object] | None = None,
                   run_mode: str | None = None) -> MFJobConfig:
    """Read a MindFormers YAML and apply `overrides` ({"model.model_config.num_layers": 4}),
    without importing MindFormers. Raises `MindFormersConfigError` naming the file and the key
    for: a missing or unparsable file, an override whose key is not in the YAML, a run_mode
    other than train/finetune, a checkpoint or dataset path that does not exist. Relative
    input paths (load_checkpoint, the train data loader's dataset_dir/dataset_files) are
    resolved against the YAML's folder, overrides' too. `run_mode`: replaces the YAML's (which
    may then lack one)."""
    source = Path(path).expanduser().resolve()
    values = _read_yaml(source)
    for key, value in (overrides or {}).items():
        if not _lookup(values, key)[0]:
            raise MindFormersConfigError(f"{source}: override {key!r}: the YAML has no such key; fix the name "
                                         "or add the key to the YAML first")
        _assign(values, key, copy.deepcopy(value), source)
    if run_mode is not None:
        values["run_mode"] = run_mode
    config = MFJobConfig(source=source, values=values)
    _check_run_mode(config)
    config = _resolve_input_paths(config)
    _check_input_paths(config)
    return config


def _read_yaml(source: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The YAML's mapping, merged over its base_config files as MindFormers merges them."""
    if source in seen:
        raise MindFormersConfigError(f"{source}: {BASE_CONFIG} includes itself (via {seen[-1]})")
    if not source.is_file():
        raise MindFormersConfigError(f"{source}: no such MindFormers YAML file; check the path")
    try:
        values = yaml.safe_load(source.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise MindFormersConfigError(f"{source}: not valid YAML: {exc}") from None
    if not isinstance(values, dict):
        raise MindFormersConfigError(f"{source}: a MindFormers YAML is a mapping of sections (run_mode, model, "
                                     f"runner_config, ...), this file holds a {type(values).__name__}")
    bases = values.pop(BASE_CONFIG, None)
    if bases is None:
        return values
    merged: dict[str, Any] = {}
    for base in bases if isinstance(bases, list) else [bases]:
        merged.update(_read_yaml((source.parent / str(base)).resolve(), (*seen, source)))
    return _merge(values, merged)


def _merge(top: Mapping[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """`top` merged into `base` (nested mappings key by key, anything else replaced)."""
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(value, out[key]) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def split_key(dotted: str) -> list[str]:
    parts = dotted.split(".")
    if not dotted or any(not p for p in parts):
        raise MindFormersConfigError(f"key {dotted!r}: give a dotted key such as model.model_config.num_layers")
    return parts


def _child(node: Any, part: str) -> tuple[bool, Any]:
    """(found, value) of one step of a dotted key: a mapping's key or a list's index."""
    if isinstance(node, dict):
        return (part in node), node.get(part)
    if isinstance(node, list) and part.isdigit() and int(part) < len(node):
        return True, node[int(part)]
    return False, None


def _lookup(values: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = values
    for part in split_key(dotted):
        found, node = _child(node, part)
        if not found:
            return False, None
    return True, node


def _assign(values: dict[str, Any], dotted: str, value: Any, source: Path) -> None:
    parts = split_key(dotted)
    found, parent = _lookup(values, ".".join(parts[:-1])) if len(parts) > 1 else (True, values)
    last = parts[-1]
    if found and isinstance(parent, dict):
        parent[last] = value
    elif found and isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        parent[int(last)] = value
    else:
        raise MindFormersConfigError(f"{source}: {dotted}: its parent {'.'.join(parts[:-1])!r} is not a section "
                                     "of the YAML")


def _check_run_mode(config: MFJobConfig) -> None:
    run_mode = config.get("run_mode")
    if run_mode not in RUN_MODES:
        raise MindFormersConfigError(f"{config.source}: run_mode: {run_mode!r} is not a training run; "
                                     f"set it to one of {', '.join(RUN_MODES)}")


def _resolve(config: MFJobConfig, value: Any) -> Any:
    """A relative path (str) made absolute against the YAML's folder; anything else as it is."""
    if isinstance(value, str) and value and not os.path.isabs(os.path.expanduser(value)):
        return str((config.source.parent / value).resolve())
    if isinstance(value, str) and value:
        return os.path.expanduser(value)
    return value


def _resolve_input_paths(config: MFJobConfig) -> MFJobConfig:
    changes: dict[str, Any] = {}
    if config.get(CHECKPOINT_KEY):
        changes[CHECKPOINT_KEY] = _resolve(config, config.get(CHECKPOINT_KEY))
    loader = config.get(DATA_LOADER_KEY)
    if isinstance(loader, dict):
        for name in DATASET_PATH_KEYS:
            value = loader.get(name)
            if isinstance(value, list):
                changes[f"{DATA_LOADER_KEY}.{name}"] = [_resolve(config, v) for v in value]
            elif value:
                changes[f"{DATA_LOADER_KEY}.{name}"] = _resolve(config, value)
    return config.with_values(changes) if changes else config


def _check_input_paths(config: MFJobConfig) -> None:
    checkpoint = config.get(CHECKPOINT_KEY)
    if checkpoint and not os.path.exists(checkpoint):
        raise MindFormersConfigError(f"{config.source}: {CHECKPOINT_KEY}: {checkpoint} does not exist; give a "
                                     "checkpoint file or folder (relative paths are read from the YAML's folder), "
                                     "or '' to start from the model's initial weights")
    loader = config.get(DATA_LOADER_KEY)
    if not isinstance(loader, dict):
        raise MindFormersConfigError(f"{config.source}: {DATA_LOADER_KEY}: missing; a training run needs a "
                                     "train_dataset with a data_loader")
    given = {name: loader[name] for name in DATASET_PATH_KEYS if loader.get(name)}
    if not given and loader.get("type") in FILE_DATASETS:
        raise MindFormersConfigError(f"{config.source}: {DATA_LOADER_KEY}: {loader.get('type')} reads files; give "
                                     "dataset_dir (a file or folder) or dataset_files")
    for name, value in given.items():
        for item in value if isinstance(value, list) else [value]:
            if not os.path.exists(item):
                raise MindFormersConfigError(f"{config.source}: {DATA_LOADER_KEY}.{name}: {item} does not exist "
                                             "(relative paths are read from the YAML's folder)")


# --- what the launcher owns ------------------------------------------------------------------


def apply_launch_settings(config: MFJobConfig, launch: LaunchSettings) -> MFJobConfig:
    """The config with the launcher's settings in place of the YAML's (a new object; `config`
    is not changed): device target, use_parallel and parallel_config.data_parallel from the
    world size, output_dir, MindFormers' log folder, a step cap, the starting checkpoint.
    Raises `MindFormersConfigError` for a YAML that asks for model, pipeline or context
    parallelism (the launcher lays out data parallelism only)."""
    _check_data_parallel_only(config)
    if launch.world_size < 1:
        raise MindFormersConfigError(f"world size {launch.world_size}: give at least 1 rank")
    changes: dict[str, Any] = {
        "use_parallel": launch.world_size > 1,
        "output_dir": _absolute(launch.output_dir),
        **_ensure_section(config, "parallel_config", {"data_parallel": launch.world_size}),
    }
    if launch.device_target is not None:
        changes.update(_ensure_section(config, "context", {"device_target": launch.device_target}))
    if launch.load_checkpoint is not None:
        changes[CHECKPOINT_KEY] = _resolve(config, launch.load_checkpoint)
    if launch.max_steps is not None:
        changes.update(_step_cap(config, launch.max_steps))
    out = config.with_values(changes)
    _check_input_paths(out)
    return replace(out, log_dir=launch.log_dir if launch.log_dir is not None else config.log_dir)


def _absolute(path: str) -> str:
    """An absolute path; a path under a placeholder (`mindpulse plan`'s `${RUN_DIR}`) as it is."""
    return path if path.startswith("${") else str(Path(path).expanduser().resolve())


def _ensure_section(config: MFJobConfig, section: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted changes that set `values` in `section`, the section made when the YAML lacks it."""
    current = config.get(section)
    if not isinstance(current, dict):
        return {section: dict(values)}
    return {f"{section}.{k}": v for k, v in values.items()}


def _check_data_parallel_only(config: MFJobConfig) -> None:
    for key in DATA_PARALLEL_ONLY:
        value = config.get(key)
        if value not in (None, 1):
            raise MindFormersConfigError(f"{config.source}: {key}: {value}; mindpulse launches data-parallel runs "
                                         "only: set it to 1 (data_parallel is set to the number of ranks)")


def _step_cap(config: MFJobConfig, max_steps: int) -> dict[str, Any]:
    """Changes that stop training after `max_steps` steps. MindFormers 1.9 reads
    runner_config.stop_step but never acts on it (base_trainer builds the TrainCallBack for it
    and drops it), so the cap is MindFormers' own TrainCallBack, added to the YAML's
    callbacks; stop_step is set too, for versions that honour it. A schedule whose
    total_steps is -1 ("the dataset's steps") spans the capped run instead."""
    if max_steps < 1:
        raise MindFormersConfigError(f"step cap {max_steps}: give at least 1 step")
    callbacks = [c for c in (config.get("callbacks") or []) if not (isinstance(c, dict) and
                                                                    c.get("type") == STOP_CALLBACK)]
    changes: dict[str, Any] = {"callbacks": [*callbacks, {"type": STOP_CALLBACK, "stop_step": max_steps}]}
    changes.update(_ensure_section(config, "runner_config", {"stop_step": max_steps}))
    if isinstance(config.get("lr_schedule"), dict) and config.get("lr_schedule.total_steps", -1) in (None, -1):
        changes["lr_schedule.total_steps"] = max_steps
    return changes


# --- one rank of a mindpulse launch ------------------------------------------------------------


MF_OUTPUT_DIR = "mindformers"
"""The run directory's folder MindFormers writes into (its output_dir: checkpoints and strategy
files under rank_<r>/, the converted dataset)."""


def mf_config_for_rank(cfg: Any, run_dir: str, device_target: str) -> MFJobConfig:
    """The config a rank of this launch trains (`cfg`: the run's `RunConfig`, whose
    `job.mindformers` is set and whose paths the launch resolved): the YAML with the job's
    overrides, its run_mode, and the launcher's settings. The driver checks and plans with it,
    the ranks run it: one function, so the plan shows what runs."""
    mf = cfg.job.mindformers
    config = load_mf_config(mf.config, mf.overrides, run_mode=mf.run_mode)
    launch = LaunchSettings(output_dir=str(Path(run_dir) / MF_OUTPUT_DIR), world_size=cfg.world.world_size,
                            device_target=device_target, max_steps=cfg.train.steps or None,
                            load_checkpoint=mf.load_checkpoint or None)
    return apply_launch_settings(config, launch)
