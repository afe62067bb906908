"""Tests for the library-backed telemetry samplers: DCMI (Ascend's libdcmi.so) and NVML
(NVIDIA's), each on a stand-in library whose calls return what the real one reports, so their
reading and unit conversions run where no card is; the NVML test on real GPUs runs only where
NVML works."""

from __future__ import annotations

import ctypes
import sys

import pytest

from mindpulse.node.samplers import dcmi as dcmi_sampler
from mindpulse.node.telemetry import (
    CARD_KEYS,
    DcmiSampler,
    NodeSampler,
    NvmlSampler,
    TelemetryUnavailable,
)

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
