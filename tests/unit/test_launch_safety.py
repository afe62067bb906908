"""What a launch exposes and what it trusts, without a cluster: the embedded Ray cluster's
address and authentication (Ray's own code paths, `ray.init` replaced), the rank actors'
options (Ray's own option checks), the run directory's permissions, what reaches the
terminal, and the signal named in a failure block."""

from __future__ import annotations

import io
import os
import stat
import threading
from pathlib import Path

import pytest

from mindpulse.config import from_dict
from mindpulse.launcher import ray_session as rs
from mindpulse.launcher.preflight import LaunchRefused
from mindpulse.launcher.spec import RankOutcome, rank_specs


class InitCalled(Exception):
    """Raised by the stand-in for `ray.init`: the session got as far as starting Ray."""


@pytest.fixture
def fake_init(monkeypatch):
    """Replace `ray.init` with a probe of what Ray would start with (the environment and the
    address Ray's own code resolves 127.0.0.1 to), then stop there."""
    import ray

    seen: dict = {}

    def init(**kwargs):
        import ray._private.services as services
        from ray._raylet import AuthenticationMode, get_authentication_mode

        seen["kwargs"] = kwargs
        seen["env"] = dict(os.environ)
        seen["resolved"] = services.resolve_ip_for_localhost(kwargs.get("_node_ip_address", "127.0.0.1"))
        seen["auth_token"] = get_authentication_mode() == AuthenticationMode.TOKEN
        tp = os.environ.get("RAY_AUTH_TOKEN_PATH")
        seen["token_mode"] = stat.S_IMODE(os.stat(tp).st_mode) if tp and os.path.exists(tp) else None
        seen["folder_mode"] = stat.S_IMODE(os.stat(os.path.dirname(tp)).st_mode) if tp else None
        raise InitCalled()

    monkeypatch.setattr(ray, "init", init)
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", rs.RUN_TAG_ENV, rs.NO_CLUSTER_ENV):
        monkeypatch.delenv(k, raising=False)
    return seen


def _enter(cfg):
    session = rs.RaySession(cfg)
    with pytest.raises((InitCalled, LaunchRefused)) as info:
        session.__enter__()
    return session, info.value


# ---- 10: loopback only ------------------------------------------------------------------------------
def test_the_embedded_cluster_keeps_127_0_0_1_as_its_address(fake_init):
    """Ray turns a requested 127.0.0.1 into the host's address (and then binds every server
    there) unless its single-machine mode is on: the session turns it on for its cluster."""
    import ray._private.ray_constants as ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    session, exc = _enter(from_dict({}))
    assert isinstance(exc, InitCalled), exc
    assert fake_init["kwargs"]["_node_ip_address"] == "127.0.0.1"
    assert fake_init["resolved"] == "127.0.0.1", "Ray would advertise (and bind) the host's address"
    assert fake_init["env"][rs.NO_CLUSTER_ENV] == "0", "Ray's own processes must keep 127.0.0.1 too"
    assert fake_init["env"][rs.RUN_TAG_ENV] == session.temp_dir == fake_init["kwargs"]["_temp_dir"]
    assert session.temp_dir.startswith(session.private_dir + "/")
    # everything is put back, the temp folder is gone
    assert ray_constants.ENABLE_RAY_CLUSTER == before
    assert rs.NO_CLUSTER_ENV not in os.environ and rs.RUN_TAG_ENV not in os.environ
    assert not os.path.exists(session.private_dir)


