"""A MindFormers job (`job.mindformers`) as the driver sees it: its YAML found, read and
checked before anything starts (a mistake is exit 2 naming the file or the key), and what
every rank will hand MindFormers' Trainer, for `mindpulse plan` and the launch.

The ranks apply the very same function (workers/mindformers_job.py `rank_config`), so what
the plan shows is what runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mindpulse.config import ConfigError, RunConfig
from mindpulse.config.mindformers_yaml import MFJobConfig, MindFormersConfigError, mf_config_for_rank
from mindpulse.config.validation import check_mindformers_source

from .paths import resolve_input
from .preflight import LaunchRefused


def resolve_paths(cfg: RunConfig, config_path: Path | None) -> None:
    """Relative `job.mindformers.config` / `load_checkpoint` / `source`: as every input path of
    the config (launcher/paths.py)."""
    mf = cfg.job.mindformers
    if mf is None:
        return
    base = config_path.parent if config_path else Path.cwd()
    mf.config = resolve_input(mf.config, base) if mf.config else mf.config
    if mf.load_checkpoint:
        mf.load_checkpoint = resolve_input(mf.load_checkpoint, base)
    if mf.source:
        mf.source = resolve_input(mf.source, base)


def check(cfg: RunConfig, run_dir: str) -> MFJobConfig | None:
    """The config every rank will train (None: not a MindFormers job); LaunchRefused naming the
    file or key when the YAML, an override or a path in it is wrong."""
    if cfg.job.mindformers is None:
        return None
    if cfg.job.mindformers.source:
        try:  # the ranks import MindFormers from there: a folder that is no MindFormers tree is refused now
            check_mindformers_source(cfg.job.mindformers.source)
        except ConfigError as exc:
            raise LaunchRefused(str(exc)) from None
    try:
        return mf_config_for_rank(cfg, run_dir, device_target=cfg.world.device.value.upper())
    except MindFormersConfigError as exc:
        raise LaunchRefused(f"job.mindformers: {exc}") from None


COMPUTE_DTYPE_KEY = "model.model_config.compute_dtype"
"""The MindFormers YAML's key for the dtype its model's matmuls run in (MFU's peak: card_peaks.py)."""


def compute_dtype(cfg: RunConfig, run_dir: str) -> str | None:
    """The dtype a MindFormers job's model computes in, as its YAML (with the overrides) sets it:
    None when the job is not a MindFormers job, "" when the YAML does not set it (or can no
    longer be read: the launch checked it, the ranks will say what is wrong)."""
    if cfg.job.mindformers is None:
        return None
    try:
        job = check(cfg, run_dir)
    except LaunchRefused:
        return ""
    value = job.get(COMPUTE_DTYPE_KEY, "") if job is not None else ""
    return str(value) if isinstance(value, str) else ""


def plan_view(cfg: RunConfig, run_dir: str) -> dict[str, Any] | None:
    """What `mindpulse plan` shows: the YAML's path and the values every rank hands MindFormers
    (before MindFormers fills in its own defaults)."""
    job = check(cfg, run_dir)
    if job is None:
        return None
    view: dict[str, Any] = {"yaml": str(job.source), "values": job.values}
    if cfg.job.mindformers is not None and cfg.job.mindformers.source:
        view["source"] = cfg.job.mindformers.source  # the tree the ranks import MindFormers from
    return view
