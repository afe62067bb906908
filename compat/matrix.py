"""The compatibility matrix: which framework pairs run which features.

The supported ranges and the MindFormers pairs come from mindpulse/frameworks/framework_support.py; the
MindSpore releases between and above the MindFormers pairs run the script paths alone (they
have no MindFormers release of their own). MindFormers 2.x is tried, not supported: its
requirements are checked against the index and the pair that can be installed is run.
"""

from __future__ import annotations

import enum

from venvs import Pair

from mindpulse.frameworks.framework_support import MINDFORMERS_PAIRS, Framework, check_version


class Feature(str, enum.Enum):
    SCRIPT_MODEL_TRAIN = "script_model_train"
    SCRIPT_HAND_LOOP = "script_hand_loop"
    MINDFORMERS_YAML = "mindformers_yaml"
    RECIPE = "recipe"

    @property
    def title(self) -> str:
        return {"script_model_train": "unmodified `Model.train` script (auto-attach)",
                "script_hand_loop": "hand loop with the `Monitor`",
                "mindformers_yaml": "MindFormers YAML (`job.mindformers`)",
                "recipe": "recipe `llama_finetune` (default job)"}[self.value]


SCRIPT = (Feature.SCRIPT_MODEL_TRAIN, Feature.SCRIPT_HAND_LOOP)
MINDFORMERS = (Feature.MINDFORMERS_YAML, Feature.RECIPE)

MINDSPORE_ONLY = ("2.7.0", "2.8.0", "2.10.0")
"""MindSpore releases in the supported range that no supported MindFormers release pairs with:
the script paths run on them alone (2.7.0: the range's first release)."""

MINDFORMERS_TRIED = {"2.0.0": "2.10.0"}
"""MindFormers releases above the supported range that are installed and run (with the MindSpore
their requirements name, where the index has it) though a requirement of theirs is missing."""
MINDFORMERS_CHECKED = ("2.0.0", "2.1.0")
"""MindFormers releases above the supported range whose requirements and APIs are checked."""


def supported_pairs() -> list[tuple[Pair, tuple[Feature, ...]]]:
    """Every supported pair with its features, oldest MindSpore first."""
    rows = [(Pair(ms, mf), SCRIPT + MINDFORMERS) for mf, ms in MINDFORMERS_PAIRS.items()]
    rows += [(Pair(ms), SCRIPT) for ms in MINDSPORE_ONLY]
    for pair, _ in rows:
        assert check_version(Framework.MINDSPORE, pair.mindspore).ok, pair
        assert pair.mindformers is None or check_version(Framework.MINDFORMERS, pair.mindformers).ok, pair
    return sorted(rows, key=lambda r: (_key(r[0].mindspore), r[0].mindformers or ""))


def tried_pairs() -> list[tuple[Pair, tuple[Feature, ...]]]:
    return [(Pair(ms, mf, partial=True), MINDFORMERS) for mf, ms in MINDFORMERS_TRIED.items()]


def oldest_and_newest() -> list[tuple[Pair, tuple[Feature, ...]]]:
    """The CI subset: the oldest MindFormers pair (every feature it has) and the newest
    MindSpore (its script paths); the main environment covers the pair the suite runs."""
    rows = supported_pairs()
    with_mf = [r for r in rows if r[0].mindformers]
    return [with_mf[0], rows[-1]]


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".")[:3])
