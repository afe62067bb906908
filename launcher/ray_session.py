"""Connecting to Ray: an embedded local cluster on 127.0.0.1, or an existing one.

An embedded cluster (empty `ray.address`) is the run's own, and:

- **listens on loopback only.** Ray binds its servers to the node IP it advertises, and
  loopback only when that IP is 127.0.0.1; but `ray.init(_node_ip_address="127.0.0.1")` turns
  127.0.0.1 into the host's address (`services.resolve_ip_for_localhost` →
  `get_node_ip_address`) unless Ray's "no cluster" mode is on, which Ray only turns on by
  itself on macOS and Windows (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`). The session turns that
  mode on (the variable for every Ray process it starts, and the driver's copy of the
  constant, read at import) and refuses to go on if the cluster still advertises another
  address.
- **has token authentication.** Ray 2.60 turns it on for a new local cluster unless
  `RAY_AUTH_MODE` says otherwise: a `RAY_AUTH_MODE` other than `token` in the user's
  environment is refused unless the config says `ray.allow_no_auth: true`, and the session
  checks the mode Ray actually runs with. The token is the run's own, in a 0600 file in a
  0700 folder of the run's (`RAY_AUTH_TOKEN_PATH`), which also holds Ray's temp dir (Ray
  makes that one 0777); Ray would otherwise write `~/.ray/auth_token` with the default
  umask (0644).
- **ends with the launcher.** A reaper process, in a session of its own, watches the
  launcher; if the launcher dies without ending the session (`kill -9`, OOM), it kills every
  process of the run — the descendants it saw, and every process that carries the run's
  tag (`MINDPULSE_RUN_TAG`: its Ray temp dir) in its environment or command line: Ray's
  DashboardAgent and RuntimeEnvAgent otherwise stay (they wait on the dead GCS), and
  msrun's workers run in sessions of their own — then removes the folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

from mindpulse.config import RunConfig
from mindpulse.lifetime.rank_processes import WORKER_ENV

from .preflight import LaunchRefused

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
RUN_TAG_ENV = "MINDPULSE_RUN_TAG"
"""Set (to the run's Ray temp dir, which Ray's processes also name in their command lines)
in the environment of every process of an embedded run."""
NO_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch for its single-machine mode: "0" keeps 127.0.0.1 as the node's address."""
AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
TOKEN_ENV = "RAY_AUTH_TOKEN"
EMBEDDED_SYSTEM_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
"""Ray's settings for the embedded cluster. No idle workers started ahead: every process a
run starts (aggregator, node agents, ranks) has its own runtime environment, which no
prestarted worker matches, so those only took CPU from the launch's start (-2.5 s to the
first step of the 2-rank default run on 2 cores) and memory for the run's length."""
RAY_START_TIMED_OUT = "The current node timed out during startup"
"""What `ray.init` raises when the new node's raylet has not registered with the GCS within the
30 s Ray waits (ray/_private/node.py, not configurable)."""
EMBEDDED_START_RETRIES = 1
"""Further starts of the embedded cluster after that timeout (a busy machine); none after others."""
LEAN_HEAD_SKIPS = ("start_api_server", "start_monitor", "start_log_monitor")
"""What the embedded cluster's head does not start (methods of Ray's `Node`). With
`include_dashboard=False` Ray still starts its API server with only its usage-stats module
(usage stats are off) and waits for it to register (~1.5-2 s of `ray.init` on 2 cores); its
autoscaler monitor has nothing to scale on a fixed local cluster and makes `ray.shutdown`
wait ~1 s for it; its log monitor forwards worker output to drivers, which the launcher
turns off (`log_to_driver=False`: ranks write their own logs). Measured together: `ray.init`
4.3-4.8 s -> 2.6-2.7 s, `ray.shutdown` 1.2-1.5 s -> 0.2-0.4 s, and ~3 s less CPU taken from
the ranks' start-up. Nothing of the run uses them (no job submission, state API or
autoscaling); a cluster given by `ray.address` is not touched."""
NO_DASHBOARD_ADDRESS = "127.0.0.1:1"
"""Registered as the dashboard's address when no API server started. Every node's
DashboardAgent (its event module) otherwise asks GCS for that address once a second for
as long as the run lasts, logging an error with its traceback each time (14 in 12 s, ~1 KB
a second into the session's dashboard_agent.log). Registered, it waits for Ray events
instead; posting one then fails at once (nothing listens on port 1), as it did against
the usage-stats-only API server, which does not serve /report_events."""
REAP_GRACE_S = 5.0
"""After a normal end, how long the reaper lets the run's last processes exit by themselves."""


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
    return host.strip("[]") in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


