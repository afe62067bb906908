"""Tests for the per-node telemetry samplers.

No Ascend hardware here: ``npu-smi`` is replaced by a shell script written into tmp_path
that prints the real captures of ``tests/fixtures/npu-smi`` for the arguments it gets
(``npu-smi info``, ``npu-smi info -t usages|power|temp -i N``, with the ``NPU ID`` line
set to N). The fixtures have no ``-t memory`` capture of a 910B board; for that one query
the script prints a short listing synthesised from keys the parser knows (marked below).
The psutil path runs for real; the NVML test runs only where NVML works.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from mindpulse.node.samplers import dcmi as dcmi_sampler
from mindpulse.node.samplers import npu_smi as npu_smi_sampler
from mindpulse.node.telemetry import (
    CARD_KEYS,
    DcmiSampler,
    NodeSampler,
    NpuSmiSampler,
    NvmlSampler,
    PsutilSampler,
    Sampler,
    TelemetryUnavailable,
    card_record,
    pick_sampler,
    sample_this_machine,
    telemetry_packet,
)
from mindpulse.wire.protocol import TelemetryPacket, decode

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "npu-smi"

# Synthesised (no capture in the fixtures): a 910B `-t memory` listing consistent with
# t_usages_910b.txt (DDR 0 MB, HBM 65536 MB).
MEMORY_910B_SYNTH = """\
        NPU ID                         : 0
        Chip Count                     : 1

        DDR Capacity(MB)               : 0
        HBM Capacity(MB)               : 65536
        Chip ID                        : 0
"""

SET_910B = {
    "info": "info_910b3_a2_8cards_busy.txt",
    "usages": "t_usages_910b.txt",
    "power": "t_power_910b.txt",
    "temp": "t_temp_910b.txt",
    "memory": ("text", MEMORY_910B_SYNTH),
}
SET_310B = {
    "info": ("fail", 1, "Usage: npu-smi info <watch|proc-mem|-h|-m|-l|-t type -i id -c chip_id>"),
    "usages": "t_usages_310b_200i_a2.txt",
    "power": "t_power_310b_200i_a2.txt",
    "temp": "t_temp_310b_200i_a2.txt",
    "memory": "t_memory_310b_200i_a2.txt",
}

_SET_NPU_ID = r's/^\([[:space:]]*NPU ID[[:space:]]*:[[:space:]]*\)0[[:space:]]*$/\1'


def make_fake_npu_smi(tmp_path: Path, spec: dict, *, log: Path | None = None,
                      delay_s: float = 0.0, name: str = "npu-smi") -> Path:
    """Write an executable fake ``npu-smi``.

    ``spec`` maps ``info``, ``m`` (``info -m``) and the ``-t`` kinds to what the script
    does: a fixture file name, ``("text", str)``, ``("fail", rc, stderr)`` or
    ``("sleep", seconds)`` (writes its pid to ``<name>.pid`` and the pid of its ``sleep``
    child to ``<name>.child``). With ``log``, each run appends ``start PID TS ARGS`` and
    ``end PID TS`` lines (``delay_s`` between them).
    """
    d = tmp_path / (name + ".d")
    d.mkdir(exist_ok=True)
    cases = []
    for kind, action in spec.items():
        if isinstance(action, str):
            action = ("file", str(FIXTURES / action))
        if action[0] == "text":
            f = d / f"{kind}.txt"
            f.write_text(action[1])
            action = ("file", str(f))
        if action[0] == "file":
            body = f'sed "{_SET_NPU_ID}$npu/" {shlex.quote(action[1])}'
        elif action[0] == "fail":
            body = f"echo {shlex.quote(action[2])} >&2; finish; exit {int(action[1])}"
        elif action[0] == "sleep":
            pid = shlex.quote(str(tmp_path / f"{name}.pid"))
            child = shlex.quote(str(tmp_path / f"{name}.child"))
            body = f"echo $$ > {pid}; sleep {action[1]} & echo $! > {child}; wait"
        else:
            raise ValueError(action)
        cases.append(f"  {kind}) {body} ;;")
    logq = shlex.quote(str(log)) if log else "''"
    script = f"""#!/bin/sh
