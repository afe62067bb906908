"""Reading a run config: a YAML file (the project's `cluster_configs/local_cpu.yaml`
when none is given), `--set dotted.key=value` overrides on top, then typed and checked
(`validation.py`) into a `RunConfig`; and a config built from some of its sections, as the
aggregator and the offline views receive it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from mindpulse.config.schema import MonitorConfig, RunConfig
from mindpulse.config.validation import ConfigError, build_dataclass, validate


def sections_of(raw: dict[str, Any]) -> RunConfig:
    """A config from some of its sections (the aggregator receives `monitor`, `checkpoint`,
    `eval`, `anomalies` as plain dicts): every field not given takes its one default here.
    Fields are type-checked; cross-field checks are the launcher's (it validated the run)."""
    keep = {f.name for f in dataclasses.fields(RunConfig)}
    return build_dataclass(RunConfig, {k: v for k, v in raw.items() if k in keep}, "")


REMOVED_KEYS = {
    ("monitor", "decision_every"): (
        "monitor.decision_every: removed; ranks no longer wait for the aggregator every N steps. "
        f"They run up to monitor.max_lag_steps steps ahead of it (default {MonitorConfig.max_lag_steps}) and every "
        "rank still stops after the same step. Delete the key, or set monitor.max_lag_steps (0: wait for every step)."),
}
"""Keys of earlier versions, with what replaces them (an unknown-key error would not say)."""


def from_dict(raw: Any, source: str = "<config>") -> RunConfig:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(raw).__name__}")
    for (section, key), message in REMOVED_KEYS.items():
        if isinstance(raw.get(section), dict) and key in raw[section]:
            raise ConfigError(message)
    return validate(build_dataclass(RunConfig, raw, ""))


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` → (['a','b','c'], YAML-parsed value)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: use --set dotted.key=value")
    key, _, value = item.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {item!r}: the key must be a dotted path such as train.steps")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return key.split("."), parsed


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    keys = {parse_override(item)[0][:2] == ["job", "recipe"] for item in overrides}
    for item in overrides:
        parts, value = parse_override(item)
        # the command line's choice of job wins over the file's: --set job.script=x.py
        # replaces the file's recipe (unless job.recipe is set on the command line too)
        if parts == ["job", "script"] and value and isinstance(raw.get("job"), dict) and True not in keys:
            raw["job"].pop("recipe", None)
            raw["job"].pop("mindformers", None)
        if parts[:2] == ["job", "mindformers"] and value and isinstance(raw.get("job"), dict) and True not in keys:
            raw["job"].pop("recipe", None)
            if parts == ["job", "mindformers", "config"]:
                raw["job"].pop("script", None)
        node = raw
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = {}
                node[part] = nxt
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = nxt
        node[parts[-1]] = value
    return raw


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    return raw


def load_config(path: Path | None, overrides: list[str] | None = None) -> tuple[RunConfig, Path | None]:
    """Load, override and validate. Returns the config and the resolved file path."""
    if path is None:
        path = default_config_path()
    path = Path(path).resolve()
    raw = read_yaml(path)
    raw = apply_overrides(raw, list(overrides or []))
    return from_dict(raw, str(path)), path


def default_config_path() -> Path:
    """`cluster_configs/local_cpu.yaml` of the project (shipped inside the package too)."""
    here = Path(__file__).resolve().parents[1]  # the `mindpulse` package's folder
    # the project's folder (a checkout, an editable install), then the installed package's copy
    for candidate in (here.parent / "cluster_configs" / "local_cpu.yaml", here / "cluster_configs" / "local_cpu.yaml"):
        if candidate.exists():
            return candidate
    raise ConfigError("no config file given and cluster_configs/local_cpu.yaml is missing")