@contextlib.contextmanager
def lean_head() -> Iterator[list[str]]:
    """While a head node starts in this process, its `LEAN_HEAD_SKIPS` do nothing; yields the
    names actually skipped (none where this Ray's `Node` lacks them: it then starts as usual)."""
    try:
        from ray._private.node import Node
    except ImportError:
        yield []
        return
    saved = {name: Node.__dict__[name] for name in LEAN_HEAD_SKIPS if callable(Node.__dict__.get(name))}
    try:
        for name in saved:
            setattr(Node, name, _skipped(name))
        yield list(saved)
    finally:
        for name, fn in saved.items():
            setattr(Node, name, fn)


def _register_no_dashboard() -> None:
    """Give the embedded cluster's GCS `NO_DASHBOARD_ADDRESS` as the dashboard's address."""
    try:
        import ray._private.ray_constants as ray_constants
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(ray_constants.DASHBOARD_ADDRESS, NO_DASHBOARD_ADDRESS, overwrite=False,
                         namespace=ray_constants.KV_NAMESPACE_DASHBOARD)
    except Exception as exc:  # the run is unchanged; only the agent's log grows
        log.warning("embedded Ray cluster: could not register the dashboard placeholder (%s)", exc)


def _skipped(name: str) -> Callable[..., None]:
    def skip(self: Any, *args: Any, **kwargs: Any) -> None:
        log.debug("embedded Ray cluster: %s skipped", name)

    return skip