def test_the_embedded_head_skips_the_api_server_and_monitors_only_while_ray_starts(fake_init, monkeypatch):
    """ray.init runs with Node's API server, autoscaler monitor and log monitor as no-ops (the
    live run checks none of them runs), and Node is whole again afterwards, even when the
    init fails; a cluster given by address is joined as it is."""
    from ray._private.node import Node

    originals = {name: Node.__dict__[name] for name in rs.LEAN_HEAD_SKIPS}
    import ray

    during: dict = {}

    def init(**kwargs):
        during.update({name: Node.__dict__[name] for name in rs.LEAN_HEAD_SKIPS})
        raise InitCalled()

    monkeypatch.setattr(ray, "init", init)
    _enter(from_dict({}))
    assert set(during) == set(rs.LEAN_HEAD_SKIPS), "this Ray's Node lacks a method the session skips"
    assert all(during[n] is not originals[n] for n in during), "ray.init ran with the head's full set of processes"
    assert all(Node.__dict__[n] is originals[n] for n in originals), "Node was not put back after ray.init"
    during.clear()
    _enter(from_dict({"ray": {"address": "10.0.0.1:6379"}}))
    assert all(during[n] is originals[n] for n in during), "a cluster given by address was changed"


def test_a_cluster_advertising_another_address_is_refused():
    session = rs.RaySession(from_dict({}))
    session.address = "192.0.2.2:6379"

    class Ctx:
        address_info = {"node_ip_address": "192.0.2.2", "address": "192.0.2.2:6379"}

    with pytest.raises(LaunchRefused, match="192.0.2.2"):
        session._check_started(Ctx())


def test_local_ranks_and_the_scheduler_bind_loopback():
    from mindpulse.launcher.worker_group import loopback_env, msrun_env

    assert loopback_env("127.0.0.1") == {"MS_WORKER_IP": "127.0.0.1"}
    assert loopback_env("10.0.0.5") == {}
    cfg = from_dict({"backend": "msrun"})
    spec = rank_specs(cfg, sched_host="127.0.0.1", sched_port=4000)[0]
    assert msrun_env(cfg, spec)["MS_WORKER_IP"] == "127.0.0.1"
    # the user's own choice wins
    cfg = from_dict({"backend": "msrun", "env": {"MS_WORKER_IP": "10.1.1.1"}})
    spec = rank_specs(cfg, sched_host="127.0.0.1", sched_port=4000)[0]
    assert msrun_env(cfg, spec)["MS_WORKER_IP"] == "10.1.1.1"


