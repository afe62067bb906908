"""What the npu-smi parser's tests share: the expected cards of every real capture in
``tests/fixtures/npu-smi`` (see its README.md), the layouts that exist but have no capture
there (synthesised from the README's description), and the checks any parse result must pass.
"""

from __future__ import annotations

import json
from pathlib import Path

from mindpulse.node.npu_smi import MAX_WARNINGS, NpuCard, ParseResult

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "npu-smi"

CARD_KEYS = [
    "npu", "chip", "phy_id", "name", "health", "power_w", "temp_c", "aicore_pct",
    "hbm_used_mb", "hbm_total_mb", "memory_used_mb", "memory_total_mb", "bus_id", "processes",
]


def load(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def card(
    npu, chip, name, health, power, temp, aicore, hbm_used, hbm_total, mem_used, mem_total,
    bus, processes=(), phy_id=None,
) -> dict:
    """Expected ``NpuCard.to_dict()``; arguments in the order the table prints them."""
    return {
        "npu": npu, "chip": chip, "phy_id": phy_id, "name": name, "health": health,
        "power_w": power, "temp_c": temp, "aicore_pct": aicore,
        "hbm_used_mb": hbm_used, "hbm_total_mb": hbm_total,
        "memory_used_mb": mem_used, "memory_total_mb": mem_total, "bus_id": bus,
        "processes": [{"pid": p, "name": n, "memory_mb": m} for p, n, m in processes],
    }


def kv_card(npu, chip, **fields) -> dict:
    """Expected card of a key:value form: everything not given is None."""
    d = {k: None for k in CARD_KEYS}
    d.update(npu=npu, chip=chip, processes=[])
    d.update(fields)
    return d


def dicts(result: ParseResult) -> list[dict]:
    return [c.to_dict() for c in result.cards]


def check_invariants(result: ParseResult) -> None:
    """What must hold for any input whatsoever."""
    assert isinstance(result, ParseResult)
    assert isinstance(result.cards, list) and isinstance(result.warnings, list)
    assert all(isinstance(w, str) and w for w in result.warnings)
    assert len(result.warnings) <= MAX_WARNINGS + 1
    assert not any("internal" in w for w in result.warnings), result.warnings
    if not result.cards:
        assert result.warnings, "no cards and no warning"
    for c in result.cards:
        assert isinstance(c, NpuCard)
        d = c.to_dict()
        assert list(d) == CARD_KEYS
        for k in ("npu", "chip", "phy_id"):
            assert d[k] is None or type(d[k]) is int
        for k in ("power_w", "temp_c", "aicore_pct", "hbm_used_mb", "hbm_total_mb",
                  "memory_used_mb", "memory_total_mb"):
            assert d[k] is None or type(d[k]) is float
        for k in ("name", "health", "bus_id"):
            assert d[k] is None or type(d[k]) is str
        for p in d["processes"]:
            assert list(p) == ["pid", "name", "memory_mb"]
            assert p["pid"] is None or type(p["pid"]) is int
            assert p["name"] is None or type(p["name"]) is str
            assert p["memory_mb"] is None or type(p["memory_mb"]) is float
    json.dumps(result.to_dict(), allow_nan=False)



# ----------------------------------------------------------------- real captures

PYTH = "/usr/local/pyth"  # process names are cut to the column width by npu-smi

EXPECTED_FIXTURES: dict[str, list[dict]] = {
    "info_910b3_a2_8cards_busy.txt": [
        card(0, 0, "910B3", "OK", 153.7, 45.0, 39.0, 62810.0, 65536.0, 0.0, 0.0, "0000:C1:00.0",
             [(849, PYTH, 117.0), (842, PYTH, 59017.0), (843, PYTH, 117.0), (844, PYTH, 117.0),
              (845, PYTH, 117.0), (846, PYTH, 117.0), (847, PYTH, 117.0), (848, PYTH, 117.0)]),
        card(1, 0, "910B3", "OK", 155.2, 44.0, 39.0, 62697.0, 65536.0, 0.0, 0.0, "0000:C2:00.0",
             [(843, PYTH, 59363.0)]),
        card(2, 0, "910B3", "OK", 144.7, 43.0, 38.0, 62697.0, 65536.0, 0.0, 0.0, "0000:81:00.0",
             [(844, PYTH, 59363.0)]),
        card(3, 0, "910B3", "OK", 155.3, 43.0, 35.0, 62698.0, 65536.0, 0.0, 0.0, "0000:82:00.0",
             [(845, PYTH, 59363.0)]),
        card(4, 0, "910B3", "OK", 162.2, 52.0, 35.0, 62697.0, 65536.0, 0.0, 0.0, "0000:01:00.0",
             [(846, PYTH, 59363.0)]),
        card(5, 0, "910B3", "OK", 158.6, 52.0, 36.0, 62698.0, 65536.0, 0.0, 0.0, "0000:02:00.0",
             [(847, PYTH, 59363.0)]),
        card(6, 0, "910B3", "OK", 160.1, 50.0, 38.0, 62697.0, 65536.0, 0.0, 0.0, "0000:41:00.0",
             [(848, PYTH, 59363.0)]),
        card(7, 0, "910B3", "OK", 167.5, 67.0, 34.0, 62698.0, 65536.0, 0.0, 0.0, "0000:42:00.0",
             [(849, PYTH, 59363.0)]),
    ],
    # bus ids were masked by the reporter (0000:xx:00.0): they read as unknown
    "info_910b4-1_masked_busid_partial.txt": [
        card(0, 0, "910B4-1", "OK", 91.3, 33.0, 0.0, 3197.0, 65536.0, 0.0, 0.0, None),
        card(1, 0, "910B4-1", "OK", 88.1, 32.0, 0.0, 3197.0, 65536.0, 0.0, 0.0, None),
    ],
    # board info has no chip name, only the board's product name
    "t_board_910b.txt": [kv_card(0, 0, name="IT21HMDC_Bin5", bus_id="0000:C1:00.0")],
    # "Capacity(MB)" (usable, 10810) is the total, not "Total Capacity(MB)" (12288)
    "t_memory_310b_200i_a2.txt": [kv_card(0, 0, memory_total_mb=10810.0)],
    # "Power Dissipation(W)" (16.9) is the rated figure, not the reading
    "t_power_310b_200i_a2.txt": [kv_card(0, 0, power_w=9.1)],
    "t_power_910b.txt": [kv_card(0, 0, power_w=103.5)],
    # LM75*/TEC sensors are board sensors, not the chip temperature
    "t_temp_310b_200i_a2.txt": [kv_card(0, 0, temp_c=50.0)],
    "t_temp_910b.txt": [kv_card(0, 0, temp_c=39.0)],
    # usages only give rates: used = capacity * rate / 100 (10810 * 35% = 3783.5)
    "t_usages_310b_200i_a2.txt": [
        kv_card(0, 0, aicore_pct=0.0, memory_used_mb=3783.5, memory_total_mb=10810.0)
    ],
    # 65536 * 5% = 3276.8; the DDR pair of a 910B is 0 / 0 as in the table
    "t_usages_910b.txt": [
        kv_card(0, 0, aicore_pct=0.0, hbm_used_mb=3276.8, hbm_total_mb=65536.0,
                memory_used_mb=0.0, memory_total_mb=0.0)
    ],
}



# ---------------------------------------------- layouts known but not captured

# Atlas A3: two chips per NPU, a Chip/Phy-ID header, name Ascend910, "-" as the second
# chip's power (the NPU's power is reported on chip 0).
A3_TABLE = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 25.0.rc1.1               Version: 25.0.rc1.1                                           |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip  Phy-ID              | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     Ascend910           | OK            | 171.5       38                0    / 0             |
| 0     0                   | 0000:9D:00.0  | 52          0    / 0          58012/ 65536         |
+---------------------------+---------------+----------------------------------------------------+
| 0     Ascend910           | OK            | -           37                0    / 0             |
| 1     1                   | 0000:9F:00.0  | 49          0    / 0          57960/ 65536         |
+===========================+===============+====================================================+
| 1     Ascend910           | Warning       | 180.2       41                0    / 0             |
| 0     2                   | 0000:99:00.0  | 0           0    / 0          3413 / 65536         |
+---------------------------+---------------+----------------------------------------------------+
| 1     Ascend910           | OK            | -           40                0    / 0             |
| 1     3                   | 0000:9B:00.0  | 0           0    / 0          3174 / 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| 0       0                 | 120341        | python3.9                | 54321                   |
| 0       1                 | 120342        |                          | 54300                   |
+===========================+===============+====================================================+
| No running processes found in NPU 1                                                            |
+===========================+===============+====================================================+
"""


# A3 as printed in a container (vendor manual style): header cells narrower than the
# separators, the process header squeezed, "Process id in container" last.
A3_CONTAINER_TABLE = """\
+-----------------------------------------------------------------------------------------------+
| npu-smi 25.2.0                     Version: 25.2.0                                            |
+---------------------------+---------------+---------------------------------------------------+
| NPU   Name         | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)      |
| Chip  Phy-ID       | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)              |
+===========================+===============+===================================================+
| 4     Ascend910    | OK            | 157.3       32                0    / 0                   |
| 0     8            | 0000:xx:00.0  | 0           0        / 0      3130 / 65536               |
+---------------------------+---------------+---------------------------------------------------+
| 4     Ascend910    | Alarm         | -           33                0    / 0                   |
| 1     9            | 0000:xx:00.0  | 0           0        / 0      3131 / 65536               |
+===========================+---------------+===================================================+
+---------------------------+---------------+---------------------------------------------------+
| NPU     Chip       | Process id    | Process name| Process memory(MB) |Process id in container|
+===========================+===============+===================================================+
| 4       1          | 998877        | mindspore_wo| 2048               | 12                    |
+===========================+===============+===================================================+
"""


# Driver 26.x: wider columns, process table with "Process id in container" (often NA),
# idle cards listed as "No running processes found in NPU N", NA values on a faulty card.
V26_TABLE = """\
+--------------------------------------------------------------------------------------------------------------------+
| npu-smi 26.0.rc1                 Version: 26.0.rc1                                                                 |
+---------------------------+---------------+----------------------------------------------------------------------+
| NPU   Name                | Health        | Power(W)             Temp(C)                 Hugepages-Usage(page)   |
| Chip                      | Bus-Id        | AICore(%)            Memory-Usage(MB)        HBM-Usage(MB)           |
+===========================+===============+======================================================================+
| 0     910B3               | OK            | 96.9                 36                      0    / 0                |
| 0                         | 0000:C1:00.0  | 42                   0    / 0                52314/ 65536            |
+===========================+===============+======================================================================+
| 1     910B3               | Alarm         | 90.7                 37                      0    / 0                |
| 0                         | 0000:xx:00.0  | 7                    0    / 0                53984/ 65536            |
+===========================+===============+======================================================================+
| 2     910B3               | Critical      | NA                   NA                      0    / 0                |
| 0                         | 0000:81:00.0  | NA                   0    / 0                NA   / NA               |
+===========================+===============+======================================================================+
| 3     910B3               | UNKNOWN       | 88.0                 35                      0    / 0                |
| 0                         | 0000:82:00.0  | 0                    0    / 0                3402 / 65536            |
+===========================+===============+======================================================================+
+---------------------------+---------------+----------------------------------------------------------------------+
| NPU     Chip              | Process id    | Process name       | Process memory(MB)    | Process id in container |
+===========================+===============+======================================================================+
| 0       0                 | 1712733       | sglangschedul      | 48954                 | NA                      |
| 0       0                 | 1712790       |                    | 151                   | 4021                    |
+===========================+===============+======================================================================+
| 1       0                 | 1712801       | python             | 50112                 | 57                      |
+===========================+===============+======================================================================+
| No running processes found in NPU 2                                                                              |
+===========================+===============+======================================================================+
| No running processes found in NPU 3                                                                              |
+===========================+===============+======================================================================+
"""


# 310P (Atlas 300I Duo): "Chip Device" header, Memory-Usage only (no HBM pair), NA power,
# one NPU id with two chips.
P310_TABLE = """\
+--------------------------------------------------------------------------------------------------------+
| npu-smi 23.0.0                                   Version: 23.0.0                                       |
+-------------------------------+-----------------+------------------------------------------------------+
| NPU     Name                  | Health          | Power(W)     Temp(C)           Hugepages-Usage(page) |
| Chip    Device                | Bus-Id          | AICore(%)    Memory-Usage(MB)                        |
+===============================+=================+======================================================+
| 1       310P3                 | OK              | NA           51                0     / 0             |
| 0       0                     | 0000:3B:00.0    | 3            1695 / 21527                            |
+-------------------------------+-----------------+------------------------------------------------------+
| 1       310P3                 | OK              | NA           50                0     / 0             |
| 1       1                     | 0000:3B:00.0    | 0            934  / 21527                            |
+===============================+=================+======================================================+
| 2       310P3                 | OK              | 15.4         43                0     / 0             |
| 0       2                     | NA              | 0            1070 / 21534                            |
+===============================+=================+======================================================+
+-------------------------------+-----------------+------------------------------------------------------+
| NPU     Chip                  | Process id      | Process name             | Process memory(MB)        |
+===============================+=================+======================================================+
| 1       0                     | 3301            | infer_server             | 620                       |
+===============================+=================+======================================================+
| No running processes found in NPU 2                                                                    |
+===============================+=================+======================================================+
"""


# ---------------------------------------------------------- key:value layouts

KV_BOARD_CHIP = """\
        NPU ID                         : 3
        Chip ID                        : 0
        Chip Type                      : Ascend
        Chip Name                      : 910B3
        Chip Version                   : V1
        Board ID                       : 0x65
        PCB ID                         : NA
        BOM ID                         : 1
        VDie ID                        : 2A2E2E23 20D00004 18ED5FAB 14100A01 1C0E1A00
        NDie ID                        : 0A2E2E23 20D00004 18ED5FAB 14100A01 1C0E1A00
        Chip Position ID               : 3
        PCIe Bus Info                  : 0000:82:00.0
        Firmware Version               : 7.1.0.5.220
