"""`mindpulse plan`: every rank's node, device, environment and command, without starting anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mindpulse.config import ConfigError, from_dict
from mindpulse.launcher.spec import rank_specs

ROOT = Path(__file__).resolve().parents[2]
PLANS = ROOT / "tests" / "fixtures" / "plans"


def plan_json(config: str, *extra: str) -> list[dict]:
    # the plan reads these from the launching shell: the expected plans are a bare shell's
    env = {k: v for k, v in os.environ.items() if k not in ("GLOG_v", "LOG_MF_PATH")}
    proc = subprocess.run([sys.executable, "-m", "mindpulse.launcher.cli", "plan", config, "--json", *extra],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("name", ["ascend_910b_8p", "ray_2nodes_16p"])
def test_shipped_ascend_plans_match_the_expected_json(name):
    got = plan_json(f"cluster_configs/{name}.yaml")
    expected = json.loads((PLANS / f"{name}.json").read_text())
    assert got == expected
    for entry in got:
        assert set(entry) == {"node", "rank", "local_rank", "device_id", "env", "command"}


def test_910b_plan_is_what_a_mindspore_user_writes_by_hand():
    plan = plan_json("cluster_configs/ascend_910b_8p.yaml")
    assert [p["rank"] for p in plan] == list(range(8))
    assert [p["device_id"] for p in plan] == list(range(8))
    for p in plan:
        env = p["env"]
        assert env["RANK_ID"] == env["MS_NODE_ID"] == str(p["rank"]) and env["DEVICE_ID"] == str(p["local_rank"])
        assert env["RANK_SIZE"] == env["MS_WORKER_NUM"] == "8"
        assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
        assert env["MS_SCHED_HOST"] == "127.0.0.1" and env["MS_SCHED_PORT"] == "8118"
        assert env["HCCL_CONNECT_TIMEOUT"] == "1200"
    cmd = plan[0]["command"]
    assert cmd[0] == "msrun"
    for opt in ("--worker_num=8", "--local_worker_num=8", "--master_port=8118", "--node_rank=0", "--join=True",
                "--cluster_time_out=7200", "--log_dir=${RUN_DIR}/logs"):
        assert opt in cmd, opt
    assert cmd[-5:] == ["python", "-m", "mindpulse.workers.rank_main", "--job", "${RUN_DIR}/job.json"]


def test_mindformers_logs_go_to_the_attempts_log_folder_unless_the_shell_names_one(monkeypatch):
    """Unset, MindFormers writes ./output/log/rank_N in the rank's working directory: the
    user's, shared by every run started there."""
    monkeypatch.delenv("LOG_MF_PATH", raising=False)
    cfg = from_dict({"world": {"ranks_per_node": 2}})
    specs = rank_specs(cfg, run_dir="/runs/a", logs_dir="/runs/a/logs/attempt_1")
    assert [s.env["LOG_MF_PATH"] for s in specs] == ["/runs/a/logs/attempt_1/mindformers"] * 2
    monkeypatch.setenv("LOG_MF_PATH", "/shared/mf")
    assert rank_specs(cfg, run_dir="/runs/a")[0].env["LOG_MF_PATH"] == "/shared/mf"
    # as GLOG_v: the config's env: may not name it (the shell's would replace it)
    with pytest.raises(ConfigError, match=r"^env.LOG_MF_PATH: .*set it in that shell"):
        from_dict({"env": {"LOG_MF_PATH": "/mine"}})
    # msrun passes on only what it does not set itself: this must reach its ranks
    from mindpulse.launcher.worker_group import msrun_env

    monkeypatch.delenv("LOG_MF_PATH")
    cfg = from_dict({"backend": "msrun", "world": {"ranks_per_node": 2}})
    spec = rank_specs(cfg, run_dir="/runs/a")[0]
    assert msrun_env(cfg, spec)["LOG_MF_PATH"] == "/runs/a/logs/mindformers"


def test_two_node_plan_ranks_and_devices():
    plan = plan_json("cluster_configs/ray_2nodes_16p.yaml")
    assert [(p["node"], p["local_rank"]) for p in plan] == [(n, i) for n in range(2) for i in range(8)]
    assert all(p["env"]["RANK_SIZE"] == "16" for p in plan)
    assert plan[9]["env"]["RANK_ID"] == "9" and plan[9]["env"]["DEVICE_ID"] == "1" and plan[9]["device_id"] == 1
    assert all(p["env"]["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"] == "1" for p in plan)


