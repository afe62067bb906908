"""One cached virtual environment per framework pair, built as a user's environment is: the
pair's MindSpore (and MindFormers) first, then mindpulse into it without touching them.

A venv lives in `<cache>/<pair>/` (default `~/.cache/mindpulse/compat`) and is reused while its
stamp says it was built for that pair with the same mindpulse dependencies. The build:

1. `python -m venv`, then `pip install mindspore==X [mindformers==Y]`: the framework and
   whatever it pins (numpy, protobuf, transformers, ...), as the user has them;
2. mindpulse's own dependencies, read from pyproject.toml's `[project] dependencies` with the
   frameworks left out, under a constraints file that holds every package step 1 installed at
   the version it installed: mindpulse changes nothing the framework brought (a conflict fails
   the build and says which package);
3. `pip install --no-deps -e <checkout>` (again whenever the checkout or its pyproject.toml
   differs from the last one installed there), so each launch runs the checkout's current code.

A pair whose MindFormers cannot be installed whole (a requirement is not published) is built
`partial`: MindFormers with `--no-deps`, then each of its requirements that the index has, none
changing what MindSpore installed; the missing ones are recorded (`missing`), those held at
MindSpore's version too (`kept`), and the features run to show what works without them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("MINDPULSE_COMPAT_CACHE", "~/.cache/mindpulse/compat")).expanduser()
FRAMEWORKS = ("mindspore", "mindformers")
STAMP = "compat-venv.json"
BUILD = 2
"""The build recipe's version in the stamp: a venv built by another recipe is built again."""
PIP_TIMEOUT_S = 1800
"""A cold build downloads MindSpore (~300 MB) and, for a MindFormers pair, ~100 packages."""


class BuildError(RuntimeError):
    """A venv could not be built; the message holds pip's reason."""


@dataclass(frozen=True)
class Pair:
    mindspore: str
    mindformers: str | None = None
    partial: bool = False
    """MindFormers installed without its unpublished requirements (a trial, not a supported pair)."""

    @property
    def name(self) -> str:
        return f"ms{self.mindspore}" + (f"-mf{self.mindformers}" if self.mindformers else "")

    def framework_reqs(self) -> list[str]:
        return [f"mindspore=={self.mindspore}"] + ([f"mindformers=={self.mindformers}"] if self.mindformers else [])


