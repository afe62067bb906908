"""Does every host of the job see the run directory the driver sees?

Ranks on other hosts write their logs, and rank 0 its checkpoints, under the same path on
their own host. When `output.root` is not on a filesystem every host shares, the driver
would list in the manifest files it does not have. So at each attempt's start every node
agent writes a marker file with a token into the run directory, on its own host, and the
driver reads them: a host whose marker the driver cannot read does not share the folder.
The markers are removed once read. Then a warning names those hosts, or, with
`checkpoint.require_shared: true`, the launch is refused (exit 2).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mindpulse.config import RunConfig

from .preflight import LaunchRefused

MARKER_DIR = ".hosts"
MARKER_TIMEOUT_S = 30


def marker_path(run_dir: Path, node: int) -> Path:
    return run_dir / MARKER_DIR / f"node{node}.marker"


def unshared_hosts(run_dir: Path, infos: list[dict[str, Any]], token: str,
                   written: list[dict[str, Any] | BaseException]) -> list[dict[str, Any]]:
    """The nodes whose marker (written on their own host: `written`, one answer per node)
    the driver cannot read with `token`: {node, host, ip, why}."""
    out = []
    for info, answer in zip(infos, written):
        node = int(info["node"])
        if isinstance(answer, BaseException) or answer.get("error"):
            why = f"its agent could not write there: {answer if isinstance(answer, BaseException) else answer['error']}"
        else:
            try:
                seen = marker_path(run_dir, node).read_text()
            except OSError:
                seen = None
            if seen == token:
                continue
            why = "its marker is not visible here" if seen is None else "a different folder holds its marker"
        out.append({"node": node, "host": info.get("host", "?"), "ip": info.get("ip", "?"), "why": why})
    return out


def describe(hosts: list[dict[str, Any]], run_dir: Path) -> str:
    names = ", ".join(f"node {h['node']} ({h['host']}, {h['ip']}: {h['why']})" for h in hosts)
    return (f"the run directory {run_dir} is not shared with {names}: their ranks' logs, and rank 0's "
            "checkpoints when rank 0 is among them, are written on those hosts, where the driver cannot read "
            "them; put output.root on a filesystem every host mounts at the same path")


def check_shared_output(cfg: RunConfig, run_dir: Path, agents: list[Any], infos: list[dict[str, Any]],
                        say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every agent writes its marker, the driver reads them; returns the hosts that do not share
    the run directory (said as a warning), or refuses the launch when
    `checkpoint.require_shared` is true."""
    import ray

    token = secrets.token_hex(8)
    refs = [a.write_marker.remote(str(marker_path(run_dir, int(i["node"]))), token) for a, i in zip(agents, infos)]
    written: list[dict[str, Any] | BaseException] = []
    for ref in refs:
        try:
            written.append(ray.get(ref, timeout=MARKER_TIMEOUT_S))
        except Exception as exc:  # the answer names the failure; that host counts as not sharing
            written.append(exc)
    hosts = unshared_hosts(run_dir, infos, token, written)
    for a, i in zip(agents, infos):
        try:
            a.remove_marker.remote(str(marker_path(run_dir, int(i["node"]))))
        except Exception:  # a marker left behind is a small file in the run directory, nothing more
            pass
    if hosts and cfg.checkpoint.require_shared:
        raise LaunchRefused(describe(hosts, run_dir) + " (checkpoint.require_shared: true)")
    if hosts:
        say(f"mindpulse: WARNING {describe(hosts, run_dir)} (checkpoint.require_shared: true refuses such a launch)")
    return hosts
