"""What the ranks of one node will find: run on that node, it reports Python, mindpulse,
MindSpore, MindFormers, the CANN toolkit, the driver and firmware, npu-smi, Ray and msrun.

The Python parts are read by the ranks' own interpreter (the one a rank actor or msrun runs
on this node) in a subprocess, with the ranks' environment: the probing process never
imports MindSpore, and a framework that hangs or crashes at import becomes a reported
failure (its time limit, its signal) instead of taking the probe with it. The subprocess
reports each part on its own line as it goes, so what it read before a crash is kept.

MindSpore's parts: `__version__`; the device targets the installed package was **built
for** (the plugin libraries it ships under `mindspore/lib/plugin/`: `libmindspore_cpu`,
`libmindspore_gpu*`, `libmindspore_ascend*`); the targets it **can run here** (MindSpore's
own `MSContext.is_pkg_support_device`, which `mindspore.hal.is_available` asks: a plugin
whose libraries do not load, e.g. Ascend without CANN, is not); and, when asked, a one-op
smoke test like `mindspore.run_check()` (a Mul of two float32 tensors, checked) on the
job's device. MindFormers is located, not imported (its import pulls in MindSpore and
more): where the ranks' `import mindformers` would find it (`job.mindformers.source` first
on the path when the config gives one) and the `__version__` its `__init__.py` sets.

The result is a `NodeProbe` (`to_dict`/`from_dict`: it travels back from a Ray task).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mindpulse.config import RunConfig

from . import ascend_versions
from .ascend_versions import CannToolkit, NpuSmi, VersionFile

PROBE_TIMEOUT_S = 120.0
"""How long the ranks' Python may take to report (MindSpore's import takes seconds, more on
a busy or cold node); past it the probe reports a hang."""
MARK = "MINDPULSE_PROBE "

# Run by the ranks' Python as `python -P -c RANK_PYTHON_PROBE ARGS_JSON`: the standard
# library only, one JSON line per part, flushed at once (a crash keeps the parts before it).
RANK_PYTHON_PROBE = r'''
import json, os, platform, re, sys, time
import importlib.metadata as md
import importlib.util as iu
args = json.loads(sys.argv[1])
def say(part, **v):
    sys.stdout.write("MINDPULSE_PROBE " + json.dumps(dict(v, part=part)) + "\n"); sys.stdout.flush()
def dist(name):
    try:
        return md.version(name)
    except Exception:  # not installed as a distribution (a source tree, a bare folder)
        return None
def locate(name):
    try:
        spec = iu.find_spec(name)
    except Exception as e:  # a broken parent package or path entry: reported, not raised
        return None, f"{type(e).__name__}: {e}"
    if spec is None or not spec.origin:
        return None, ""
    return os.path.dirname(spec.origin), ""
say("python", version=platform.python_version(), executable=sys.executable, path=[p for p in sys.path if p][:8])
d, err = locate("mindpulse")
say("mindpulse", version=dist("mindpulse"), path=d, error=err)
say("ray", version=dist("ray"))
d, err = locate("mindformers")
ver = None
if d:
    try:
        m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", open(os.path.join(d, "__init__.py")).read(), re.M)
        ver = m.group(1) if m else None
    except OSError:
        ver = None
say("mindformers", version=ver or (dist("mindformers") if d else None), path=d, error=err,
    dist_version=dist("mindformers"))
t0 = time.time()
try:
    import mindspore as ms
except BaseException as e:  # missing or broken: what the ranks would hit at their first import
    say("mindspore", version=None, error=f"{type(e).__name__}: {e}"[:500],
        missing=isinstance(e, ModuleNotFoundError) and e.name == "mindspore", import_s=time.time() - t0)
    sys.exit(0)
path = os.path.dirname(getattr(ms, "__file__", "") or "")
built = []
plugins = os.path.join(path, "lib", "plugin")
names = os.listdir(plugins) if os.path.isdir(plugins) else []
for target, prefix in (("CPU", "libmindspore_cpu"), ("GPU", "libmindspore_gpu"), ("Ascend", "libmindspore_ascend")):
    cpu_lib = target == "CPU" and os.path.exists(os.path.join(path, "lib", "libmindspore_cpu.so"))
    if cpu_lib or any(n.startswith(prefix) for n in names):
        built.append(target)
usable, load_error = None, ""
try:
    from mindspore._c_expression import MSContext
    ctx = MSContext.get_instance()
    usable = [t for t in ("CPU", "GPU", "Ascend") if ctx.is_pkg_support_device(t)]
    load_error = ctx.load_plugin_error() if hasattr(ctx, "load_plugin_error") else ""
except Exception as e:  # an older or unusual build without these internals: the targets stay unknown
    load_error = f"{type(e).__name__}: {e}"
say("mindspore", version=getattr(ms, "__version__", None), path=path, built_for=built, usable=usable,
    load_error=(load_error or "")[:500], import_s=time.time() - t0)
if args.get("smoke"):
    t1 = time.time()
    try:
        import numpy as np
        target = args["device_target"]
        try:
            ms.set_device(target)
        except AttributeError:  # MindSpore before set_device
            ms.set_context(device_target=target)
        x = ms.Tensor(np.array([1.0, 2.0, 3.0]), ms.float32)
        y = ms.Tensor(np.array([4.0, 5.0, 6.0]), ms.float32)
        got = ms.ops.Mul()(x, y).asnumpy().tolist()
        ok = got == [4.0, 10.0, 18.0]
        say("smoke", ok=ok, target=target, error="" if ok else f"Mul gave {got}, not [4.0, 10.0, 18.0]",
            seconds=time.time() - t1)
    except BaseException as e:  # the smoke test's failure is its result
        say("smoke", ok=False, target=args.get("device_target"), error=f"{type(e).__name__}: {e}"[:500],
            seconds=time.time() - t1)
'''


@dataclass
class Package:
    """One Python package as the ranks' interpreter finds it."""

    version: str | None = None
    path: str | None = None
    origin: str = ""
    """Where it comes from: `site-packages`, `job.mindformers.source`, `source tree` (another folder on the path)."""
    error: str = ""

    @property
    def found(self) -> bool:
        return self.path is not None or self.version is not None