class RaySession:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.embedded = not cfg.ray.address
        self.address = ""
        self.temp_dir = ""
        """The embedded cluster's Ray temp dir (its processes name it in their command lines)."""
        self.private_dir = ""
        """The 0700 folder holding `temp_dir` (the run's tag) and the token."""
        self.token_path = ""
        self.auth = ""
        """The authentication mode the cluster runs with ("token" or "disabled"; "" unknown)."""
        self._saved_env: dict[str, str | None] = {}
        self._saved_no_cluster: Any = None
        self._reaper: subprocess.Popen | None = None
        self._reaper_pipe: int | None = None

    # ---- the environment the embedded cluster starts with ----------------------------------------
    def _setenv(self, key: str, value: str | None) -> None:
        self._saved_env.setdefault(key, os.environ.get(key))
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value

    def _restore_env(self) -> None:
        auth_changed = any(k in self._saved_env for k in (AUTH_MODE_ENV, TOKEN_PATH_ENV, TOKEN_ENV))
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}
        if auth_changed:  # this process's Ray config and token cache back to the environment's
            from ray._raylet import AuthenticationTokenLoader, Config

            Config.initialize("")
            AuthenticationTokenLoader.instance().reset_cache()
        if self._saved_no_cluster is not None:
            import ray._private.ray_constants as ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = self._saved_no_cluster
            self._saved_no_cluster = None

    def _bind_loopback(self) -> None:
        import ray._private.ray_constants as ray_constants

        self._setenv(NO_CLUSTER_ENV, "0")  # Ray's processes (raylet, agents, workers) read it at import
        self._saved_no_cluster = ray_constants.ENABLE_RAY_CLUSTER
        ray_constants.ENABLE_RAY_CLUSTER = False  # the driver imported Ray already

    def _setup_auth(self) -> None:
        """Token authentication on, with the run's own token, unless the config lets the
        environment turn it off."""
        from ray._raylet import AuthenticationTokenLoader, Config

        allow = bool(getattr(self.cfg.ray, "allow_no_auth", False))
        mode = os.environ.get(AUTH_MODE_ENV)
        if mode is not None and mode.strip().lower() != "token":
            if not allow:
                raise LaunchRefused(
                    f"{AUTH_MODE_ENV}={mode} in the environment would start the embedded Ray cluster without "
                    "token authentication (anyone who can reach its ports could run code as you). Unset "
                    f"{AUTH_MODE_ENV} (or set it to `token`), or set `ray.allow_no_auth: true` to run without it")
            log.warning("%s=%s: the embedded Ray cluster runs without token authentication (ray.allow_no_auth)",
                        AUTH_MODE_ENV, mode)
            return
        import secrets

        self.token_path = os.path.join(self.private_dir, "auth_token")
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32))  # as Ray's own generator: 256 bits
        os.chmod(self.token_path, 0o600)
        self._setenv(AUTH_MODE_ENV, "token")
        self._setenv(TOKEN_PATH_ENV, self.token_path)
        self._setenv(TOKEN_ENV, None)  # it would win over the file
        Config.initialize("")  # the driver's RayConfig read RAY_AUTH_MODE when Ray was imported
        AuthenticationTokenLoader.instance().reset_cache()

    def _check_started(self, ctx: Any) -> None:
        """Refuse a cluster that is not what `_bind_loopback` and `_setup_auth` asked for."""
        from ray._raylet import AuthenticationMode, get_authentication_mode

        info = getattr(ctx, "address_info", {}) or {}
        ip = info.get("node_ip_address", "")
        if ip != LOOPBACK or not _is_loopback(self.address):
            raise LaunchRefused(f"the embedded Ray cluster advertises {ip or '?'} ({self.address}), not {LOOPBACK}: "
                                "its servers would listen on that interface; refusing to run")
        self.auth = "token" if get_authentication_mode() == AuthenticationMode.TOKEN else "disabled"
        if self.auth != "token" and not getattr(self.cfg.ray, "allow_no_auth", False):
            raise LaunchRefused("the embedded Ray cluster started without token authentication; refusing to run "
                                "(set `ray.allow_no_auth: true` to allow it)")
        if self.token_path and os.stat(self.token_path).st_mode & 0o077:
            raise LaunchRefused(f"the Ray token file {self.token_path} is readable by others; refusing to run")

    # ---- the session ---------------------------------------------------------------------------------
    def __enter__(self) -> RaySession:
        import ray

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        kwargs: dict[str, Any] = dict(
            namespace=self.cfg.ray.namespace,
            logging_level=logging.WARNING,
            log_to_driver=False,
            runtime_env={"env_vars": dict(WORKER_ENV)},
        )
        if not self.embedded:
            ctx = ray.init(address=self.cfg.ray.address, **kwargs)
            self.address = getattr(ctx, "address_info", {}).get("address", "") or \
                ray.get_runtime_context().gcs_address
            return self
        # one CPU slot per rank plus headroom for agents; bound to loopback only; a temp dir of
        # its own (0700) so this run's Ray processes can be told from anyone else's
        import tempfile

        # Ray makes its temp dir (and its session, sockets and logs folders) 0777: it lives in
        # a 0700 folder of the run's own, which also holds the token
        self.private_dir = tempfile.mkdtemp(prefix="mindpulse-ray-", dir="/tmp")
        self.temp_dir = os.path.join(self.private_dir, "ray")
        try:
            self._start_reaper()
            self._setenv(RUN_TAG_ENV, self.temp_dir)
            self._bind_loopback()
            self._setup_auth()
            with lean_head() as skipped:
                ctx = self._init_embedded(ray, kwargs)
            if "start_api_server" in skipped:
                _register_no_dashboard()
            self.address = getattr(ctx, "address_info", {}).get("address", "") or \
                ray.get_runtime_context().gcs_address
            self._check_started(ctx)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _init_embedded(self, ray: Any, kwargs: dict[str, Any]) -> Any:
        """`ray.init` of the embedded cluster, once more when Ray gave up waiting for its raylet to
        register: Ray waits a fixed 30 s, which a busy machine (the launcher's own, starting ranks
        or other jobs) can exceed with nothing broken. The first try's processes are stopped
        before the second; any other failure, or a second timeout, is raised."""
        def start() -> Any:
            return ray.init(num_cpus=self.cfg.world.world_size + 1, include_dashboard=False,
                            _node_ip_address=LOOPBACK, _temp_dir=self.temp_dir,
                            _system_config=EMBEDDED_SYSTEM_CONFIG, **kwargs)

        for _ in range(EMBEDDED_START_RETRIES):
            try:
                return start()
            except Exception as exc:
                if RAY_START_TIMED_OUT not in str(exc):
                    raise
                log.warning("the embedded Ray cluster's raylet did not register within Ray's 30 s (a busy "
                            "machine?): its processes stopped, starting it again")
                kill_run(self.temp_dir, {})
        return start()

    def __exit__(self, *exc: Any) -> None:
        import ray

        try:
            if ray.is_initialized():
                ray.shutdown()
        finally:
            if self.private_dir:
                import shutil

                shutil.rmtree(self.private_dir, ignore_errors=True)
            self._restore_env()
            self._stop_reaper()

    # ---- the reaper -------------------------------------------------------------------------------------
    def _start_reaper(self) -> None:
        import psutil

        me = psutil.Process()
        read_end, self._reaper_pipe = os.pipe()  # both ends close-on-exec: only the reaper gets one
        env = {k: v for k, v in os.environ.items() if k != RUN_TAG_ENV}
        try:
            self._reaper = subprocess.Popen(
                [sys.executable, "-m", "mindpulse.launcher.ray_session", "--reap", str(me.pid),
                 repr(me.create_time()), self.temp_dir],
                stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                start_new_session=True)  # not in the launcher's process group: a Ctrl-C is not for it
        finally:
            os.close(read_end)

    def _stop_reaper(self) -> None:
        """The session ended by itself: the reaper only sweeps what outlives it."""
        if self._reaper_pipe is not None:
            try:
                os.write(self._reaper_pipe, b"done\n")
            except OSError:
                pass
            os.close(self._reaper_pipe)
            self._reaper_pipe = None
        self._reaper = None  # it exits by itself; not waited for (it may give stragglers a few seconds)


