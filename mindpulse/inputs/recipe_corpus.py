"""The built-in recipe's corpus as a file of bytes (one byte, one token): where the shipped
one lies, and how many steps an epoch of it gives each rank. The recipe's data stream
(workers/recipes/llama_finetune.py) and the launch's check of `job.recipe.train_file`
against `train.batch_size` (launcher/input_checks.py) use this one arithmetic, so a corpus
too small for one step is refused before anything starts, by the rule the ranks apply."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TRAIN_NAME = "corpus_train.txt"
"""The shipped training text, used when `job.recipe.train_file` is empty."""
VALID_NAME = "corpus_valid.txt"
"""The shipped validation text, used when `job.recipe.valid_file` is empty."""


def shipped(name: str) -> Path:
    """A file of the recipe's shipped data (`data/` beside the recipe): found through the
    recipes package's location, which a checkout and an installed wheel lay out differently
    (the package holds no code, so nothing of the ranks is loaded)."""
    spec = importlib.util.find_spec("mindpulse.workers.recipes")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("mindpulse.workers.recipes: the recipe's package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / name


def steps_per_epoch(n_tokens: int, seq_length: int, world: int, batch_size: int) -> int:
    """Steps of `batch_size` windows of `seq_length` (+1) tokens each of `world` ranks takes in
    one pass over `n_tokens` tokens, every rank taking disjoint windows."""
    n_windows = (n_tokens - 1) // seq_length
    return (n_windows // world) // batch_size


def too_small(n_tokens: int, seq_length: int, world: int, batch_size: int) -> str | None:
    """Why an epoch of this corpus gives no step (None: it gives one or more), naming what to change."""
    if steps_per_epoch(n_tokens, seq_length, world, batch_size) >= 1:
        return None
    n_windows = max(0, (n_tokens - 1) // seq_length)
    return (f"corpus too small: {n_windows} windows of {seq_length} tokens for {world} ranks x batch "
            f"{batch_size}; use a larger corpus, a smaller train.batch_size or job.recipe.seq_length")