@dataclass
class MindSporeInfo(Package):
    built_for: list[str] = field(default_factory=list)
    """Device targets the package ships plugins for."""
    usable: list[str] | None = None
    """Targets whose plugin loads here (None: this MindSpore does not say)."""
    load_error: str = ""
    import_s: float | None = None
    missing: bool = False
    """`import mindspore` found no such module (else an error is a broken install)."""
    smoke: dict[str, Any] | None = None
    """The one-op test: {ok, target, error, seconds}; None when not run."""


@dataclass
class NodeProbe:
    """What the ranks on one node will find."""

    host: str = ""
    node_id: str = ""
    python: dict[str, Any] = field(default_factory=dict)
    """{version, executable, path}; empty when the ranks' Python did not run."""
    mindpulse: Package = field(default_factory=Package)
    ray: Package = field(default_factory=Package)
    mindspore: MindSporeInfo = field(default_factory=MindSporeInfo)
    mindformers: Package = field(default_factory=Package)
    cann: CannToolkit = field(default_factory=CannToolkit)
    driver: VersionFile = field(default_factory=VersionFile)
    firmware: VersionFile = field(default_factory=VersionFile)
    npu_smi: NpuSmi = field(default_factory=NpuSmi)
    msrun: str | None = None
    """The msrun the node agent would run (next to the ranks' Python), when there is one."""
    error: str = ""
    """The ranks' Python failed as a whole: did not start, hung, or died (with what it said)."""
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeProbe:
        d = dict(d)
        kinds = {"mindpulse": Package, "ray": Package, "mindspore": MindSporeInfo, "mindformers": Package,
                 "cann": CannToolkit, "driver": VersionFile, "firmware": VersionFile, "npu_smi": NpuSmi}
        for key, kind in kinds.items():
            if isinstance(d.get(key), dict):
                d[key] = kind(**d[key])
        return cls(**d)


def _origin(path: str | None, source: str) -> str:
    if not path:
        return ""
    if source and os.path.realpath(path).startswith(os.path.realpath(source).rstrip("/") + "/"):
        return "job.mindformers.source"
    parts = Path(path).parts
    if "site-packages" in parts or "dist-packages" in parts:
        return "site-packages"
    return "source tree"


def rank_python(backend: str) -> str:
    """The interpreter the ranks run on this node: the Ray worker's own (a rank actor runs in
    it); msrun's workers run the `python` next to it (the node agent puts its folder first
    on msrun's PATH)."""
    if backend == "msrun":
        beside = os.path.join(os.path.dirname(sys.executable), "python")
        if os.path.exists(beside):
            return beside
    return sys.executable