@dataclass
class Venv:
    pair: Pair
    path: Path
    built_s: float | None = None
    """Seconds the build took (for a venv reused from the cache: when it was built)."""
    reused: bool = False
    installed: dict[str, str] = field(default_factory=dict)
    """The framework's packages as the build found them (mindspore, mindformers, numpy, ...)."""
    missing: list[str] = field(default_factory=list)
    """MindFormers requirements the index does not have (a partial pair)."""
    kept: list[str] = field(default_factory=list)
    """mindpulse's requirements the framework's own install does not meet, left to the framework
    (e.g. `numpy>=1.26,<2 (numpy 2.4.6 kept)`): what `pip install mindpulse` would change there."""

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def core_dependencies(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """mindpulse's `[project] dependencies` without MindSpore and MindFormers: what it adds to
    the user's environment."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if Requirement(d).name.lower() not in FRAMEWORKS]


def requirements_beside(framework: dict[str, str], deps: list[str]) -> tuple[list[str], list[str]]:
    """(to install, kept): `deps` without those naming a package the framework installed at a
    version outside their specifier (the framework's version stays; each is reported as kept)."""
    install, kept = [], []
    for dep in deps:
        req = Requirement(dep)
        have = framework.get(req.name.lower())
        if have is not None and not req.specifier.contains(have, prereleases=True):
            kept.append(f"{dep} ({req.name} {have} kept)")
        else:
            install.append(dep)
    return install, kept


def _pip(python: Path, *args: str, timeout: float = PIP_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=timeout)


def _freeze(python: Path) -> dict[str, str]:
    out = _pip(python, "list", "--format=json", timeout=300)
    if out.returncode != 0:
        raise BuildError(f"pip list failed: {out.stderr[-2000:]}")
    return {p["name"].lower(): p["version"] for p in json.loads(out.stdout)}


def _pip_failure(what: str, proc: subprocess.CompletedProcess) -> BuildError:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR") or "conflict" in ln.lower()]
    return BuildError(f"{what}: " + (" | ".join(lines[-6:]) or proc.stderr[-1500:]))


_NOT_FOUND = re.compile(r"No matching distribution found for ([^\s]+)")


def unpublished_requirements(python: Path, reqs: list[str]) -> list[str]:
    """The requirements among `reqs` that the index cannot satisfy, found by resolving them
    together (pip's dry run) and taking out each one pip names as not found, until the rest
    resolves. Each pip run names only the first such requirement."""
    missing: list[str] = []
    rest = list(reqs)
    while rest:
        proc = _pip(python, "install", "--dry-run", "--quiet", "--ignore-installed", *rest)
        found = _NOT_FOUND.search(proc.stderr)
        if proc.returncode == 0 or not found:
            break
        name = Requirement(found.group(1)).name.lower()
        missing += [r for r in rest if Requirement(r).name.lower() == name]
        rest = [r for r in rest if Requirement(r).name.lower() != name]
    return missing


def _mindformers_requirements(python: Path) -> list[str]:
    out = subprocess.run([str(python), "-c", "import importlib.metadata as m; print('\\n'.join("
                          "r for r in (m.requires('mindformers') or []) if 'extra ==' not in r))"],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise BuildError(f"reading mindformers' requirements: {out.stderr[-1500:]}")
    return [r for r in out.stdout.splitlines() if r.strip()]


def _build(pair: Pair, path: Path, log) -> Venv:
    started = time.monotonic()
    if path.exists():
        subprocess.run(["rm", "-rf", str(path)], check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    venv = Venv(pair, path)
    log(f"{pair.name}: installing {' '.join(pair.framework_reqs())}")
    if not pair.partial:
        proc = _pip(venv.python, "install", *pair.framework_reqs())
        if proc.returncode != 0:
            raise _pip_failure(f"pip install {' '.join(pair.framework_reqs())}", proc)
    else:
        proc = _pip(venv.python, "install", f"mindspore=={pair.mindspore}")
        if proc.returncode != 0:
            raise _pip_failure(f"pip install mindspore=={pair.mindspore}", proc)
        proc = _pip(venv.python, "install", "--no-deps", f"mindformers=={pair.mindformers}")
        if proc.returncode != 0:
            raise _pip_failure(f"pip install --no-deps mindformers=={pair.mindformers}", proc)
        reqs = [r for r in _mindformers_requirements(venv.python) if Requirement(r).name.lower() != "mindspore"]
        venv.missing = unpublished_requirements(venv.python, reqs)
        have = [r for r in reqs if r not in venv.missing]
        log(f"{pair.name}: mindformers' requirements not on the index: {venv.missing or 'none'}")
        # MindSpore's environment stays as it installed it (numpy among them): a requirement of
        # MindFormers that would change it is kept at MindSpore's version and listed
        ms_env = _freeze(venv.python)
        have, kept = requirements_beside(ms_env, have)
        venv.kept = [f"mindformers: {k}" for k in kept]
        constraints = path / "framework-constraints.txt"
        constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted(ms_env.items()) if n != "mindformers"))
        proc = _pip(venv.python, "install", "-c", str(constraints), *have)
        if proc.returncode != 0:
            raise _pip_failure("pip install mindformers' published requirements", proc)
    framework = _freeze(venv.python)
    constraints = path / "framework-constraints.txt"
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted(framework.items())))
    log(f"{pair.name}: installing mindpulse's dependencies beside the framework (held at its versions)")
    install, kept = requirements_beside(framework, core_dependencies())
    venv.kept += kept
    if venv.kept:
        log(f"{pair.name}: the framework's versions kept against mindpulse's requirements: {venv.kept}")
    proc = _pip(venv.python, "install", "-c", str(constraints), *install)
    if proc.returncode != 0:
        raise _pip_failure("mindpulse's dependencies conflict with the framework's", proc)
    venv.installed = {k: v for k, v in framework.items()
                      if k in ("mindspore", "mindformers", "numpy", "protobuf", "transformers")}
    venv.built_s = round(time.monotonic() - started, 1)
    (path / STAMP).write_text(json.dumps({"build": BUILD, "pair": asdict(pair), "deps": core_dependencies(),
                                          "installed": venv.installed, "missing": venv.missing, "kept": venv.kept,
                                          "built_s": venv.built_s, "python": sys.version.split()[0]}, indent=1))
    return venv


def _cached(pair: Pair, path: Path) -> Venv | None:
    try:
        stamp = json.loads((path / STAMP).read_text())
    except (OSError, ValueError):
        return None
    if stamp.get("build") != BUILD or stamp.get("pair") != asdict(pair) or stamp.get("deps") != core_dependencies():
        return None
    if not (path / "bin" / "python").exists():
        return None
    return Venv(pair, path, built_s=stamp.get("built_s"), reused=True, installed=stamp.get("installed", {}),
                missing=stamp.get("missing", []), kept=stamp.get("kept", []))


def ensure(pair: Pair, cache: Path = CACHE, log=print) -> Venv:
    """The pair's venv, built when the cache has none for it (or one built for other
    dependencies), with the checkout's mindpulse installed into it."""
    path = cache / pair.name
    venv = _cached(pair, path)
    if venv is None:
        venv = _build(pair, path, log)
        log(f"{pair.name}: built in {venv.built_s:.0f} s")
    else:
        log(f"{pair.name}: reusing {path}")
    # editable: the checkout's code is read at each import; reinstalled only for another
    # checkout or another pyproject.toml (packages, entry points)
    marker = path / "compat-mindpulse.json"
    want = {"checkout": str(ROOT), "pyproject": hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()}
    try:
        current = json.loads(marker.read_text())
    except (OSError, ValueError):
        current = None
    if current != want:
        before = _freeze(venv.python)
        proc = _pip(venv.python, "install", "--no-deps", "-e", str(ROOT), timeout=600)
        if proc.returncode != 0:
            raise _pip_failure("pip install --no-deps -e <checkout>", proc)
        after = _freeze(venv.python)
        changed = {k: (before.get(k), v) for k, v in after.items() if k != "mindpulse" and before.get(k) != v}
        if changed:
            raise BuildError(f"installing mindpulse changed the environment: {changed}")
        marker.write_text(json.dumps(want))
    return venv