# ---- 12: token authentication ------------------------------------------------------------------------
def test_ray_auth_mode_disabled_in_the_environment_is_refused(fake_init, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    session, exc = _enter(from_dict({}))
    assert isinstance(exc, LaunchRefused) and "RAY_AUTH_MODE=disabled" in str(exc)
    assert "ray.allow_no_auth" in str(exc)
    assert "kwargs" not in fake_init, "Ray was started anyway"
    assert os.environ["RAY_AUTH_MODE"] == "disabled" and not os.path.exists(session.private_dir)


def test_allow_no_auth_lets_the_environment_turn_it_off(fake_init, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    _, exc = _enter(from_dict({"ray": {"allow_no_auth": True}}))
    assert isinstance(exc, InitCalled)
    assert fake_init["env"]["RAY_AUTH_MODE"] == "disabled" and not fake_init["auth_token"]


def test_the_cluster_gets_token_auth_and_a_private_token_of_its_own(fake_init, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "the-users-token")
    home = Path.home() / ".ray" / "auth_token"
    home_before = home.stat().st_mtime if home.exists() else None
    session, exc = _enter(from_dict({}))
    assert isinstance(exc, InitCalled)
    env = fake_init["env"]
    assert env["RAY_AUTH_MODE"] == "token" and fake_init["auth_token"], "token mode not in effect for Ray"
    assert env["RAY_AUTH_TOKEN_PATH"].startswith(session.private_dir) and "RAY_AUTH_TOKEN" not in env
    assert fake_init["token_mode"] == 0o600 and fake_init["folder_mode"] == 0o700
    assert (home.stat().st_mtime if home.exists() else None) == home_before, "~/.ray/auth_token was written"
    assert os.environ["RAY_AUTH_TOKEN"] == "the-users-token" and "RAY_AUTH_MODE" not in os.environ


def test_a_cluster_that_started_without_token_auth_is_refused(monkeypatch):
    import ray._raylet as raylet

    monkeypatch.setattr(raylet, "get_authentication_mode", lambda: raylet.AuthenticationMode.DISABLED)
    session = rs.RaySession(from_dict({}))
    session.address = "127.0.0.1:6379"

    class Ctx:
        address_info = {"node_ip_address": "127.0.0.1", "address": "127.0.0.1:6379"}

    with pytest.raises(LaunchRefused, match="without token authentication"):
        session._check_started(Ctx())
    allowed = rs.RaySession(from_dict({"ray": {"allow_no_auth": True}}))
    allowed.address = "127.0.0.1:6379"
    allowed._check_started(Ctx())
    assert allowed.auth == "disabled"


# ---- 24: the rank actors' options, as Ray checks them -----------------------------------------------
@pytest.mark.parametrize("device", ["cpu", "gpu", "ascend"])
def test_rank_actor_options_pass_rays_own_checks(device):
    from ray._common.ray_option_utils import validate_actor_options
    from ray.util.placement_group import validate_placement_group

    from mindpulse.launcher.node_agents import placement_bundles
    from mindpulse.launcher.worker_group import rank_actor_options

    cfg = from_dict({"world": {"device": device, "nodes": 2, "ranks_per_node": 2}})
    spec = rank_specs(cfg)[3]
    opts = rank_actor_options(cfg, spec, dict(spec.env), name="r-rank-3")
    validate_actor_options(opts, in_options=True)
    bundles, strategy = placement_bundles(cfg)
    validate_placement_group(bundles, strategy)
    card = {"cpu": ("num_cpus", 1), "gpu": ("num_gpus", 1), "ascend": ("resources", {"NPU": 1})}[device]
    assert opts[card[0]] == card[1]
    if device != "cpu":
        assert opts["num_cpus"] == 0
    assert bundles == [{ {"cpu": "CPU", "gpu": "GPU", "ascend": "NPU"}[device]: 2.0}] * 2
    assert opts["runtime_env"]["env_vars"]["RANK_ID"] == "3" and opts["max_restarts"] == 0


def test_ray_refuses_gpu_as_a_custom_resource():
    """The regression: `resources={"GPU": 1}` is what stopped every GPU rank."""
    from ray._common.ray_option_utils import validate_actor_options

    with pytest.raises(ValueError, match="num_gpus"):
        validate_actor_options({"resources": {"GPU": 1}}, in_options=True)


# ---- 15: the run directory's permissions ---------------------------------------------------------------
@pytest.mark.parametrize("mode, fmode, dmode", [(None, 0o600, 0o700), ("private", 0o600, 0o700),
                                               ("shared", 0o644, 0o755)])
def test_run_directory_files_follow_the_output_mode(tmp_path, mode, fmode, dmode):
    from mindpulse.launcher.rundir import PidFile, make_run_dir, write_config, write_json

    cfg = from_dict({"output": {"root": str(tmp_path / "runs"), **({"mode": mode} if mode else {})},
                     "env": {"HF_TOKEN": "secret"}})
    old = os.umask(0o022)
    try:
        run_dir = make_run_dir(cfg)
        write_config(run_dir, cfg)
        write_json(run_dir / "plan.json", [{"env": {"HF_TOKEN": "secret"}}])
        pids = PidFile(run_dir)
        pids["x"] = 1
        pids.save()
    finally:
        os.umask(old)
    assert stat.S_IMODE(run_dir.stat().st_mode) == dmode
    assert stat.S_IMODE((run_dir / "logs").stat().st_mode) == dmode
    for name in ("config.yaml", "plan.json", "pids.json"):
        assert stat.S_IMODE((run_dir / name).stat().st_mode) == fmode, name


def test_write_atomic_fsyncs_the_folder_after_the_rename(tmp_path, monkeypatch):
    from mindpulse.rundir import rundir_io

    # os is one module for the whole process: a thread another test left behind (a metrics
    # store closing late) may fsync while this runs, so only this thread's calls count.
    calls = []
    me = threading.get_ident()
    real_replace, real_fsync = os.replace, os.fsync

    def replace(a, b):
        if threading.get_ident() == me:
            calls.append("rename")
        return real_replace(a, b)

    def fsync(fd):
        if threading.get_ident() == me:
            calls.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        return real_fsync(fd)

    monkeypatch.setattr(rundir_io.os, "replace", replace)

    monkeypatch.setattr(rundir_io.os, "fsync", fsync)
    rundir_io.write_atomic(tmp_path / "job.json", b"{}")
    assert calls == ["fsync file", "rename", "fsync dir"]


def test_the_end_of_an_attempt_gives_other_writers_files_the_run_mode(tmp_path):
    from mindpulse.launcher.rundir import apply_run_mode

    cfg = from_dict({})
    (tmp_path / "tb").mkdir(mode=0o755)
    (tmp_path / "tb" / "events.out").write_text("x")
    os.chmod(tmp_path / "tb" / "events.out", 0o644)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "msrun_node0.log").write_text("x")
    os.chmod(tmp_path / "logs" / "msrun_node0.log", 0o664)
    os.symlink("/etc/passwd", tmp_path / "link")
    assert apply_run_mode(tmp_path, cfg) == []
    assert stat.S_IMODE((tmp_path / "tb").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "tb" / "events.out").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "logs" / "msrun_node0.log").stat().st_mode) == 0o600
    assert stat.S_IMODE(os.stat("/etc/passwd").st_mode) == 0o644, "a link was followed"