def test_msrun_multi_node_commands_differ_only_in_node_rank():
    cfg = from_dict({"backend": "msrun", "world": {"nodes": 2, "ranks_per_node": 2, "device": "ascend",
                                                    "devices": [4, 5]}, "msrun": {"master_addr": "10.0.0.1",
                                                                                   "master_port": 9000}})
    specs = rank_specs(cfg)
    c0, c1 = specs[0].command, specs[2].command
    assert "--node_rank=0" in c0 and "--node_rank=1" in c1 and "--master_addr=10.0.0.1" in c1
    assert [x for x in c0 if not x.startswith("--node_rank")] == [x for x in c1 if not x.startswith("--node_rank")]
    assert [s.device_id for s in specs] == [4, 5, 4, 5]
    assert specs[3].env["ASCEND_RT_VISIBLE_DEVICES"] == "4,5" and specs[3].env["DEVICE_ID"] == "1"


def test_gpu_visibility_and_placeholders():
    cfg = from_dict({"world": {"nodes": 2, "ranks_per_node": 1, "device": "gpu"}})
    specs = rank_specs(cfg)
    assert specs[1].env["CUDA_VISIBLE_DEVICES"] == "0"
    assert specs[0].env["MS_SCHED_HOST"] == "${MASTER_ADDR}" and specs[0].env["MS_SCHED_PORT"] == "${MASTER_PORT}"


def test_plan_text_output_and_set():
    proc = subprocess.run([sys.executable, "-m", "mindpulse.launcher.cli", "plan",
                           "cluster_configs/ascend_910b_8p.yaml",
                           "--set", "world.ranks_per_node=4", "--set", "world.devices=[0,1,2,3]"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "--worker_num=4" in proc.stdout and "ASCEND_RT_VISIBLE_DEVICES=0,1,2,3" in proc.stdout


@pytest.mark.parametrize("config, needle", [
    ("cluster_configs/ascend_910b_8p.yaml", "no `npu-smi`"),
    ("cluster_configs/ray_2nodes_16p.yaml", ""),
])
def test_launch_without_the_hardware_stops_before_starting_anything(tmp_path, config, needle):
    import shutil

    if shutil.which("npu-smi"):
        pytest.skip("this machine has npu-smi")
    args = [sys.executable, "-m", "mindpulse.launcher.cli", "launch", config, "--set", f"output.root={tmp_path}"]
    if "ray_2nodes" in config:
        # no Ray cluster to join here: a one-machine embedded cluster has no NPU resource
        args += ["--set", "ray.address=", "--set", "world.nodes=1"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert ("npu-smi" in proc.stderr) and (needle in proc.stderr)
    assert not any(tmp_path.iterdir()), "a run directory was left by a launch that started nothing"


def test_heartbeat_interval_is_one_second_for_small_worlds_and_mindspores_default_for_large_ones():
    """A rank learns that MindSpore's cluster is built only from a heartbeat's answer: small
    worlds get a 1 s heartbeat, large ones keep MindSpore's random 3-5 s (no variable set),
    and `msrun.heartbeat_interval_s` sets it for any world, on both backends."""
    def env_of(**cfg):
        return [s.env for s in rank_specs(from_dict(cfg))]

    small = env_of(world={"nodes": 16, "ranks_per_node": 8})
    assert all(e["MS_RETRY_INTERVAL_LOWER"] == e["MS_RETRY_INTERVAL_UPPER"] == "1" for e in small)
    large = env_of(world={"nodes": 17, "ranks_per_node": 8})
    assert not any("MS_RETRY_INTERVAL_LOWER" in e or "MS_RETRY_INTERVAL_UPPER" in e for e in large)
    for backend in ("ray", "msrun"):
        set_ = env_of(backend=backend, world={"nodes": 32, "ranks_per_node": 8}, msrun={"heartbeat_interval_s": 4})
        assert all(e["MS_RETRY_INTERVAL_LOWER"] == e["MS_RETRY_INTERVAL_UPPER"] == "4" for e in set_)