LOG={logq}
finish() {{ if [ -n "$LOG" ]; then echo "end $$ $(date +%s.%N)" >> "$LOG"; fi; }}
if [ -n "$LOG" ]; then echo "start $$ $(date +%s.%N) $*" >> "$LOG"; fi
npu=0
kind=unknown
if [ "$1" = info ] && [ $# -eq 1 ]; then kind=info
elif [ "$1" = info ] && [ "$2" = -m ]; then kind=m
elif [ "$1" = info ] && [ "$2" = -t ] && [ "$4" = -i ]; then kind="$3"; npu="$5"
fi
sleep {delay_s}
case "$kind" in
{chr(10).join(cases)}
  *) echo "Error: unsupported arguments $*" >&2; finish; exit 255 ;;
esac
finish
"""
    path = tmp_path / name
    path.write_text(script)
    path.chmod(0o755)
    return path


def read_log(log: Path) -> list[tuple[float, float, str]]:
    """(start, end, args) of every run in a fake's log."""
    open_runs: dict[str, tuple[float, str]] = {}
    runs = []
    for line in log.read_text().splitlines():
        parts = line.split(" ", 3)
        if parts[0] == "start":
            open_runs[parts[1]] = (float(parts[2]), parts[3] if len(parts) > 3 else "")
        elif parts[0] == "end":
            start, args = open_runs.pop(parts[1])
            runs.append((start, float(parts[2]), args))
    assert not open_runs, f"runs without an end: {open_runs}"
    return runs


def assert_no_overlap(runs: list[tuple[float, float, str]]) -> None:
    runs = sorted(runs)
    for a, b in zip(runs, runs[1:]):
        assert b[0] >= a[1], f"npu-smi runs overlap: {a} and {b}"


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def lock_path(tmp_path):
    return str(tmp_path / "npu-smi.lock")


# ------------------------------------------------------------------------ records, psutil


def test_card_record_has_exactly_the_contract_keys():
    rec = card_record(card=3, source="nvml")
    assert tuple(rec) == CARD_KEYS
    assert rec["ranks"] == [] and rec["power_w"] is None
    with pytest.raises(KeyError):
        card_record(bogus=1)


def test_psutil_sampler_reads_the_host():
    s = PsutilSampler()
    assert PsutilSampler.available()
    for _ in range(2):
        cards = s.sample()
        assert len(cards) == 1
        c = cards[0]
        assert tuple(c) == CARD_KEYS
        assert c["card"] == -1 and c["name"] == "cpu" and c["source"] == "psutil"
        assert 0.0 <= c["util_pct"] <= 100.0
        assert 0 < c["memory_used_mb"] <= c["memory_total_mb"]
        assert c["memory_total_mb"] == pytest.approx(psutil.virtual_memory().total / 2**20, abs=1)
        assert c["power_w"] is None and c["temp_c"] is None
        assert s.last_warnings == []


def test_process_stats_live_and_dead_pids():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    s = PsutilSampler()
    pids = {1: dead.pid, 0: os.getpid()}
    first = s.process_stats(pids)
    assert [p["rank"] for p in first] == [0, 1]
    assert all(tuple(p) == ("rank", "pid", "cpu_pct", "rss_mb") for p in first)
    assert first[0]["pid"] == os.getpid() and first[0]["rss_mb"] > 10
    assert first[0]["cpu_pct"] is None  # first sight of a pid: no interval yet
    sum(i * i for i in range(200_000))  # some CPU for the next reading
    second = s.process_stats(pids)
    assert isinstance(second[0]["cpu_pct"], float) and second[0]["cpu_pct"] >= 0.0
    assert second[1] == {"rank": 1, "pid": dead.pid, "cpu_pct": None, "rss_mb": None}
    assert s.process_stats({}) == []


# ------------------------------------------------------------------------------ npu-smi


