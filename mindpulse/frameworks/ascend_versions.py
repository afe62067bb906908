"""What an Ascend node has installed below MindSpore, read from the toolkit's and driver's own files.

Nothing here runs a framework or a tool but `npu-smi`: the versions come from the files the
installers write, at the places they write them, under a root prefix (default `/`) so a test
points it at a fake tree.

- **CANN toolkit.** Its place moved. CANN 8.3 and before: `Ascend/ascend-toolkit/latest/`
  (a link to the versioned folder, e.g. `8.2.RC1/`) holds `version.cfg` and
  `<arch>-linux/ascend_toolkit_install.info`. CANN 8.5 and later: `Ascend/cann/<arch>-linux/
  ascend_toolkit_install.info` (the `cann` folder itself often a link to `cann-8.5.0`), with
  `ascend-toolkit/latest` kept as a link to the `cann` folder. MindFormers' own `run_check`
  reads `$ASCEND_HOME_PATH/<arch>-linux/ascend_toolkit_install.info`, falling back to
  `ascend-toolkit/latest`; that is read first here too, then the two default places. The
  `latest` link is resolved here (an absolute link target is taken under the root prefix).
- **driver**: `Ascend/driver/version.info`; its `package_version` (the HDK release, e.g.
  `25.0.rc1.1`) before `Version` (older drivers write only `Version`).
- **firmware**: `Ascend/firmware/version.info`: `Version` is the firmware's own number
  (`7.7.0.1.231`), `package_version` the HDK release it came in.
- **npu-smi**: its place, and the version in the first line of `npu-smi info`
  (`| npu-smi 24.1.0   Version: 24.1.0 |`).

Containers often mount only some of these files (the driver's `version.info` and `npu-smi`,
not the firmware's); every reader says which file it read and which were missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ASCEND = "usr/local/Ascend"
"""The default install root of every Ascend package, relative to the root prefix."""
NPU_SMI_PLACES = ("usr/local/sbin/npu-smi", "usr/local/bin/npu-smi")
"""Where the driver installs npu-smi (a container mounts one of them)."""
NPU_SMI_TIMEOUT_S = 15.0
_NPU_SMI_HEADER = re.compile(r"npu-smi\s+(\S+)\s+Version:\s*(\S+)")
_RUNNING = re.compile(r"^\[?([^:\]]*):?([^\]]*)\]?$")


@dataclass
class VersionFile:
    """One version read from one installer file (None: nothing found)."""

    version: str | None = None
    path: str = ""
    """The file read (as on the node, without the root prefix)."""
    detail: str = ""
    """What else the file says that a user compares (the inner version, the HDK package)."""
    missing: list[str] = field(default_factory=list)
    """The places looked at that did not exist."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VersionFile:
        return cls(**d)


@dataclass
class CannToolkit(VersionFile):
    layout: str = ""
    """`ascend-toolkit` (CANN <= 8.3), `cann` (CANN >= 8.5) or `ASCEND_HOME_PATH`."""
    latest: str = ""
    """Where `ascend-toolkit/latest` points, resolved."""
    version_cfg: str | None = None
    """The version `version.cfg` names (CANN <= 8.3), when that file is there."""


@dataclass
class NpuSmi:
    path: str | None = None
    version: str | None = None
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NpuSmi:
        return cls(**d)


