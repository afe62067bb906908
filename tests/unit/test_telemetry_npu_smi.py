"""Tests for the npu-smi telemetry sampler, alone and under the node sampler.

No Ascend hardware here: ``npu-smi`` is replaced by a shell script written into tmp_path
(fake_npu_smi.py) that prints the real captures of ``tests/fixtures/npu-smi`` for the
arguments it gets. The fixtures have no ``-t memory`` capture of a 910B board; for that one
query the script prints a short listing synthesised from keys the parser knows.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fake_npu_smi import SET_310B, SET_910B, assert_no_overlap, gone, make_fake_npu_smi, read_log

from mindpulse.node.samplers import npu_smi as npu_smi_sampler
from mindpulse.node.telemetry import (
    CARD_KEYS,
    NodeSampler,
    NpuSmiSampler,
    telemetry_packet,
)
from mindpulse.wire.protocol import TelemetryPacket, decode

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def lock_path(tmp_path):
    return str(tmp_path / "npu-smi.lock")


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



# -------------------------------------------------------------- under the node sampler


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