def test_npu_smi_maps_fixture_values_into_card_records(tmp_path, lock_path):
    log = tmp_path / "runs.log"
    fake = make_fake_npu_smi(tmp_path, SET_910B, log=log)
    s = NpuSmiSampler(str(fake), timeout_s=10, lock_path=lock_path)
    cards = s.sample()
    assert s.last_warnings == []
    assert [c["card"] for c in cards] == list(range(8))
    for c in cards:
        assert tuple(c) == CARD_KEYS
        assert c["source"] == "npu-smi" and c["node"] is None and c["ranks"] == []
        assert c["chip"] == 0 and c["name"] == "910B3" and c["health"] == "OK"
        # t_power_910b: 103.5 W; t_temp_910b: 39 C; t_usages_910b: AICore 0 %,
        # HBM 5 % of 65536 MB
        assert c["power_w"] == 103.5
        assert c["temp_c"] == 39.0
        assert c["util_pct"] == 0.0
        assert c["memory_total_mb"] == 65536.0
        assert c["memory_used_mb"] == pytest.approx(3276.8)

    args = [r[2] for r in read_log(log)]
    assert args[0] == "info"
    assert args[1:] == [f"info -t {q} -i {n}" for n in range(8)
                        for q in ("usages", "power", "temp", "memory")]
    # the next sample queries the cards again, without running discovery again
    s.sample()
    args2 = [r[2] for r in read_log(log)][len(args):]
    assert "info" not in args2 and len(args2) == 32


def test_npu_smi_ddr_board_when_discovery_fails(tmp_path, lock_path):
    fake = make_fake_npu_smi(tmp_path, SET_310B)
    s = NpuSmiSampler(str(fake), card_ids=[0], lock_path=lock_path)
    cards = s.sample()
    assert len(cards) == 1
    c = cards[0]
    # t_usages_310b: memory 35 % of 10810 MB, AICore 0 %; power 9.1 W; temp 50 C
    assert c["card"] == 0 and c["chip"] == 0
    assert c["memory_total_mb"] == 10810.0
    assert c["memory_used_mb"] == pytest.approx(3783.5)
    assert c["util_pct"] == 0.0 and c["power_w"] == 9.1 and c["temp_c"] == 50.0
    assert c["name"] is None and c["health"] is None
    assert any("`npu-smi info` exited with status 1" in w for w in s.last_warnings)


def test_npu_smi_nonzero_exit_gives_no_cards_and_a_warning(tmp_path, lock_path):
    msg = "dcmi module initialize failed. ret is -8005"
    fake = make_fake_npu_smi(tmp_path, {"info": ("fail", 2, msg)})
    s = NpuSmiSampler(str(fake), lock_path=lock_path)
    assert s.sample() == []
    assert len(s.last_warnings) == 1
    assert "exited with status 2" in s.last_warnings[0] and msg in s.last_warnings[0]


def test_npu_smi_failing_query_leaves_only_its_values_empty(tmp_path, lock_path):
    spec = dict(SET_910B, temp=("fail", 3, "This device does not support querying temp."))
    fake = make_fake_npu_smi(tmp_path, spec)
    s = NpuSmiSampler(str(fake), card_ids=[0, 1], lock_path=lock_path)
    cards = s.sample()
    assert [c["card"] for c in cards] == [0, 1]
    assert all(c["temp_c"] is None and c["power_w"] == 103.5 for c in cards)
    assert any("`npu-smi info -t temp -i 0` exited with status 3" in w for w in s.last_warnings)


