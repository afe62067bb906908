"""A rank's MindFormers job: a MindFormers YAML trained by MindFormers' own `Trainer`.

The same path as MindFormers' `run_mindformer.py --config X.yaml` (1.7-1.9):
`MindFormerConfig(yaml)`, `set_output_path(output_dir)`, `build_context(config)`,
`Trainer(config).train()` (run_mindformer.py calls `train()` for run_mode finetune too: in
MindFormers 1.9 `Trainer.finetune()` without a checkpoint argument drops the YAML's
`load_checkpoint`). The YAML is read and the launcher's settings applied by
`mindpulse.config.mindformers_yaml` (shared with the driver, which checked the same at launch); here:

1. `prepare_dataset`: a byte-level `.txt` corpus converted to MindRecord.
2. `run_trainer`: the CPU patches (`cpu_fallbacks`), MindFormers' context and Trainer with
   the caller's callbacks beside the YAML's own, and training.
3. `run_for_rank`: all of it for a launched rank, with mindpulse's `MindPulseMonitor`.

A step's `cb_params.net_outputs`, as a MindSpore Callback sees it under MindFormers'
`MFTrainOneStepCell`: (loss, overflow, loss_scale, learning_rate, global_norm), with two more
(local_norm, local_norm_size) when `runner_wrapper.local_norm` is on.
"""

from __future__ import annotations

import copy
import hashlib
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mindpulse.config.mindformers_yaml import (
    BYTE_CORPUS_SUFFIX,
    DATA_LOADER_KEY,
    MFJobConfig,
    MindFormersConfigError,
)

# --- the dataset -----------------------------------------------------------------------------


def byte_corpus_to_mindrecord(text: str | os.PathLike[str], seq_length: int, folder: str | os.PathLike[str]) -> Path:
    """A MindRecord of a byte-level corpus (each byte a token) with one `input_ids` column of
    seq_length + 1 tokens, one window every seq_length bytes (the recipe's windows), for
    MindFormers' MindDataset. Written once per corpus content and seq_length under `folder`
    (ranks that share it race safely: each writes its own copy and renames it into place).
    Returns the .mindrecord file."""
    import numpy as np

    data = Path(text).read_bytes()
    n_windows = (len(data) - 1) // seq_length
    if n_windows < 1:
        raise MindFormersConfigError(f"{text}: {len(data)} bytes hold no window of {seq_length + 1} tokens; "
                                     "use a larger corpus or a smaller model.model_config.seq_length")
    stem = Path(text).stem
    digest = hashlib.sha256(data).hexdigest()[:16]
    final = Path(folder) / f"{stem}-seq{seq_length}-{digest}"
    record = final / f"{stem}.mindrecord"
    if record.exists():
        return record
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    tokens = np.frombuffer(data, dtype=np.uint8).astype(np.int32)
    _write_mindrecord(tmp / record.name, [tokens[i * seq_length: i * seq_length + seq_length + 1]
                                          for i in range(n_windows)])
    try:
        os.rename(tmp, final)
    except OSError:  # another rank renamed its identical copy into place first
        shutil.rmtree(tmp, ignore_errors=True)
        if not record.exists():
            raise
    return record


def _write_mindrecord(path: Path, windows: Sequence[Any]) -> None:
    from mindspore.mindrecord import FileWriter

    writer = FileWriter(str(path), shard_num=1, overwrite=True)
    writer.set_header_size(1 << 16)  # the defaults (16 MB header, 32 MB pages) make a 50 MB sparse file
    writer.set_page_size(1 << 20)
    writer.add_schema({"input_ids": {"type": "int32", "shape": [-1]}}, "byte-level token windows")
    writer.write_raw_data([{"input_ids": w} for w in windows])
    writer.commit()


def prepare_dataset(config: MFJobConfig) -> MFJobConfig:
    """A byte-level `.txt` dataset_dir converted to MindRecord under <output_dir>/dataset, and
    dataset_dir pointed at it; any other dataset as it is."""
    key = f"{DATA_LOADER_KEY}.dataset_dir"
    corpus = config.get(key)
    if not (isinstance(corpus, str) and corpus.endswith(BYTE_CORPUS_SUFFIX)):
        return config
    seq_length = config.get("model.model_config.seq_length")
    if not isinstance(seq_length, int) or seq_length < 1:
        raise MindFormersConfigError(f"{config.source}: model.model_config.seq_length: {seq_length!r}; a byte "
                                     "corpus is cut into windows of seq_length + 1 tokens: give a positive int")
    folder = Path(config.get("output_dir") or "./output").expanduser().resolve() / "dataset"
    return config.with_values({key: str(byte_corpus_to_mindrecord(corpus, seq_length, folder))})


