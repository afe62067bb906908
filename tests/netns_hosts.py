"""A test bed of hosts on one machine: each host is a network namespace with its own address
on a shared bridge, its own host name and its own mount namespace (private /tmp/ray and
/dev/shm, as on a real machine, and optionally private folders, for a filesystem the hosts
do not share).

    bridge <tag>br ── veth <tag>h0 ══ eth0 198.18.0.1 (host "<tag>-head")
                   ── veth <tag>h1 ══ eth0 198.18.0.2 (host "<tag>-w1")
                   ...

Each host has one keeper process (`sleep infinity`) that holds its namespaces: commands run
in a host through `nsenter` into the keeper's network, host name and mount namespaces.
"Killing a host" kills every process of its network namespace but the keeper (the machine
stays, its processes are gone, as when a host's kernel panics and the switch port stays up);
"taking its link down" sets the bridge side of its veth down.

`Testbed.create` undoes what it did when a step fails, and `Testbed.teardown` removes
everything (processes, namespaces, bridge), whatever state a test left it in; use the
context manager. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN): `can_create_namespaces` says
whether this machine can, and why not.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "198.18.0"
"""The hosts' /24, in 198.18.0.0/15 (RFC 2544's benchmarking range, never routed)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def can_create_namespaces() -> str | None:
    """None when this machine can create the test bed; else why not (a skip reason)."""
    if os.geteuid() != 0:
        return "the multi-host test bed needs root (network and mount namespaces)"
    for tool in ("ip", "nsenter", "unshare"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode:
            return f"the multi-host test bed needs `{tool}` (apt-get install iproute2 util-linux)"
    name = f"mpprobe{uuid.uuid4().hex[:6]}"
    res = _ip("netns", "add", name, check=False)
    if res.returncode:
        return f"this machine cannot create network namespaces: {res.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


@dataclass
class Host:
    name: str
    """Its host name (what `hostname` and Ray's node table say)."""
    address: str
    netns: str
    veth: str
    """The bridge side of its link."""
    keeper: subprocess.Popen | None = None
    private: list[str] = field(default_factory=list)
    """Folders only this host sees (a tmpfs over each, in its mount namespace)."""
    procs: list[subprocess.Popen] = field(default_factory=list)


class Testbed:
    __test__ = False  # a helper, not a test class

    def __init__(self, count: int, *, names: Sequence[str] | None = None,
                 private: dict[int, list[str]] | None = None):
        """`count` hosts; host 0 is the head. `private`: host index → folders that host
        alone sees (created empty)."""
        self.tag = f"mp{uuid.uuid4().hex[:5]}"
        self.bridge = f"{self.tag}br"
        names = list(names or [f"{self.tag}-{'head' if i == 0 else f'w{i}'}" for i in range(count)])
        self.hosts = [Host(name=names[i], address=f"{SUBNET}.{i + 1}", netns=f"{self.tag}n{i}",
                           veth=f"{self.tag}h{i}", private=list((private or {}).get(i, [])))
                      for i in range(count)]
        self._left_running: list[str] = []
        """Processes still in a host's namespace when teardown deleted it (`leftovers`)."""

    # ---- life ---------------------------------------------------------------------------------
    def __enter__(self) -> Testbed:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def create(self) -> None:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for h in self.hosts:
                _ip("netns", "add", h.netns)
                _ip("link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
                _ip("link", "set", h.veth, "master", self.bridge)
                _ip("link", "set", h.veth, "up")
                _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
                _ip("-n", h.netns, "link", "set", "eth0", "up")
                _ip("-n", h.netns, "link", "set", "lo", "up")
                self._start_keeper(h)
        except BaseException:
            self.teardown()
            raise

    def _start_keeper(self, h: Host) -> None:
        mounts = " && ".join(f"mkdir -p {shlex.quote(d)} && mount -t tmpfs tmpfs {shlex.quote(d)}"
                             for d in ["/tmp/ray", "/dev/shm", *h.private])
        script = f"hostname {shlex.quote(h.name)} && {mounts} && echo ready && exec sleep infinity"
        h.keeper = subprocess.Popen(
            ["ip", "netns", "exec", h.netns, "unshare", "--uts", "--mount", "--propagation", "private",
             "sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = h.keeper.stdout.readline() if h.keeper.stdout else ""
        if line.strip() != "ready":
            err = h.keeper.stderr.read() if h.keeper.stderr else ""
            raise RuntimeError(f"host {h.name}: its namespaces could not be made: {err.strip()}")

    def teardown(self) -> None:
        """Every process of every host, the namespaces, the bridge; never raises."""
        for h in self.hosts:
            try:
                self.kill_host(h, keeper=True)
            except Exception:  # the namespaces go below all the same; leftovers() tells what stayed
                pass
        for h in self.hosts:
            for p in h.procs:
                if p.poll() is None:  # never entered the host (a spawn that timed out): its own session
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            for p in h.procs + ([h.keeper] if h.keeper else []):
                try:
                    p.wait(timeout=5)
                except Exception:  # a process that does not go is reported by the leftovers check
                    pass
            deadline = time.monotonic() + 3  # a process killed a moment ago may still be exiting
            while (left := self.pids(h)) and time.monotonic() < deadline:
                time.sleep(0.1)
            self._left_running += [f"pid {pid} on {h.name}" for pid in left]
            _ip("netns", "del", h.netns, check=False)
            _ip("link", "del", h.veth, check=False)
        _ip("link", "del", self.bridge, check=False)

    def leftovers(self) -> list[str]:
        """What teardown should have removed and did not (processes still in a host's namespace
        when it was deleted, namespaces, links)."""
        left = list(self._left_running)
        left += [n for n in _ip("netns", "list", check=False).stdout.split() if n.startswith(self.tag)]
        links = _ip("-o", "link", "show", check=False).stdout
        left += [f"link {w}" for w in links.replace("@", ":").split(":") if w.strip().startswith(self.tag)]
        return left

    # ---- inside a host ------------------------------------------------------------------------
    def host(self, which: int | str | Host) -> Host:
        if isinstance(which, Host):
            return which
        if isinstance(which, int):
            return self.hosts[which]
        return next(h for h in self.hosts if h.name == which)

    def _enter(self, h: Host) -> list[str]:
        assert h.keeper is not None, f"host {h.name} has no namespaces"
        return ["nsenter", "-t", str(h.keeper.pid), "-n", "-u", "-m", "--"]

    def run(self, which: int | str, cmd: Sequence[str], *, env: dict[str, str] | None = None,
            timeout: float = 120, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        """Run `cmd` on a host and wait for it (its output captured)."""
        h = self.host(which)
        return subprocess.run([*self._enter(h), *cmd], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})}, cwd=cwd)

    def spawn(self, which: int | str, cmd: Sequence[str], *, env: dict[str, str] | None = None,
              stdout: object = subprocess.PIPE, cwd: str | Path | None = None) -> subprocess.Popen:
        """Start `cmd` on a host without waiting (killed with the host or at teardown)."""
        h = self.host(which)
        p = subprocess.Popen([*self._enter(h), *cmd], env={**os.environ, **(env or {})}, stdout=stdout,
                             stderr=subprocess.STDOUT, text=True, cwd=cwd, start_new_session=True)
        h.procs.append(p)
        # back only once it is on the host: killed with the host even when the machine is so
        # busy that entering its namespaces takes longer than the kill's passes
        deadline = time.monotonic() + 10
        while p.poll() is None and p.pid not in self.pids(h) and time.monotonic() < deadline:
            time.sleep(0.01)
        return p

    def pids(self, which: int | str | Host) -> list[int]:
        """Every process in a host's network namespace."""
        h = self.host(which)
        out = _ip("netns", "pids", h.netns, check=False).stdout
        return [int(x) for x in out.split()]

    def kill_host(self, which: int | str | Host, *, keeper: bool = False) -> list[int]:
        """SIGKILL every process of a host at once (its keeper too with `keeper`); returns the pids."""
        h = self.host(which)
        killed = []
        for _ in range(3):  # processes forked while the first pass ran are caught by the next
            signalled = self._signal(h, signal.SIGKILL, keeper=keeper)
            killed += signalled
            if not signalled:
                break
            time.sleep(0.1)
        if keeper and h.keeper is not None:
            try:
                h.keeper.kill()
            except ProcessLookupError:
                pass
        return killed

    def _processes(self, h: Host, *, keeper: bool = False) -> list[int]:
        """A host's processes but this one, and but its keeper unless `keeper`."""
        keep = {h.keeper.pid} if h.keeper is not None and not keeper else set()
        return [p for p in self.pids(h) if p not in keep and p != os.getpid()]

    def _signal(self, h: Host, sig: int, *, keeper: bool = False) -> list[int]:
        """Send `sig` to a host's processes (`_processes`); the pids it reached."""
        sent = []
        for pid in self._processes(h, keeper=keeper):
            try:
                os.kill(pid, sig)
                sent.append(pid)
            except ProcessLookupError:
                pass
        return sent

    def link(self, which: int | str, up: bool) -> None:
        """Take a host's link down (its cable pulled) or up again."""
        _ip("link", "set", self.host(which).veth, "up" if up else "down")

    # ---- Ray, as the README tells a user ------------------------------------------------------
    def ray_env(self, token_path: Path) -> dict[str, str]:
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}

    def start_ray(self, ray_bin: str, token_path: Path, *, resources: dict[int, int] | None = None,
                  port: int = 6379, timeout: float = 90, count: int | None = None) -> None:
        """`ray start --head --node-ip-address=HEAD_IP --port=6379` on host 0, then
        `ray start --address=HEAD_IP:6379 --node-ip-address=THIS_IP` on every other host (the
        first `count` hosts only, where given; `--num-cpus` from `resources`, host index →
        CPUs)."""
        head = self.hosts[0]
        for i, h in enumerate(self.hosts[:count]):
            cmd = [ray_bin, "start", f"--node-ip-address={h.address}", "--disable-usage-stats"]
            cmd += ["--head", f"--port={port}", "--include-dashboard=false"] if i == 0 else \
                [f"--address={head.address}:{port}"]
            if resources and i in resources:
                cmd.append(f"--num-cpus={resources[i]}")
            res = self.run(i, cmd, env=self.ray_env(token_path), timeout=timeout)
            if res.returncode:
                raise RuntimeError(f"ray start on {h.name} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")

    def stop_ray(self, grace_s: float = 10.0) -> None:
        """Stop Ray on every host: SIGTERM to every process of each host (worker hosts first),
        then up to `grace_s` for them to end (teardown kills what is left). Not `ray stop`:
        it ends every Ray process of the machine (the hosts share one process namespace),
        a Ray cluster of the user's or of another test included."""
        for h in reversed(self.hosts):
            self._signal(h, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not any(self._processes(h) for h in self.hosts):
                return
            time.sleep(0.2)