# ---- 15: nothing from a rank reaches the terminal as a control sequence ---------------------------------
EVIL = "boom\x1b]0;pwned\x07\x1b[2J\x9b31m\u202egnp.exe\rOVERWRITE"


def test_console_lines_show_control_characters_escaped():
    from mindpulse.launcher.progress import Console

    out = io.StringIO()
    Console(out).say(f"mindpulse: rank 1 failed: {EVIL}\nnext line\tok")
    text = out.getvalue()
    assert not any(c in text for c in "\x1b\x07\x9b\u202e\r"), repr(text)
    assert "\\x1b]0;pwned\\x07" in text and "\\u202e" in text and "next line\tok" in text


def test_the_failure_block_escapes_a_ranks_log_tail_and_error(tmp_path):
    from mindpulse.launcher.failures import describe_failure, format_failure

    (tmp_path / "rank_1.log").write_text(f"line one\n{EVIL}\n")
    f = describe_failure({1: RankOutcome(rank=1, exit_code=3, error=EVIL)}, [1], tmp_path, {1: 5})
    text = format_failure(f)
    assert "\x1b" not in text and "\x9b" not in text and "\u202e" not in text and "\\x1b" in text


def test_the_progress_line_escapes_what_it_is_given():
    from mindpulse.launcher.progress import ProgressLine

    out = io.StringIO()
    line = ProgressLine(out)
    line.tty = True
    line.update({"step": 3, "loss": 1.0, "samples_per_s": 2.0}, 10, 0.0)
    assert out.getvalue().startswith("\r\x1b[2K") and out.getvalue().count("\x1b") == 1


# ---- 23: the signal in the failure block -------------------------------------------------------------------
RAY_DIED = ("The actor died unexpectedly before finishing this task.\n\tclass_name: RankActor\n"
            "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
            "detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common causes "
            "include: (1) the process was killed by the OOM killer due to high memory usage, (2) ray stop --force "
            "was called, or (3) the worker crashed unexpectedly due to SIGSEGV or another unexpected error.")


def test_a_ray_actor_death_names_no_guessed_signal(tmp_path):
    from mindpulse.launcher.failures import describe_failure
    from mindpulse.launcher.worker_group import died_error

    error = died_error(RuntimeError(RAY_DIED))
    assert error.startswith("rank process died: The actor died unexpectedly")
    f = describe_failure({1: RankOutcome(rank=1, exit_code=None, error=error)}, [1], tmp_path, {1: 4})
    assert f["signal"] == "unknown" and f["exit_code"] is None