# --- MindFormers ---------------------------------------------------------------------------


def to_mindformer_config(config: MFJobConfig) -> Any:
    """MindFormers' `MindFormerConfig` of the job config, as `MindFormerConfig(yaml_path)`
    makes it (keys sorted, MindFormers' ConfigTemplate filling in its defaults)."""
    from mindformers.tools.register import MindFormerConfig
    from mindformers.tools.register.template import ConfigTemplate

    values = dict(sorted(copy.deepcopy(config.values).items()))
    try:
        ConfigTemplate.apply_template(values)
    except (KeyError, TypeError, ValueError) as exc:  # e.g. "The config 'runner_config' gets an unexpected key"
        raise MindFormersConfigError(f"{config.source}: MindFormers refuses the YAML: {exc}") from exc
    return MindFormerConfig(**values)


def run_trainer(config: MFJobConfig, callbacks: Sequence[Any] = ()) -> Any:
    """Train `config` with MindFormers' Trainer as run_mindformer.py does, `callbacks`
    (MindSpore Callback instances) running beside the YAML's own. On CPU, the loss-scale cell's
    overflow check and the ranks' barrier are made CPU-capable first. Returns the Trainer."""
    if config.log_dir:
        os.environ["LOG_MF_PATH"] = config.log_dir  # MindFormers' logger reads it at each call
    config = prepare_dataset(config)
    mf_config = to_mindformer_config(config)

    from mindformers.core.context import build_context
    from mindformers.trainer import Trainer

    try:
        from mindformers.utils.file_utils import set_output_path
    except ModuleNotFoundError:  # MindFormers 1.7.0 has it in tools.utils (moved to utils.file_utils in 1.8.0)
        from mindformers.tools.utils import set_output_path

    set_output_path(mf_config.output_dir)
    build_context(mf_config)
    from mindpulse.workers.cpu_fallbacks import enable_cpu_fallbacks

    enable_cpu_fallbacks()  # on CPU only: the loss-scale overflow check and the ranks' barrier
    trainer = Trainer(mf_config, callbacks=list(callbacks) or None)
    trainer.train()  # run_mindformer.py: train() for run_mode train and finetune alike
    return trainer


# --- a launched rank ---------------------------------------------------------------------------


MONITOR_CALLBACK = "MindPulseMonitor"


def run_for_rank(settings: Any, rank: int) -> None:
    """A launched rank of a `job.mindformers` run: the YAML as the driver checked and planned it
    (`mf_config_for_rank`), mindpulse's MindPulseMonitor beside the YAML's own callbacks (unless
    the YAML names it), and MindFormers' Trainer."""
    import logging

    from mindpulse.config import from_dict
    from mindpulse.config.mindformers_yaml import mf_config_for_rank

    from .faults import cell_faults_armed
    from .mindformers_monitor import MindPulseMonitor  # registers it in MindFormers' registry

    log = logging.getLogger(__name__)
    cfg = from_dict(settings.config, source="job.json config")
    config = mf_config_for_rank(cfg, settings.run_dir, settings.device_target)
    named = [c.get("type") for c in config.get("callbacks") or [] if isinstance(c, dict)]
    shape = tuple(config.get(f"model.model_config.{k}") for k in ("num_layers", "hidden_size", "seq_length"))
    batch = config.get("runner_config.batch_size") or config.get("train_dataset.batch_size")
    seq = shape[2]
    callbacks: list[Any] = []
    if MONITOR_CALLBACK not in named:
        callbacks.append(MindPulseMonitor(
            settings=settings,
            model_shape=shape if all(isinstance(x, int) for x in shape) else None,
            # every window is seq_length real tokens (the byte corpus pads nothing); a dataset
            # that pads reports more tokens than it trains on
            tokens_per_step=batch * seq if isinstance(batch, int) and isinstance(seq, int) else None))
        log.info("[rank %d] mindpulse added %s to the YAML's callbacks %s", rank, MONITOR_CALLBACK, named)
    if cell_faults_armed(rank):
        # a fault rehearsal: the train cell MindFormers builds gets the fault scalars (and
        # with them the gradient statistics) when the Monitor first sees it
        MindPulseMonitor.attach_faults = True
    run_trainer(config, callbacks)
