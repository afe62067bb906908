"""The MindSpore and MindFormers versions mindpulse supports, and the check of what a node has.

The user's framework is theirs: on an Ascend cluster the MindSpore version is fixed by the
CANN toolkit and driver, and MindFormers often runs from a clone. mindpulse never installs
either (they are the `mindspore` extra, for the demo and the test suite); instead the driver
(`launch`, `doctor`) and every rank check what they find against the ranges below and refuse,
naming the node, what was found, the range and the fix, before any rank trains.

This module imports neither framework: it judges version strings that the caller read (a
node's probe, or a rank's own `mindspore.__version__`), so the head runs it without them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from mindpulse.common.errors import MindpulseError

MINDSPORE_MIN = "2.7.0"
"""The oldest MindSpore mindpulse runs on (2.7.0: the first release MindFormers 1.7.0 runs on)."""
MINDSPORE_BELOW = "2.11"
"""The first MindSpore release not yet tested (2.10 is the newest tested)."""
MINDFORMERS_MIN = "1.7.0"
"""The oldest MindFormers mindpulse runs on."""
MINDFORMERS_BELOW = "2.0"
"""MindFormers 2.x is not in the supported range: see docs/compat.md for what was tried."""

MINDFORMERS_PAIRS: dict[str, str] = {"1.7.0": "2.7.1", "1.8.0": "2.7.2", "1.9.0": "2.9.0"}
"""Each supported MindFormers release and the MindSpore its VERSION_MAP.json names: the pairs
the compatibility matrix runs (docs/compat.md)."""

INSTALL_HINT = ("install the MindSpore that matches this node's CANN toolkit (pip install mindspore==<version>, "
                "see docs/compat.md), or for a CPU trial `pip install 'mindpulse[mindspore]'`")


class Framework(str, enum.Enum):
    MINDSPORE = "mindspore"
    MINDFORMERS = "mindformers"


class Fit(str, enum.Enum):
    """How a found version fits the supported range."""

    OK = "ok"
    MISSING = "missing"
    TOO_OLD = "too_old"
    TOO_NEW = "too_new"
    UNREADABLE = "unreadable"


@dataclass(frozen=True)
class VersionCheck:
    """One framework on one node, judged against its supported range."""

    framework: Framework
    found: str | None
    """The version string the node reported (None: not importable there)."""
    fit: Fit
    node: str = ""
    origin: str = ""
    """Where the framework was found (its package folder), when the caller knows it: a
    MindFormers source tree (`job.mindformers.source`) or an installed copy."""

    @property
    def ok(self) -> bool:
        return self.fit is Fit.OK

    @property
    def range(self) -> str:
        return supported_range(self.framework)

    def message(self) -> str:
        """What was found, the range and the fix, in one sentence a user acts on."""
        where = f"node {self.node}" if self.node else "this node"
        name = self.framework.value
        found = f"{self.found} (from {self.origin})" if self.origin else f"{self.found}"
        if self.fit is Fit.OK:
            return f"{where}: {name} {found} (supported: {self.range})"
        if self.fit is Fit.MISSING:
            fix = (INSTALL_HINT if self.framework is Framework.MINDSPORE else
                   "pip install one of mindformers " + ", ".join(MINDFORMERS_PAIRS)
                   + ", or give a MindFormers source tree as job.mindformers.source")
            return f"{where}: no {name} can be imported (supported: {self.range}); fix: {fix}"
        if self.fit is Fit.UNREADABLE:
            return f"{where}: {name} reports the version {found!r}, which is not a version number"
        pair = ""
        if self.framework is Framework.MINDFORMERS:
            pair = " (with its MindSpore: " + ", ".join(f"{f} -> {m}" for f, m in MINDFORMERS_PAIRS.items()) + ")"
        return (f"{where}: {name} {found} is {'older' if self.fit is Fit.TOO_OLD else 'newer'} than the "
                f"supported range {self.range}; fix: install a {name} in that range{pair} on this node, "
                "or run on nodes that have one (`mindpulse doctor CONFIG` shows every node)")


def supported_range(framework: Framework) -> str:
    lo, hi = _bounds(framework)
    return f">={lo},<{hi}"


def _bounds(framework: Framework) -> tuple[str, str]:
    if framework is Framework.MINDSPORE:
        return MINDSPORE_MIN, MINDSPORE_BELOW
    return MINDFORMERS_MIN, MINDFORMERS_BELOW


def check_version(framework: Framework, found: str | None, node: str = "", origin: str = "") -> VersionCheck:
    """Judge one version string (None: the framework is missing) against its range; `origin`:
    where it was found, for the message.

    Pre-releases and local builds count by their release number: 2.8.0rc1 and
    2.7.1+ascend are in the 2.7/2.8 range (a CANN-matched build carries such tags)."""
    if found is None:
        return VersionCheck(framework, None, Fit.MISSING, node, origin)
    try:
        v = Version(found)
    except InvalidVersion:
        return VersionCheck(framework, found, Fit.UNREADABLE, node, origin)
    lo, hi = (Version(x) for x in _bounds(framework))
    release = Version(".".join(str(p) for p in v.release))
    if release < lo:
        return VersionCheck(framework, found, Fit.TOO_OLD, node, origin)
    if release >= hi:
        return VersionCheck(framework, found, Fit.TOO_NEW, node, origin)
    return VersionCheck(framework, found, Fit.OK, node, origin)


def expected_mindspore(mindformers: str | None) -> str | None:
    """The MindSpore a supported MindFormers release was built against (its VERSION_MAP.json),
    or None for a release outside the table."""
    if mindformers is None:
        return None
    try:
        key = ".".join(str(p) for p in Version(mindformers).release[:3])
    except InvalidVersion:
        return None
    return MINDFORMERS_PAIRS.get(key)


MINDFORMERS_RECIPES = ("llama_finetune",)
"""The built-in recipes that train a MindFormers model (their ranks import MindFormers)."""


def needed(job: object, task: str = "train") -> tuple[Framework, ...]:
    """The frameworks a rank of `job` (a JobConfig) imports for `task`: MindSpore always;
    MindFormers too for a MindFormers YAML and for a built-in recipe that trains a MindFormers
    model (with neither recipe nor script: `llama_finetune`), not for the pre-flight card check
    (MindSpore alone). A user script may import MindFormers itself: that is its own import.
    One rule for the ranks' own check (workers/framework_check.py) and the driver's
    (`doctor`, `launch`: launcher/framework_check.py)."""
    if task == "card_check" or getattr(job, "script", ""):
        return (Framework.MINDSPORE,)
    recipe = getattr(job, "recipe", None)
    mindformers = getattr(job, "mindformers", None) is not None or (
        getattr(recipe, "name", None) or MINDFORMERS_RECIPES[0]) in MINDFORMERS_RECIPES
    return (Framework.MINDSPORE, Framework.MINDFORMERS) if mindformers else (Framework.MINDSPORE,)


class FrameworkVersionError(MindpulseError, RuntimeError):
    """A node's MindSpore or MindFormers is missing or outside the supported range."""

    def __init__(self, checks: list[VersionCheck]):
        self.checks = checks
        super().__init__("; ".join(c.message() for c in checks))
