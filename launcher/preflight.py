"""Checks before anything starts: is the hardware the config asks for there?

On a machine or cluster without it, `launch` stops with exit code 2 and says what is
missing (no `npu-smi`, no `NPU` resource in the Ray cluster, too few nodes), instead of
starting ranks that would fail one by one.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import sys
from typing import Any

from mindpulse.common.errors import MindpulseError
from mindpulse.config import Backend, Device, RunConfig


class LaunchRefused(MindpulseError, RuntimeError):
    """The cluster cannot run this config; nothing was started (exit code 2)."""


def _has_ascend_tools() -> str | None:
    """None when this machine has the Ascend driver tools; else what is missing."""
    import os

    if shutil.which("npu-smi") or any(os.path.exists(p) for p in (
            "/usr/local/sbin/npu-smi", "/usr/local/Ascend/driver/lib64/driver/libdcmi.so")):
        return None
    return "this machine has no `npu-smi` (and no libdcmi.so): the Ascend driver is not installed"


def check_exporter_port(cfg: RunConfig) -> None:
    """The Prometheus endpoint's port must be free on this machine (the aggregator runs here,
    pinned to the driver's node): refused now, naming the key, rather than found taken later."""
    prom = cfg.exporters.prometheus
    if not prom.port:
        return
    family = socket.AF_INET6 if ":" in prom.address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the endpoint binds: TIME_WAIT is no owner
        try:
            s.bind((prom.address, prom.port))
        except OSError as exc:
            raise LaunchRefused(f"exporters.prometheus.port: {prom.address}:{prom.port} cannot be served here "
                                f"({exc.strerror or exc}); choose a free port (or 0: no endpoint)") from None


def _installed(module: str) -> bool:
    """Whether `module` can be imported here, without importing it (a tracker's import takes seconds)."""
    if module in sys.modules:
        return sys.modules[module] is not None  # None: imports of it are refused
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken: not importable
        return False


def check_trackers(cfg: RunConfig) -> None:
    """The packages of the trackers the config turns on must be installed here (the aggregator
    runs here, pinned to the driver's node): refused now, naming the extra to install, rather
    than a run without the tracker its user asked for."""
    needs: list[tuple[str, str, str, str]] = []  # (what is on, module, what to install, how to turn it off)
    if cfg.sinks.mlflow.enabled:
        needs.append(("sinks.mlflow.enabled", "mlflow", "'mindpulse[mlflow]'", "sinks.mlflow.enabled=false"))
    if cfg.sinks.swanlab.enabled:
        needs.append(("sinks.swanlab.enabled", "swanlab", "'mindpulse[swanlab]'", "sinks.swanlab.enabled=false"))
        if cfg.sinks.swanlab.mode.value == "local":  # SwanLab's local mode refuses to start without its dashboard
            needs.append(("sinks.swanlab.mode local", "swanboard", "'swanlab[dashboard]'",
                          "sinks.swanlab.mode=offline"))
    for key, module, install, off in needs:
        if not _installed(module):
            raise LaunchRefused(f"{key} is on but the {module} package is not installed here: "
                                f"pip install {install} (or --set {off})")


RAY_PROBE_TIMEOUT_S = 5.0
"""How long the launch waits for the Ray head named by `ray.address` to take a connection
(ray.init itself retries an address where nothing answers for minutes)."""


def check_ray_address(cfg: RunConfig, timeout_s: float = RAY_PROBE_TIMEOUT_S) -> None:
    """The Ray head `ray.address` names must take a TCP connection, at the address Ray itself
    would dial (`auto` read from the environment, loopback turned into this host's address)."""
    addr = cfg.ray.address
    if not addr or addr == "local" or addr.startswith("ray://"):
        return
    try:
        from ray._private.services import canonicalize_bootstrap_address

        target = canonicalize_bootstrap_address(addr)
    except ConnectionError as exc:  # `auto` and no cluster found on this machine
        raise LaunchRefused(f"ray.address: {addr!r}: {exc}; start the cluster (`ray start --head`) or leave "
                            "ray.address empty (an embedded one-machine cluster)") from None
    except Exception:  # Ray's own resolution moved or failed: ray.init will say what is wrong
        return
    if not target:
        return
    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise LaunchRefused(f"ray.address: nothing answers at {target} ({addr!r} as Ray resolves it: {why}); "
                            "start the cluster (`ray start --head`), fix the address, or leave ray.address "
                            "empty (an embedded one-machine cluster)") from None


def check_master_addr(cfg: RunConfig) -> None:
    """`msrun.master_addr` must resolve (checked here, on the head; every node dials it): else
    the other nodes' ranks wait `msrun.cluster_time_out` seconds for a scheduler they cannot find."""
    addr = cfg.msrun.master_addr
    if not addr or cfg.backend is not Backend.MSRUN or cfg.world.nodes < 2:
        return
    try:
        socket.getaddrinfo(addr, None)
    except (OSError, UnicodeError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise LaunchRefused(f"msrun.master_addr: {addr!r} does not resolve here ({why}); give node 0's IP "
                            "address, or leave it empty (node 0's address as Ray sees it)") from None


def check_local(cfg: RunConfig) -> None:
    """Checks of the driver's own machine, for an embedded local cluster."""
    check_exporter_port(cfg)
    check_trackers(cfg)
    if cfg.ray.address:
        check_master_addr(cfg)
        check_ray_address(cfg)
        return
    if cfg.world.device is Device.ASCEND:
        missing = _has_ascend_tools()
        if missing:
            raise LaunchRefused(f"world.device is ascend but {missing}. Run on an Ascend host, "
                                "or use world.device=cpu (e.g. --set world.device=cpu) to try the job here.")
    if cfg.world.device is Device.GPU and not shutil.which("nvidia-smi"):
        raise LaunchRefused("world.device is gpu but this machine has no `nvidia-smi` (no NVIDIA driver). "
                            "Use world.device=cpu to try the job here.")
    if cfg.world.nodes > 1:
        raise LaunchRefused(f"world.nodes is {cfg.world.nodes} but ray.address is empty (an embedded one-machine "
                            "cluster). Start a Ray cluster and set ray.address (see README, multi-node).")


def check_cluster(cfg: RunConfig, resources: dict[str, Any], nodes: list[dict[str, Any]]) -> None:
    """Checks of the Ray cluster: enough nodes, each with enough of the device resource."""
    w = cfg.world
    key = {"cpu": "CPU", "ascend": "NPU", "gpu": "GPU"}[w.device.value]
    have = float(resources.get(key, 0))
    if have < w.world_size:
        raise LaunchRefused(f"the Ray cluster has {have:g} {key} in all; the config needs {w.world_size} "
                            f"({w.nodes} node(s) x {w.ranks_per_node}). "
                            + ("No NPU resource: start Ray on the Ascend hosts (Ray detects NPUs itself) "
                               "or pass --resources='{\"NPU\": 8}'." if key == "NPU" else ""))
    fitting = [n for n in nodes if float(n.get("Resources", {}).get(key, 0)) >= w.ranks_per_node]
    if len(fitting) < w.nodes:
        raise LaunchRefused(f"the config needs {w.nodes} node(s) with {w.ranks_per_node} {key} each; the Ray "
                            f"cluster has {len(fitting)} such node(s) of {len(nodes)}")
