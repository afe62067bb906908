"""Tests for the per-node telemetry samplers: the card record, the psutil sampler, the node
sampler over any source (a stub here), and the choice of a source on this machine.

The npu-smi sampler is tested in test_telemetry_npu_smi.py (with a fake ``npu-smi`` that
prints the real captures), the DCMI and NVML ones on stand-in libraries in
test_telemetry_dcmi_nvml.py. The psutil path runs for real.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
from fake_npu_smi import SET_910B, make_fake_npu_smi

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
from mindpulse.wire.protocol import decode

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