# ---- the reaper process -------------------------------------------------------------------------------
def run_processes(tag: str, tracked: dict[int, float]) -> dict[int, float]:
    """pid → create time of every live process of the run tagged `tag` (in its environment
    or command line), and of the `tracked` ones still alive (the same process, not a reuse)."""
    import psutil

    me = os.getpid()
    found: dict[int, float] = {}
    for p in psutil.process_iter(["pid", "cmdline", "create_time", "status"]):
        try:
            if p.pid == me or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            ct = p.info["create_time"]
            if p.pid in tracked and abs(tracked[p.pid] - ct) < 1.0:
                found[p.pid] = ct
                continue
            if tag in " ".join(p.info["cmdline"] or []):
                found[p.pid] = ct
                continue
            if p.environ().get(RUN_TAG_ENV) == tag:
                found[p.pid] = ct
        except (psutil.Error, OSError):
            continue
    return found


def kill_run(tag: str, tracked: dict[int, float], rounds: int = 4) -> list[int]:
    """SIGKILL every process of the run until none is left (a dying raylet may still start
    one: the run's processes are looked for again after each round). No SIGTERM first: the
    launcher is gone, or its run ended and these are stragglers."""
    import time

    from mindpulse.lifetime.processes import end_processes

    killed: list[int] = []
    for _ in range(rounds):
        targets = run_processes(tag, tracked)
        if not targets:
            break
        killed += end_processes(targets)
        time.sleep(0.3)
    return killed


def reap(launcher_pid: int, launcher_ct: float, tag: str, poll_s: float = 1.0) -> int:
    """Watch the launcher (its pipe on stdin, and its pid); when it dies without saying
    "done", kill the run's processes and remove its temp dir. After "done", sweep only what
    is still there a few seconds later."""
    import select
    import shutil
    import time

    from mindpulse.lifetime.process_identity import process_alive
    from mindpulse.lifetime.processes import descendants

    tracked: dict[int, float] = {}
    done = False
    while process_alive(launcher_pid, launcher_ct):
        # what the launcher started, while it can still be told: orphans lose the link
        for pid, ct in descendants(launcher_pid).items():
            tracked.setdefault(pid, ct)
        ready, _, _ = select.select([0], [], [], poll_s)
        if ready:
            data = os.read(0, 64)
            if data.startswith(b"done"):
                done = True
                break
            if not data:  # EOF without "done": the launcher is gone
                break
    if done:
        deadline = time.time() + REAP_GRACE_S
        while time.time() < deadline and run_processes(tag, {}):
            time.sleep(0.2)
        kill_run(tag, {})
        return 0
    kill_run(tag, tracked)
    folder = os.path.dirname(tag)  # the run's private folder: the Ray temp dir and the token
    if os.path.basename(folder).startswith("mindpulse-ray-"):
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "--reap":
        return reap(int(argv[1]), float(argv[2]), argv[3])
    print("usage: python -m mindpulse.launcher.ray_session --reap LAUNCHER_PID CREATE_TIME TAG", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
