"""The verdicts on one node's probe: does what its ranks will find fit this config?

Each row is one thing a rank needs (the ranks' Python and mindpulse in it, MindSpore, for a
MindFormers job MindFormers, for an Ascend job the CANN toolkit and driver, for msrun the
msrun command) with what was found, what is wanted and, when it does not fit, the fix.
`FAIL` refuses a launch (and makes `mindpulse doctor` exit 2); `WARN` is said and the
launch goes on (a MindFormers whose VERSION_MAP.json names another MindSpore, a driver
folder without npu-smi); `OK` and `INFO` are shown. The ranges are `mindpulse.frameworks.framework_support`'s.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any

from mindpulse.config import Backend, Device, RunConfig
from mindpulse.frameworks.framework_probe import NodeProbe
from mindpulse.frameworks.framework_support import (
    INSTALL_HINT,
    MINDFORMERS_PAIRS,
    Fit,
    Framework,
    check_version,
    expected_mindspore,
    needed,
    supported_range,
)

DEVICE_PLUGIN = {Device.CPU: "CPU", Device.GPU: "GPU", Device.ASCEND: "Ascend"}
"""MindSpore's name of each `world.device` (its device target and plugin)."""


class Level(str, enum.Enum):
    OK = "ok"
    INFO = "info"
    WARN = "warn"
    FAIL = "FAIL"


@dataclass
class Verdict:
    node: str
    item: str
    level: Level
    found: str
    wanted: str = ""
    fix: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), level=self.level.value)


def mindformers_source(cfg: RunConfig) -> str:
    """`job.mindformers.source` (a MindFormers tree put first on the ranks' path), else empty."""
    mf = cfg.job.mindformers
    return mf.source if mf is not None else ""


def _where(path: str | None, origin: str) -> str:
    return f" from {path}" + (f" ({origin})" if origin else "") if path else ""


def judge(cfg: RunConfig, probe: NodeProbe, node: str) -> list[Verdict]:
    """Every verdict on one node's probe (`node`: how the node is named in messages)."""
    device = cfg.world.device
    out: list[Verdict] = []
    add = lambda item, level, found, wanted="", fix="": out.append(Verdict(node, item, level, found, wanted, fix))
    py = probe.python
    if not py:
        add("python", Level.FAIL, probe.error or "the ranks' Python did not report", "a Python 3.11 the ranks run",
            "check the node's Python environment (the Ray worker's interpreter) and run `mindpulse doctor CONFIG` "
            "there again")
        return out
    add("python", Level.INFO, f"{py.get('version')} ({py.get('executable')})")
    mp = probe.mindpulse
    if mp.found:
        add("mindpulse", Level.INFO, f"{mp.version or '(no version)'}{_where(mp.path, '')}")
    else:
        add("mindpulse", Level.FAIL, "not importable by the ranks' Python" + (f" ({mp.error})" if mp.error else ""),
            "mindpulse importable (ranks run `python -m mindpulse.workers.rank_main`)",
            "pip install mindpulse into the environment where this node's MindSpore runs")
    out.extend(_mindspore(cfg, probe, node))
    if Framework.MINDFORMERS in needed(cfg.job):
        out.extend(_mindformers(cfg, probe, node))
    out.extend(_ascend(cfg, probe, node, device))
    if cfg.backend is Backend.MSRUN:
        if probe.msrun:
            add("msrun", Level.OK, probe.msrun)
        else:
            add("msrun", Level.FAIL, "no msrun next to the ranks' Python", "MindSpore's msrun (backend: msrun)",
                "msrun is installed with MindSpore: install MindSpore in this environment, or use backend: ray")
    add("ray", Level.INFO, probe.ray.version or "not found by the ranks' Python")
    if probe.error and probe.mindspore.found:
        add("probe", Level.FAIL, probe.error, "the ranks' Python to finish", "see the error; "
            "a framework that crashes or hangs at import here will do the same in every rank")
    return out


def _mindspore(cfg: RunConfig, probe: NodeProbe, node: str) -> list[Verdict]:
    ms = probe.mindspore
    want = supported_range(Framework.MINDSPORE)
    if not ms.found:
        if ms.missing or not ms.error:
            return [Verdict(node, "mindspore", Level.FAIL, "not installed (import mindspore: no such module)", want,
                            INSTALL_HINT)]
        return [Verdict(node, "mindspore", Level.FAIL, f"import fails: {ms.error}", want,
                        "repair this node's MindSpore install (the error is what every rank would hit)")]
    out: list[Verdict] = []
    chk = check_version(Framework.MINDSPORE, ms.version, node)
    found = f"{ms.version}{_where(ms.path, ms.origin)}"
    if chk.ok:
        out.append(Verdict(node, "mindspore", Level.OK, found, want))
    else:
        fix = INSTALL_HINT if chk.fit is not Fit.UNREADABLE else "reinstall MindSpore from its wheel"
        out.append(Verdict(node, "mindspore", Level.FAIL, found, want, fix))
    target = DEVICE_PLUGIN[cfg.world.device]
    built = ", ".join(ms.built_for) or "unknown"
    usable = "unknown" if ms.usable is None else (", ".join(ms.usable) or "none")
    targets = f"built for {built}; usable here: {usable}"
    if ms.built_for and target not in ms.built_for:
        out.append(Verdict(node, "mindspore targets", Level.FAIL, targets, f"{target} (world.device)",
                           f"install a MindSpore built for {target}, or set world.device to one of {built}"))
    elif ms.usable is not None and target not in ms.usable:
        why = f" ({ms.load_error.strip().splitlines()[0]})" if ms.load_error.strip() else ""
        out.append(Verdict(node, "mindspore targets", Level.FAIL, targets + why, f"{target} (world.device)",
                           f"MindSpore's {target} plugin does not load here: install the CANN toolkit and driver "
                           f"that this MindSpore release pairs with (docs/compat.md) and source its set_env.sh"
                           if target == "Ascend" else f"MindSpore's {target} plugin does not load on this node"))
    else:
        out.append(Verdict(node, "mindspore targets", Level.OK, targets, f"{target} (world.device)"))
    if ms.smoke is not None:
        s = ms.smoke
        if s.get("ok"):
            out.append(Verdict(node, "mindspore run_check", Level.OK,
                               f"Mul on {s.get('target')} correct ({float(s.get('seconds') or 0):.1f} s)"))
        else:
            out.append(Verdict(node, "mindspore run_check", Level.FAIL, f"Mul on {s.get('target')}: {s.get('error')}",
                               "a correct product", "run `python -c 'import mindspore; mindspore.run_check()'` on "
                               "this node and repair what it reports"))
    return out


