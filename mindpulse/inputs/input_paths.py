"""The files a run's ranks read, as the config names them, and the check that each is there.

Every rank reads its script, base checkpoint, corpus or MindFormers YAML from its own
machine's disk, so a path missing there is found only once the cluster is up, by every rank
of that machine at once. The driver checks them on the head before anything starts
(launcher/input_checks.py), and each rank checks them again at its start
(workers/rank_main.py): on another node the same path may be missing, and the rank then
fails at once with the key and the node named, before it joins MindSpore's cluster.
`input_problems` is the one check for both, and for any per-node probe that runs before
the ranks.

The config's paths are the resolved ones (the launch makes every relative input path
absolute: launcher/paths.py), so each node checks the very path its ranks will open.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mindpulse.common.errors import MindpulseError

if TYPE_CHECKING:
    from mindpulse.config import RunConfig


class InputMissing(MindpulseError, FileNotFoundError):
    """A file the config names is not there (or cannot be read) where a rank needs it; the
    message names the config key, the path and the node."""


INPUT_MISSING = InputMissing.__name__
"""How a rank's error that is an `InputMissing` begins (`InputMissing: job.script: ...`): the
driver tells a bad input on a node from a crash by it."""


class Want(str, enum.Enum):
    FILE = "file"
    """A file that is read."""
    SCRIPT = "script"
    """What `runpy.run_path` runs: a Python file, or a folder or zip with a `__main__.py`."""
    FILE_OR_DIR = "file_or_dir"
    """A checkpoint file, or a folder of them (MindFormers' `load_checkpoint`)."""


@dataclass(frozen=True)
class InputPath:
    key: str
    """The config key that names it, e.g. `job.script`."""
    path: str
    want: Want
    hint: str = ""
    """What to do when it is missing (said after the problem)."""


def rank_inputs(cfg: RunConfig) -> list[InputPath]:
    """The paths every rank of `cfg`'s job opens (empty keys: the shipped defaults, not checked)."""
    job = cfg.job
    out: list[InputPath] = []
    if job.script:
        out.append(InputPath("job.script", job.script, Want.SCRIPT))
    if job.recipe is not None:
        r = job.recipe
        if r.init_from:
            out.append(InputPath("job.recipe.init_from", r.init_from, Want.FILE,
                                 "make it with `mindpulse pretrain --out PATH`, or leave job.recipe.init_from empty "
                                 "(random weights)"))
        if r.train_file:
            out.append(InputPath("job.recipe.train_file", r.train_file, Want.FILE))
        if r.valid_file and (cfg.eval.every_steps or cfg.eval.per_epoch):  # read only when evaluation is on
            out.append(InputPath("job.recipe.valid_file", r.valid_file, Want.FILE))
    if job.mindformers is not None:
        mf = job.mindformers
        if mf.config:
            out.append(InputPath("job.mindformers.config", mf.config, Want.FILE))
        if mf.load_checkpoint:
            out.append(InputPath("job.mindformers.load_checkpoint", mf.load_checkpoint, Want.FILE_OR_DIR))
    return out


def path_problem(item: InputPath) -> str | None:
    """Why `item` cannot be used here (None: it can), naming its key and path."""
    p = item.path
    if not os.path.lexists(p):
        return f"{item.key}: {p} does not exist"
    if not os.path.exists(p):
        return f"{item.key}: {p} is a broken link"
    is_dir = os.path.isdir(p)
    if is_dir and item.want is Want.FILE:
        return f"{item.key}: {p} is a folder; give a file"
    if is_dir and item.want is Want.SCRIPT and not os.path.isfile(os.path.join(p, "__main__.py")):
        return f"{item.key}: {p} is a folder without a __main__.py; give the Python file to run"
    if not os.access(p, os.R_OK | (os.X_OK if is_dir else 0)):
        return f"{item.key}: {p} cannot be read (permission denied)"
    return None


def input_problems(cfg: RunConfig, where: str = "") -> list[str]:
    """Every input path of `cfg` that this machine's ranks could not open, one line each,
    naming the key and the path (and `where`, e.g. `on node 1 (host-b)`, when given). The
    per-node check: a rank at its start, a probe of each node before the ranks."""
    suffix = f" {where}" if where else ""
    return [f"{problem}{suffix}" + (f"; {item.hint}" if item.hint else "")
            for item in rank_inputs(cfg) if (problem := path_problem(item))]