"""

KV_MEMORY_910B = """\
        NPU ID                         : 0
        Chip Count                     : 1

        DDR Capacity(MB)               : 0
        DDR Clock Speed(MHz)           : 0
        HBM Capacity(MB)               : 65536
        HBM Clock Speed(MHz)           : 1600
        HBM Temperature(C)             : 36
        HBM Manufacturer ID            : 0x41
        Chip ID                        : 0
"""

# -t common: values of the board MCU follow "Chip Name : mcu" and must not win
KV_COMMON = """\
        NPU ID                         : 2
        Chip Count                     : 1

        Chip ID                        : 0
        Memory Usage Rate(%)           : 0
        HBM Usage Rate(%)              : 91
        Aicore Usage Rate(%)           : 37
        Aicore Freq(MHZ)               : 1800
        Aicore curFreq(MHZ)            : 1800
        Aicore Count                   : 24
        Temperature(C)                 : 47
        NPU Real-time Power(W)         : 210.5

        Chip Name                      : mcu
        Temperature(C)                 : 33
"""

KV_HEALTH = """\
        NPU ID                         : 5
        Chip Count                     : 1
        Chip ID                        : 0
        Health Status                  : Alarm
        Error Code                     : 803C8406
        Error Information              : node type=AICORE, sensor type=Temperature: high
"""

# A3, -t usages -i 4 -c 1: 910B-style order with "Chip ID" after the values
KV_USAGES_A3_CHIP1 = """\
        NPU ID                         : 4
        Chip Count                     : 2

        DDR Capacity(MB)               : 0
        DDR Usage Rate(%)              : 0
        HBM Capacity(MB)               : 65536
        HBM Usage Rate(%)              : 88
        Aicore Usage Rate(%)           : 55
        Aivector Usage Rate(%)         : 12
        Chip ID                        : 1
"""

# two chips in one listing, "Chip ID" first (310B order) ...
KV_TWO_CHIPS_LEADING = """\
        NPU ID                         : 6
        Chip Count                     : 2

        Chip ID                        : 0
        NPU Temperature (C)            : 41
        Chip ID                        : 1
        NPU Temperature (C)            : 44
        LM75A_TE (C)                   : 36
        Chip Name                      : MCU
"""

# ... and "Chip ID" last (910B order)
KV_TWO_CHIPS_TRAILING = """\
        NPU ID                         : 6
        Chip Count                     : 2

        NPU Real-time Power(W)         : 150.5
        Chip ID                        : 0

        NPU Real-time Power(W)         : NA
        Chip ID                        : 1
"""