def _mindformers(cfg: RunConfig, probe: NodeProbe, node: str) -> list[Verdict]:
    mf = probe.mindformers
    want = supported_range(Framework.MINDFORMERS)
    source = mindformers_source(cfg)
    if not mf.found:
        chk = check_version(Framework.MINDFORMERS, None, node)
        where = f" (job.mindformers.source {source} holds none either)" if source else ""
        return [Verdict(node, "mindformers", Level.FAIL, "not importable by the ranks' Python" + where, want,
                        chk.message().split("fix: ", 1)[-1])]
    out: list[Verdict] = []
    chk = check_version(Framework.MINDFORMERS, mf.version, node)
    found = f"{mf.version or '(no version)'}{_where(mf.path, mf.origin)}"
    if chk.ok:
        out.append(Verdict(node, "mindformers", Level.OK, found, want))
    else:
        pairs = ", ".join(f"mindformers {f} with mindspore {m}" for f, m in MINDFORMERS_PAIRS.items())
        out.append(Verdict(node, "mindformers", Level.FAIL, found, want, f"install one of: {pairs}"))
    expect = expected_mindspore(mf.version)
    ms = probe.mindspore.version
    if chk.ok and expect and ms:
        same = _release(ms)[:2] == _release(expect)[:2]
        out.append(Verdict(node, "mindformers pair", Level.OK if same else Level.WARN,
                           f"mindformers {mf.version} was released with mindspore {expect}; found {ms}",
                           f"mindspore {expect}", "" if same else f"pip install mindspore=={expect} if the ranks "
                           "fail in MindFormers (the pair its VERSION_MAP.json names)"))
    return out


def _release(version: str) -> tuple[int, ...]:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release
    except InvalidVersion:
        return ()


def _ascend(cfg: RunConfig, probe: NodeProbe, node: str, device: Device) -> list[Verdict]:
    ascend = device is Device.ASCEND
    out: list[Verdict] = []
    need = Level.FAIL if ascend else Level.INFO
    c = probe.cann
    if c.version:
        extra = f"; version.cfg says {c.version_cfg}" if c.version_cfg and c.version_cfg != c.version else ""
        out.append(Verdict(node, "cann toolkit", Level.OK if ascend else Level.INFO,
                           f"{c.version} ({c.layout} layout: {c.path}{extra})"))
    else:
        out.append(Verdict(node, "cann toolkit", need, "not found (looked at " + ", ".join(c.missing) + ")",
                           "the CANN toolkit" if ascend else "",
                           "install the CANN toolkit that this MindSpore pairs with (docs/compat.md), or mount "
                           "/usr/local/Ascend into the container, and source its set_env.sh" if ascend else
                           "(not needed for a cpu job)" if device is Device.CPU else ""))
    d = probe.driver
    if d.version:
        out.append(Verdict(node, "npu driver", Level.OK if ascend else Level.INFO, f"{d.version} ({d.path})"))
    else:
        out.append(Verdict(node, "npu driver", need, f"not found ({', '.join(d.missing)})",
                           "the NPU driver" if ascend else "",
                           "install the Ascend HDK driver, or mount /usr/local/Ascend/driver into the container"
                           if ascend else "(not needed for a cpu job)" if device is Device.CPU else ""))
    f = probe.firmware
    if f.version:
        out.append(Verdict(node, "npu firmware", Level.INFO,
                           f"{f.version}" + (f" (HDK {f.detail})" if f.detail else "") + f" ({f.path})"))
    else:
        out.append(Verdict(node, "npu firmware", Level.INFO, f"not readable here ({', '.join(f.missing)})",
                           fix="a container often does not mount it; the host's `npu-smi info -t board -i 0` shows it"
                           if ascend else ""))
    s = probe.npu_smi
    if s.path and not s.error:
        out.append(Verdict(node, "npu-smi", Level.OK if ascend else Level.INFO, f"{s.version} ({s.path})"))
    else:
        found = f"{s.path}: {s.error}" if s.path else s.error
        out.append(Verdict(node, "npu-smi", Level.WARN if ascend else Level.INFO, found,
                           "npu-smi (card telemetry)" if ascend else "",
                           "mount /usr/local/sbin/npu-smi into the container (telemetry then falls back to DCMI "
                           "or none)" if ascend else ""))
    return out


def failures(verdicts: list[Verdict]) -> list[Verdict]:
    return [v for v in verdicts if v.level is Level.FAIL]