def key_values(text: str) -> dict[str, str]:
    """`key=value` lines (the format of every file here), comments and blank lines skipped."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        k, v = line.split("=", 1)
        out.setdefault(k.strip(), v.strip().strip('"'))
    return out


def _under(root: Path, path: str) -> Path:
    """`path` (absolute on the node) under the root prefix."""
    return root / path.lstrip("/")


def resolve_link(root: Path, rel: str, hops: int = 16) -> Path:
    """`rel` under `root` with every link on the way followed, an absolute target taken under
    `root` again (a fake tree's `latest -> /usr/local/Ascend/cann` stays inside it; with the
    root `/` this is the node's own realpath)."""
    parts = Path(rel.lstrip("/")).parts
    cur = root
    todo = list(parts)
    while todo:
        part = todo.pop(0)
        nxt = cur / part
        if nxt.is_symlink() and hops > 0:
            hops -= 1
            target = os.readlink(nxt)
            if os.path.isabs(target):
                cur = root
                todo = list(Path(target.lstrip("/")).parts) + todo
            else:
                todo = list(Path(target).parts) + todo
            continue
        if part == "..":
            cur = cur.parent if cur != root else root
        elif part != ".":
            cur = nxt
    return cur


def _shown(root: Path, path: Path) -> str:
    """A path as on the node (the root prefix taken off)."""
    try:
        return "/" + str(path.relative_to(root)).lstrip("/")
    except ValueError:
        return str(path)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:  # absent, unreadable or a folder: the caller says which file it missed
        return None


def version_cfg_version(text: str) -> str | None:
    """The CANN release `version.cfg` names: `toolkit_running_version=[7.6.0.1.220:8.0.0]`
    → `8.0.0` (the part after the colon; the part before is the inner build number). The
    toolkit's line first, then the runtime's (a runtime-only install has no toolkit line)."""
    kv = key_values(text)
    for key in ("toolkit_running_version", "runtime_running_version", "toolkit_installed_version"):
        m = _RUNNING.match(kv.get(key, ""))
        if m and (m.group(2) or m.group(1)):
            return m.group(2) or m.group(1)
    return None


def cann_toolkit(root: Path | str = "/", arch: str | None = None,
                 env: dict[str, str] | None = None) -> CannToolkit:
    """The CANN toolkit's version from its own files (see the module's notes for the places)."""
    import platform

    root = Path(root)
    arch = arch or platform.machine()
    env = os.environ if env is None else env
    info_name = f"{arch}-linux/ascend_toolkit_install.info"
    latest = resolve_link(root, f"{ASCEND}/ascend-toolkit/latest")
    cann = resolve_link(root, f"{ASCEND}/cann")
    places: list[tuple[str, Path]] = []
    home = env.get("ASCEND_HOME_PATH", "")
    if home:
        places.append(("ASCEND_HOME_PATH", resolve_link(root, home)))
    # where `latest` points decides the layout: into the `cann` folder it is CANN >= 8.5
    latest_is_cann = latest.exists() and cann.exists() and latest.resolve() == cann.resolve()
    places.append(("cann" if latest_is_cann else "ascend-toolkit", latest))
    places.append(("cann", cann))
    out = CannToolkit(latest=_shown(root, latest) if (root / ASCEND / "ascend-toolkit/latest").is_symlink() else "")
    seen: set[Path] = set()
    for layout, base in places:
        if base in seen:
            continue
        seen.add(base)
        info = base / info_name
        text = _read(info)
        if text is None:
            out.missing.append(_shown(root, info))
            continue
        kv = key_values(text)
        out.version = kv.get("version") or None
        out.path = _shown(root, info)
        out.layout = layout
        out.detail = kv.get("innerversion", "")
        break
    cfg = _read(latest / "version.cfg")
    if cfg is not None:
        out.version_cfg = version_cfg_version(cfg)
        if out.version is None and out.version_cfg:
            out.version, out.path, out.layout = out.version_cfg, _shown(root, latest / "version.cfg"), "ascend-toolkit"
    elif not latest_is_cann:
        out.missing.append(_shown(root, latest / "version.cfg"))
    return out


def _package_file(root: Path, rel: str, keys: tuple[str, ...], detail_key: str) -> VersionFile:
    path = root / rel
    text = _read(path)
    if text is None:
        return VersionFile(missing=[_shown(root, path)])
    kv = key_values(text)
    version = next((kv[k] for k in keys if kv.get(k)), None)
    return VersionFile(version=version, path=_shown(root, path), detail=kv.get(detail_key, ""))


def driver(root: Path | str = "/") -> VersionFile:
    """The NPU driver: `package_version` (the HDK release) before `Version`."""
    return _package_file(Path(root), f"{ASCEND}/driver/version.info", ("package_version", "Version"), "Innerversion")


def firmware(root: Path | str = "/") -> VersionFile:
    """The NPU firmware: its own `Version` (7.x), with the HDK `package_version` as detail."""
    return _package_file(Path(root), f"{ASCEND}/firmware/version.info", ("Version", "package_version"),
                         "package_version")


def npu_smi_version(text: str) -> str | None:
    """The version in `npu-smi info`'s header (`| npu-smi 24.1.0   Version: 24.1.0 |`)."""
    m = _NPU_SMI_HEADER.search(text)
    return m.group(2) if m else None


def npu_smi(root: Path | str = "/", run: bool = True) -> NpuSmi:
    """Where npu-smi is (the PATH first when the root is `/`) and, `run`: its version."""
    root = Path(root)
    found = shutil.which("npu-smi") if str(root) == "/" else None
    if not found:
        found = next((str(root / p) for p in NPU_SMI_PLACES if (root / p).exists()), None)
    if not found:
        return NpuSmi(error="no npu-smi on the PATH or in " + ", ".join("/" + p for p in NPU_SMI_PLACES))
    out = NpuSmi(path=_shown(root, Path(found)) if str(root) != "/" else found)
    if not run:
        return out
    try:
        proc = subprocess.run([found, "info"], capture_output=True, text=True, timeout=NPU_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        out.error = f"`npu-smi info` failed: {exc}"
        return out
    out.version = npu_smi_version(proc.stdout)
    if proc.returncode != 0 or out.version is None:
        first = (proc.stderr or proc.stdout).strip().splitlines()[:1]
        out.error = f"`npu-smi info` exited {proc.returncode}" + (f": {first[0][:200]}" if first else "")
    return out