def test_the_signal_comes_from_the_exit_status_or_faulthandlers_last_words(tmp_path):
    from mindpulse.launcher.failures import describe_failure, signal_of

    assert signal_of("msrun on node 0 exited -9", -9) == "SIGKILL"
    assert signal_of("x", -15) == "SIGTERM"
    assert signal_of("exit code 1", 1) is None
    assert signal_of("rank process died: worker was killed by signal 11") == "SIGSEGV"
    assert signal_of("stuck") is None
    (tmp_path / "rank_0.log").write_text("step 3\nFatal Python error: Segmentation fault\n\nThread 0x1 ...\n")
    f = describe_failure({0: RankOutcome(rank=0, exit_code=None, error="rank process died: The actor died")},
                         [0], tmp_path, {0: 3})
    assert f["signal"] == "SIGSEGV"
    f = describe_failure({0: RankOutcome(rank=0, exit_code=-9, error="rank process died: SIGKILL")},
                         [0], tmp_path, {0: 3})
    assert f["signal"] == "SIGKILL"


def test_the_schedulers_port_is_picked_outside_the_ephemeral_range(monkeypatch, tmp_path):
    """The scheduler's port is picked seconds before the scheduler binds it, while the node
    agents' servers bind port 0: a port below the kernel's ephemeral range cannot be drawn
    by them meanwhile. Where the range leaves no room, any free port."""
    import socket

    from mindpulse.launcher import spec

    lo, _ = spec._ephemeral_range()
    ports = {spec.free_port("127.0.0.1", outside_ephemeral=True) for _ in range(5)}
    if lo - spec.LOW_PORTS >= 1000:
        assert all(spec.LOW_PORTS <= p < lo for p in ports), (ports, lo)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free when picked
    narrow = tmp_path / "range"
    narrow.write_text("1024\t65000\n")
    monkeypatch.setattr(spec, "EPHEMERAL_RANGE_FILE", str(narrow))
    assert spec._ephemeral_range() == (1024, 65000)
    assert 0 < spec.free_port("127.0.0.1", outside_ephemeral=True) < 65536


# ---- a busy machine at start ----------------------------------------------------------------------
def _tagged_sleeper(tag: str):
    """A process like a raylet a timed-out `ray.init` leaves behind: the temp dir on its command line."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", tag])


@pytest.mark.slow
@pytest.mark.cluster
def test_a_raylet_slow_to_register_gets_one_more_start_after_its_processes_are_stopped(monkeypatch, caplog):
    """Ray waits a fixed 30 s for a new node's raylet to register; a busy machine can exceed it with
    nothing broken. The first try's processes are stopped and the cluster starts again, once."""
    import ray

    real_init, calls, left = ray.init, [], []

    def init(*args, **kwargs):
        calls.append(kwargs.get("_temp_dir"))
        if len(calls) == 1:
            left.append(_tagged_sleeper(kwargs["_temp_dir"]))
            raise Exception(rs.RAY_START_TIMED_OUT + ". This could happen because some of the raylet "
                            "failed to startup or the GCS has become overloaded.")
        return real_init(*args, **kwargs)

    monkeypatch.setattr(ray, "init", init)
    with rs.RaySession(from_dict({})) as session:
        assert len(calls) == 2 and calls[0] == calls[1] == session.temp_dir
        assert left[0].wait(timeout=10) is not None, "the first try's processes were left running"
        assert ray.cluster_resources().get("CPU") == 3.0
        assert "did not register within Ray's 30 s" in caplog.text


def test_any_other_start_failure_is_not_tried_again(monkeypatch):
    import ray

    calls = []

    def init(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("the GCS refused the token")

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(RuntimeError, match="refused the token"):
        rs.RaySession(from_dict({})).__enter__()
    assert calls == [1]