def test_npu_smi_timeout_returns_quickly_and_kills_the_child(tmp_path, lock_path):
    spec = dict(SET_910B, power=("sleep", 30))
    fake = make_fake_npu_smi(tmp_path, spec)
    s = NpuSmiSampler(str(fake), timeout_s=0.5, lock_path=lock_path)
    t0 = time.monotonic()
    cards = s.sample()
    elapsed = time.monotonic() - t0
    assert elapsed < 5.0
    assert [c["card"] for c in cards] == list(range(8))  # cards known from discovery
    assert all(c["power_w"] is None and c["temp_c"] is None for c in cards)
    assert cards[0]["util_pct"] == 0.0  # `-t usages -i 0` ran before the hang
    assert all(c["util_pct"] is None for c in cards[1:])
    assert any("timed out after 0.5 s and was killed" in w for w in s.last_warnings)
    pid = int((tmp_path / "npu-smi.pid").read_text())
    child = int((tmp_path / "npu-smi.child").read_text())
    deadline = time.monotonic() + 3
    while not (gone(pid) and gone(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(pid), "the timed-out npu-smi is still running"
    assert gone(child), "a child of the timed-out npu-smi is still running"


def test_npu_smi_discovery_timeout(tmp_path, lock_path):
    fake = make_fake_npu_smi(tmp_path, {"info": ("sleep", 30)})
    s = NpuSmiSampler(str(fake), timeout_s=0.3, lock_path=lock_path)
    t0 = time.monotonic()
    assert s.sample() == []
    assert time.monotonic() - t0 < 4.0
    assert any("timed out" in w for w in s.last_warnings)


def test_concurrent_samplers_in_threads_serialize(tmp_path, lock_path):
    log = tmp_path / "runs.log"
    fake = make_fake_npu_smi(tmp_path, SET_910B, log=log, delay_s=0.02)
    samplers = [NpuSmiSampler(str(fake), card_ids=[0, 1], lock_path=lock_path) for _ in range(2)]
    results: list = []

    def work(s):
        for _ in range(2):
            results.append(s.sample())

    threads = [threading.Thread(target=work, args=(s,)) for s in samplers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    runs = read_log(log)
    assert len(runs) == 2 * (1 + 2 * 2 * 4)  # per sampler: discovery + 2 samples x 2 cards x 4
    assert_no_overlap(runs)
    assert all(len(r) == 2 and r[0]["power_w"] == 103.5 for r in results)


def test_samplers_in_two_processes_serialize(tmp_path, lock_path):
    log = tmp_path / "runs.log"
    fake = make_fake_npu_smi(tmp_path, SET_910B, log=log, delay_s=0.02)
    code = (
        "from mindpulse.node.telemetry import NpuSmiSampler\n"
        f"s = NpuSmiSampler({str(fake)!r}, card_ids=[0, 1], lock_path={lock_path!r})\n"
        "for _ in range(2):\n"
        "    assert s.sample()[0]['power_w'] == 103.5, s.last_warnings\n"
    )
    other = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        s = NpuSmiSampler(str(fake), card_ids=[0, 1], lock_path=lock_path)
        for _ in range(2):
            assert s.sample()[0]["power_w"] == 103.5
    finally:
        assert other.wait(60) == 0
    runs = read_log(log)
    assert len(runs) == 2 * (1 + 2 * 2 * 4)
    assert_no_overlap(runs)


def test_host_lock_file_is_honoured(tmp_path, lock_path):
    log = tmp_path / "runs.log"
    fake = make_fake_npu_smi(tmp_path, SET_910B, log=log)
    holder = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        # another process holds the lock: a short wait gives up with a warning
        busy = NpuSmiSampler(str(fake), card_ids=[0], lock_path=lock_path, lock_wait_s=0.2)
        t0 = time.monotonic()
        cards = busy.sample()
        assert time.monotonic() - t0 < 2.0
        # the card asked for, without values
        assert [c["card"] for c in cards] == [0]
        assert all(cards[0][k] is None for k in ("util_pct", "power_w", "temp_c", "memory_total_mb"))
        assert any("busy" in w for w in busy.last_warnings)
        # a longer wait runs npu-smi only once the lock is free
        s = NpuSmiSampler(str(fake), card_ids=[0], lock_path=lock_path)
        out: list = []
        t = threading.Thread(target=lambda: out.append(s.sample()))
        t.start()
        time.sleep(0.4)
        assert not log.exists() or log.read_text() == ""
        released = time.time()
        fcntl.flock(holder, fcntl.LOCK_UN)
    finally:
        os.close(holder)
    t.join(20)
    assert out and out[0][0]["power_w"] == 103.5
    assert min(r[0] for r in read_log(log)) >= released - 0.01


def test_parse_logic_ids():
    # synthesised `npu-smi info -m` layout: two NPU chips and an MCU per NPU
    text = """\
        NPU ID                         Chip ID                        Chip Logic ID                  Chip Name
        0                              0                              0                              Ascend 910
        0                              1                              1                              Ascend 910
        0                              2                              -                              Mcu
        1                              0                              2                              Ascend 910
"""
    assert npu_smi_sampler._parse_logic_ids(text) == {(0, 0): 0, (0, 1): 1, (1, 0): 2}


# --------------------------------------------------------------------------------- DCMI


class FakeDcmiLibrary:
    """Stands in for libdcmi.so: two cards, one NPU chip each; card 0 has HBM, card 1
    only DDR (its HBM query is unsupported). Values are made up for the test."""

    def dcmi_get_card_list(self, num, ids, list_len):
        num._obj.value = 2
        ids[0], ids[1] = 0, 1
        return 0

    def dcmi_get_device_id_in_card(self, card, dmax, mcu, cpu):
        dmax._obj.value, mcu._obj.value, cpu._obj.value = 1, 1, -1
        return 0

    def dcmi_get_device_logic_id(self, logic, card, dev):
        logic._obj.value = card
        return 0

    def dcmi_get_device_phyid_from_logicid(self, logic, phy):
        phy._obj.value = logic.value + 4
        return 0

    def dcmi_get_device_utilization_rate(self, card, dev, kind, rate):
        assert kind == 2  # AI Core
        rate._obj.value = 37
        return 0

    def dcmi_get_device_power_info(self, card, dev, power):
        power._obj.value = 1537  # 0.1 W
        return 0

    def dcmi_get_device_temperature(self, card, dev, temp):
        temp._obj.value = 45
        return 0

    def dcmi_get_device_health(self, card, dev, health):
        health._obj.value = 0 if card == 0 else 2
        return 0

    def dcmi_get_device_hbm_info(self, card, dev, info):
        if card == 1:
            return -8255  # not supported
        info._obj.memory_size, info._obj.memory_usage = 65536, 62810
        return 0

    def dcmi_get_device_memory_info_v3(self, card, dev, info):
        info._obj.memory_size, info._obj.utiliza = 10810, 35
        return 0

    def dcmi_get_device_chip_info(self, card, dev, info):
        ctypes.memmove(info._obj.chip_name, b"910B3\0", 6)
        return 0


def test_dcmi_sampler_converts_units_with_a_fake_library():
    s = DcmiSampler(lib=FakeDcmiLibrary())
    cards = s.sample()
    assert s.last_warnings == []
    assert [(c["card"], c["chip"]) for c in cards] == [(4, 0), (5, 0)]
    c0, c1 = cards
    assert tuple(c0) == CARD_KEYS and c0["source"] == "dcmi"
    assert (c0["util_pct"], c0["power_w"], c0["temp_c"]) == (37.0, 153.7, 45.0)
    assert (c0["memory_used_mb"], c0["memory_total_mb"]) == (62810.0, 65536.0)
    assert c0["health"] == "OK" and c0["name"] == "910B3"
    assert (c1["memory_used_mb"], c1["memory_total_mb"]) == (3783.5, 10810.0)
    assert c1["health"] == "Alarm"


def test_dcmi_sampler_failing_call_leaves_value_empty():
    class NoPower(FakeDcmiLibrary):
        def dcmi_get_device_power_info(self, card, dev, power):
            return -8005

    s = DcmiSampler(lib=NoPower())
    cards = s.sample()
    assert all(c["power_w"] is None and c["temp_c"] == 45.0 for c in cards)
    assert s.last_warnings == ["DCMI dcmi_get_device_power_info returned -8005; its values are empty"]


def test_dcmi_is_not_available_here(monkeypatch):
    monkeypatch.setattr(DcmiSampler, "LIBRARY_PATHS", ("/nonexistent/libdcmi.so",))
    monkeypatch.setattr(DcmiSampler, "_load_tried", False)
    monkeypatch.setattr(DcmiSampler, "_loaded", None)
    monkeypatch.setattr(dcmi_sampler.ctypes.util, "find_library", lambda name: None)
    assert DcmiSampler.available() is False
    assert "libdcmi.so not found" in DcmiSampler.load_error
    with pytest.raises(TelemetryUnavailable):
        DcmiSampler()


# --------------------------------------------------------------------------- NodeSampler


class StubSampler(Sampler):
    name = "stub"

    def __init__(self, cards=4, fail=False):
        super().__init__()
        self.cards, self.fail, self.calls = cards, fail, 0

    def sample(self):
        self.calls += 1
        if self.fail:
            raise RuntimeError("device on fire")
        self.last_warnings = ["stub warning"]
        return [card_record(card=i, chip=0, util_pct=10.0 * i, source="stub") for i in range(self.cards)]


def test_node_sampler_maps_ranks_to_cards():
    ns = NodeSampler("node-a", StubSampler(), {0: 0, 1: 1, 2: 1, 3: 3, 4: 9}, {0: os.getpid()})
    s = ns.sample_once()
    assert set(s) == {"node", "ts", "source", "cards", "host", "warnings"}
    assert s["node"] == "node-a" and s["source"] == "stub" and abs(s["ts"] - time.time()) < 5
    assert {c["card"]: c["ranks"] for c in s["cards"]} == {0: [0], 1: [1, 2], 2: [], 3: [3]}
    assert all(c["node"] == "node-a" and tuple(c) == CARD_KEYS for c in s["cards"])
    assert "stub warning" in s["warnings"]
    assert any("4 (card 9)" in w for w in s["warnings"])
    host = s["host"]
    assert set(host) == {"cpu_pct", "mem_used_mb", "mem_total_mb", "processes"}
    assert host["mem_total_mb"] > 0
    assert [p["rank"] for p in host["processes"]] == [0]
    assert host["processes"][0]["pid"] == os.getpid()


def test_node_sampler_never_raises():
    s = NodeSampler("node-a", StubSampler(fail=True), {0: 0}).sample_once()
    assert s["cards"] == []
    assert any("device on fire" in w for w in s["warnings"])
    assert s["host"]["mem_total_mb"] > 0


def test_node_sampler_psutil_source_puts_every_rank_on_the_host_card():
    ns = NodeSampler("cpu-node", PsutilSampler(), {0: -1, 1: -1}, {0: os.getpid(), 1: os.getpid()})
    s = ns.sample_once()
    assert s["source"] == "psutil"
    [c] = s["cards"]
    assert c["card"] == -1 and c["ranks"] == [0, 1] and c["node"] == "cpu-node"
    assert s["host"]["cpu_pct"] == c["util_pct"]
    assert s["host"]["mem_total_mb"] == c["memory_total_mb"] > 0
    assert len(s["host"]["processes"]) == 2
    assert s["warnings"] == []


def test_node_sampler_with_npu_smi(tmp_path, lock_path):
    fake = make_fake_npu_smi(tmp_path, SET_910B)
    sampler = NpuSmiSampler(str(fake), lock_path=lock_path)
    s = NodeSampler("n1", sampler, {r: r // 2 for r in range(8)}).sample_once()
    ranks = {c["card"]: c["ranks"] for c in s["cards"]}
    assert ranks == {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7], 4: [], 5: [], 6: [], 7: []}
    assert s["source"] == "npu-smi" and s["warnings"] == []
    pkt = decode(telemetry_packet(s).encode())
    assert isinstance(pkt, TelemetryPacket)
    assert pkt.node == "n1" and pkt.cards == s["cards"] and pkt.host == s["host"]


def test_telemetry_packet_carries_warnings_in_host():
    s = NodeSampler("n", StubSampler(cards=1), {}).sample_once()
    pkt = decode(telemetry_packet(s).encode())
    assert pkt.host["warnings"] == s["warnings"] and pkt.source == "stub"


def test_thread_start_stop():
    stub = StubSampler(cards=2)
    ns = NodeSampler("n", stub, {0: 0}, interval_s=0.05)
    got: list = []

    def callback(sample):
        got.append(sample)
        if len(got) == 2:
            raise ValueError("a bad callback does not stop sampling")

    ns.start(callback)
    assert ns.running
    with pytest.raises(RuntimeError):
        ns.start(callback)
    deadline = time.monotonic() + 5
    while len(got) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(got) >= 4
    assert ns.callback_errors == 1
    t0 = time.monotonic()
    assert ns.stop() is True
    assert time.monotonic() - t0 < 1.0
    assert not ns.running
    n = len(got)
    time.sleep(0.2)
    assert len(got) == n  # nothing after stop
    # the interval is respected: about 20 samples per second, not a busy loop
    assert stub.calls < 4 + 5 / 0.05
    ns.start(got.append)  # restartable
    deadline = time.monotonic() + 5
    while len(got) == n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ns.stop() and len(got) > n


def test_stop_abandons_a_hanging_npu_smi(tmp_path, lock_path):
    fake = make_fake_npu_smi(tmp_path, dict(SET_910B, usages=("sleep", 30)))
    ns = NodeSampler("n", NpuSmiSampler(str(fake), timeout_s=30, lock_path=lock_path), {}, interval_s=5)
    ns.start(lambda s: None)
    pidfile = tmp_path / "npu-smi.pid"
    deadline = time.monotonic() + 10
    while not (pidfile.exists() and pidfile.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pidfile.exists(), "the fake npu-smi never started"
    t0 = time.monotonic()
    assert ns.stop() is True
    assert time.monotonic() - t0 < 2.0
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 3
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(pid)
    # after a stop, one-off samples run npu-smi again
    ns.sampler.timeout_s = 0.3
    assert any("timed out" in w for w in ns.sample_once()["warnings"])


# ------------------------------------------------------------------------ choosing a source


@pytest.fixture
def no_ascend(monkeypatch, tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(npu_smi_sampler, "NPU_SMI_DIRS", ())
    monkeypatch.setattr(DcmiSampler, "LIBRARY_PATHS", ())
    monkeypatch.setattr(DcmiSampler, "_load_tried", False)
    monkeypatch.setattr(DcmiSampler, "_loaded", None)
    monkeypatch.setattr(dcmi_sampler.ctypes.util, "find_library", lambda name: None)
    return empty


def test_pick_sampler_cpu_and_unknown_names():
    assert isinstance(pick_sampler("cpu"), PsutilSampler)
    with pytest.raises(ValueError):
        pick_sampler("tpu")
    with pytest.raises(ValueError):
        pick_sampler("cpu", prefer="nvml")


def test_pick_sampler_ascend_without_sources_says_what_is_missing(no_ascend):
    with pytest.raises(TelemetryUnavailable) as exc:
        pick_sampler("ascend")
    msg = str(exc.value)
    assert "libdcmi.so" in msg and "npu-smi" in msg and "PATH" in msg


def test_pick_sampler_ascend_finds_npu_smi_on_path(no_ascend, tmp_path):
    make_fake_npu_smi(no_ascend.parent, SET_910B, name="npu-smi")
    (no_ascend / "npu-smi").symlink_to(no_ascend.parent / "npu-smi")
    s = pick_sampler("ascend")
    assert isinstance(s, NpuSmiSampler)
    assert s.npu_smi == str(no_ascend / "npu-smi")
    assert isinstance(pick_sampler("auto", prefer="npu-smi"), NpuSmiSampler)


@pytest.mark.skipif(NvmlSampler.available(), reason="this machine has a working NVML")
def test_pick_sampler_gpu_without_nvml_raises():
    with pytest.raises(TelemetryUnavailable, match="NVML|pynvml"):
        pick_sampler("gpu")


def test_sample_this_machine(no_ascend):
    s = sample_this_machine("cpu")
    assert s["source"] == "psutil" and len(s["cards"]) == 1 and s["host"]["mem_total_mb"] > 0
    auto = sample_this_machine()
    expected = "nvml" if NvmlSampler.available() else "psutil"
    assert auto["source"] == expected and auto["cards"]
    assert any("no Ascend telemetry" in w for w in auto["warnings"])
    with pytest.raises(TelemetryUnavailable):
        sample_this_machine("ascend")


def test_telemetry_sample_command_runs_the_node_sampler_through_the_drivers_door(no_ascend, capsys):
    """`mindpulse telemetry sample` runs the node agent's sampler in the driver
    (launcher/doors.py): a sample as JSON, and a missing source ends it with exit 2 and the
    node's reason."""
    import json

    from mindpulse.launcher.cli import main

    assert main(["telemetry", "sample", "--device", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["source"] == "psutil"
    assert main(["telemetry", "sample", "--device", "ascend"]) == 2
    err = capsys.readouterr().err
    assert "no Ascend telemetry on this machine" in err, err


# ---------------------------------------------------------------------------------- NVML


@pytest.mark.skipif(not NvmlSampler.available(),
                    reason="NVML is not available (no NVIDIA GPU or driver on this machine)")
def test_nvml_sampler_reads_every_gpu():
    import pynvml

    s = NvmlSampler()
    try:
        cards = s.sample()
        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
        assert count > 0
        assert [c["card"] for c in cards] == list(range(count))
        for c in cards:
            assert tuple(c) == CARD_KEYS and c["source"] == "nvml"
            assert c["memory_total_mb"] > 0
            assert 0 <= c["memory_used_mb"] <= c["memory_total_mb"]
            assert c["util_pct"] is None or 0 <= c["util_pct"] <= 100
        ns = NodeSampler("gpu-node", s, {0: 0})
        sample = ns.sample_once()
        assert sample["source"] == "nvml" and sample["cards"][0]["ranks"] == [0]
    finally:
        s.close()


class _StandInNvml:
    """pynvml with NVIDIA's own structures and error classes, whose device calls return the
    values of two cards as NVML reports them (units and types as the library returns them:
    bytes, milliwatts, `c_nvmlMemory_t`, `c_nvmlUtilization_t`): the sampler's reading and
    unit conversions run in CI, where no GPU is. Card 1's power reading is not supported (as
    on some boards), which the sampler must report, not fail on."""

    CARDS = [
        {"name": "NVIDIA H100 80GB HBM3", "gpu": 97, "mem": 58, "total": 85520809984, "used": 71245348864,
         "power_mw": 612345, "temp": 71},
        {"name": "NVIDIA H100 80GB HBM3", "gpu": 0, "mem": 0, "total": 85520809984, "used": 551550976,
         "power_mw": None, "temp": 34},
    ]

    def __init__(self, real, init_error: str | None = None):
        self._real = real
        self._init_error = init_error
        self.NVML_TEMPERATURE_GPU = real.NVML_TEMPERATURE_GPU
        self.NVMLError = real.NVMLError
        self.initialised = 0

    def nvmlInit(self):  # noqa: N802 - NVML's names
        if self._init_error:
            raise self._real.NVMLError(self._real.NVML_ERROR_DRIVER_NOT_LOADED)
        self.initialised += 1

    def nvmlShutdown(self):  # noqa: N802
        self.initialised -= 1

    def nvmlDeviceGetCount(self):  # noqa: N802
        return len(self.CARDS)

    def nvmlDeviceGetHandleByIndex(self, i):  # noqa: N802
        return self.CARDS[i]

    def nvmlDeviceGetName(self, h):  # noqa: N802
        return h["name"]

    def nvmlDeviceGetUtilizationRates(self, h):  # noqa: N802
        return self._real.c_nvmlUtilization_t(gpu=h["gpu"], memory=h["mem"])

    def nvmlDeviceGetMemoryInfo(self, h):  # noqa: N802
        return self._real.c_nvmlMemory_t(total=h["total"], free=h["total"] - h["used"], used=h["used"])

    def nvmlDeviceGetPowerUsage(self, h):  # noqa: N802
        if h["power_mw"] is None:
            raise self._real.NVMLError(self._real.NVML_ERROR_NOT_SUPPORTED)
        return h["power_mw"]

    def nvmlDeviceGetTemperature(self, h, sensor):  # noqa: N802
        assert sensor == self._real.NVML_TEMPERATURE_GPU
        return h["temp"]


def test_nvml_sampler_on_a_stand_in_library(monkeypatch):
    import pynvml as real

    nv = _StandInNvml(real)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    assert NvmlSampler.available() and NvmlSampler.load_error is None
    s = NvmlSampler()
    try:
        cards = s.sample()
        assert [c["card"] for c in cards] == [0, 1] and all(tuple(c) == CARD_KEYS for c in cards)
        busy, idle = cards
        assert busy["name"] == "NVIDIA H100 80GB HBM3" and busy["source"] == "nvml"
        assert busy["util_pct"] == 97.0 and busy["temp_c"] == 71.0
        assert busy["power_w"] == pytest.approx(612.345)
        assert busy["memory_total_mb"] == pytest.approx(85520809984 / 2**20, abs=1)
        assert busy["memory_used_mb"] == pytest.approx(71245348864 / 2**20, abs=1)
        assert idle["power_w"] is None and idle["util_pct"] == 0.0
        assert any("NVML power failed" in w for w in s.last_warnings), s.last_warnings
        sample = NodeSampler("gpu-node", s, {0: 0, 1: 1}).sample_once()
        assert sample["source"] == "nvml" and [c["ranks"] for c in sample["cards"]] == [[0], [1]]
    finally:
        s.close()
    assert nv.initialised == 0, "NVML was not shut down"
    monkeypatch.setitem(sys.modules, "pynvml", _StandInNvml(real, init_error="no driver"))
    assert not NvmlSampler.available() and "no NVIDIA driver" in NvmlSampler.load_error
    with pytest.raises(TelemetryUnavailable, match="NVML could not be initialised"):
        NvmlSampler()