def _run_rank_python(python: str, env: dict[str, str], args: dict[str, Any], timeout: float,
                     on_start: Callable[[subprocess.Popen], None] | None = None
                     ) -> tuple[dict[str, dict[str, Any]], str]:
    """Run RANK_PYTHON_PROBE; returns its parts and, when it failed as a whole, why.
    `on_start` is given the process (its caller may end it: a launch that stops first)."""
    try:
        proc = subprocess.Popen([python, "-P", "-c", RANK_PYTHON_PROBE, json.dumps(args)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                cwd=env.get("HOME") if env.get("HOME") and os.path.isdir(env["HOME"]) else "/")
    except OSError as exc:
        return {}, f"the ranks' Python {python} cannot be started: {exc}"
    if on_start is not None:
        on_start(proc)
    why = ""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:  # it ended on its own meanwhile
            pass
        out, err = proc.communicate()
        why = f"the ranks' Python did not finish within {timeout:g} s (a hang at import?)"
    parts: dict[str, dict[str, Any]] = {}
    for line in out.splitlines():
        if line.startswith(MARK):
            try:
                part = json.loads(line[len(MARK):])
            except ValueError:
                continue
            parts[part.pop("part")] = part
    if not why and proc.returncode != 0:
        last = [ln for ln in err.strip().splitlines() if ln.strip()][-1:] if err else []
        sig = -proc.returncode if proc.returncode < 0 else 0
        what = f"killed by signal {signal.Signals(sig).name}" if sig else f"exited {proc.returncode}"
        after = next((p for p in ("smoke", "mindspore", "mindformers", "ray", "mindpulse", "python")
                      if p in parts), "start")
        why = (f"the ranks' Python {what} after its {after} part" + (f": {last[0][:300]}" if last else ""))
    return parts, why


def probe_node(*, env: dict[str, str] | None = None, backend: str = RunConfig.backend.value,
               device_target: str = "CPU",
               smoke: bool = False, mindformers_source: str = "", root: str = "/", python: str | None = None,
               timeout: float = PROBE_TIMEOUT_S, run_npu_smi: bool = True,
               on_start: Callable[[subprocess.Popen], None] | None = None) -> NodeProbe:
    """What the ranks on this node will find (see the module's notes).

    `env`: the ranks' environment on top of this process's (the config's `env:` among it);
    `mindformers_source` goes first on their PYTHONPATH, as on the ranks'. `root`: the prefix
    of the Ascend files (tests point it at a fake tree). Returns a dict-ready NodeProbe."""
    t0 = time.time()
    full = dict(os.environ)
    full.update(env or {})
    if mindformers_source:
        full["PYTHONPATH"] = os.pathsep.join(p for p in (mindformers_source, full.get("PYTHONPATH", "")) if p)
    python = python or rank_python(backend)
    parts, why = _run_rank_python(python, full, {"smoke": smoke, "device_target": device_target}, timeout, on_start)
    probe = NodeProbe(host=socket.gethostname(), python=parts.get("python", {}), error=why)
    try:
        import ray

        if ray.is_initialized():
            probe.node_id = ray.get_runtime_context().get_node_id()
    except Exception:  # outside Ray (a local probe): no node id to give
        pass
    mp = parts.get("mindpulse", {})
    probe.mindpulse = Package(version=mp.get("version"), path=mp.get("path"), origin=_origin(mp.get("path"), ""),
                              error=mp.get("error", ""))
    probe.ray = Package(version=parts.get("ray", {}).get("version"))
    mf = parts.get("mindformers", {})
    probe.mindformers = Package(version=mf.get("version"), path=mf.get("path"),
                                origin=_origin(mf.get("path"), mindformers_source), error=mf.get("error", ""))
    ms = parts.get("mindspore")
    if ms is not None:
        probe.mindspore = MindSporeInfo(
            version=ms.get("version"), path=ms.get("path"), origin=_origin(ms.get("path"), ""),
            error=ms.get("error", ""), built_for=ms.get("built_for") or [], usable=ms.get("usable"),
            load_error=ms.get("load_error", ""), import_s=ms.get("import_s"), missing=bool(ms.get("missing")),
            smoke=parts.get("smoke"))
    elif not why:
        probe.mindspore = MindSporeInfo(error="the ranks' Python reported nothing of MindSpore")
    else:
        probe.mindspore = MindSporeInfo(error=why)
    probe.cann = ascend_versions.cann_toolkit(root, env=full)
    probe.driver = ascend_versions.driver(root)
    probe.firmware = ascend_versions.firmware(root)
    probe.npu_smi = ascend_versions.npu_smi(root, run=run_npu_smi)
    here = os.path.join(os.path.dirname(python), "msrun")
    probe.msrun = here if os.path.exists(here) else None
    probe.seconds = time.time() - t0
    return probe


def probe_node_dict(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`probe_node` for a Ray task: keyword arguments in, a plain dict out."""
    return probe_node(**kwargs).to_dict()
