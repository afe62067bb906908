"""Tests for the npu-smi output parser.

Real captures live in ``tests/fixtures/npu-smi`` (see its README.md); layouts that exist
but have no capture there are synthesised below from the README's description.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mindpulse.node.npu_smi import (
    MAX_WARNINGS,
    NpuCard,
    ParseResult,
    merge_cards,
    parse_npu_smi,
)
from mindpulse.node.samplers.npu_smi import records_of_listing

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


def test_every_fixture_file_has_expected_values():
    files = sorted(p.name for p in FIXTURES.glob("*.txt"))
    assert files == sorted(EXPECTED_FIXTURES)


@pytest.mark.parametrize("name", sorted(EXPECTED_FIXTURES))
def test_fixture_parses_to_exact_values(name):
    result = parse_npu_smi(load(name))
    check_invariants(result)
    assert dicts(result) == EXPECTED_FIXTURES[name]
    assert result.warnings == []


@pytest.mark.parametrize("name", sorted(EXPECTED_FIXTURES))
def test_fixture_with_crlf_bytes_and_indent_changes_parses_the_same(name):
    text = load(name)
    expected = EXPECTED_FIXTURES[name]
    assert dicts(parse_npu_smi(text.replace("\n", "\r\n"))) == expected
    assert dicts(parse_npu_smi(text.encode())) == expected
    assert dicts(parse_npu_smi("\n\n" + text + "\n\n")) == expected


def test_merge_of_910b_key_value_forms_gives_one_card():
    parts = [parse_npu_smi(load(f"t_{kind}_910b.txt")) for kind in ("usages", "power", "temp")]
    merged = merge_cards(*parts, parse_npu_smi(load("t_board_910b.txt")))
    assert merged.warnings == []
    assert dicts(merged) == [
        kv_card(0, 0, name="IT21HMDC_Bin5", power_w=103.5, temp_c=39.0, aicore_pct=0.0,
                hbm_used_mb=3276.8, hbm_total_mb=65536.0, memory_used_mb=0.0,
                memory_total_mb=0.0, bus_id="0000:C1:00.0")
    ]


def test_merge_of_310b_key_value_forms_gives_one_card():
    names = ["t_usages_310b_200i_a2.txt", "t_power_310b_200i_a2.txt",
             "t_temp_310b_200i_a2.txt", "t_memory_310b_200i_a2.txt"]
    merged = merge_cards(*(parse_npu_smi(load(n)) for n in names))
    assert merged.warnings == []
    assert dicts(merged) == [
        kv_card(0, 0, power_w=9.1, temp_c=50.0, aicore_pct=0.0, memory_used_mb=3783.5,
                memory_total_mb=10810.0)
    ]


def test_merge_table_with_key_value_keeps_first_and_warns_on_conflict():
    table = parse_npu_smi(load("info_910b3_a2_8cards_busy.txt"))
    before = dicts(table)
    merged = merge_cards(table, parse_npu_smi(load("t_usages_910b.txt")))
    assert dicts(table) == before  # inputs untouched
    assert [(c.npu, c.chip) for c in merged.cards] == [(n, 0) for n in range(8)]
    first = merged.cards[0]
    assert first.hbm_used_mb == 62810.0  # the table came first
    assert len(first.processes) == 8
    assert any("hbm_used_mb" in w and "NPU 0 chip 0" in w for w in merged.warnings)


def test_merge_attaches_chipless_card_and_dedups_processes():
    proc = {"pid": 7, "name": "python", "memory_mb": 10.0}
    a = NpuCard(npu=1, chip=0, temp_c=40.0, processes=[dict(proc)])
    b = NpuCard(npu=1, chip=None, name="910B3", processes=[dict(proc)])
    c = NpuCard(npu=2, chip=None, power_w=80.0)
    merged = merge_cards([a], b, ParseResult([c], ["from elsewhere"]), "junk")
    assert [(x.npu, x.chip, x.name, x.temp_c, x.power_w) for x in merged.cards] == [
        (1, 0, "910B3", 40.0, None), (2, None, None, None, 80.0)]
    assert merged.cards[0].processes == [proc]
    assert "from elsewhere" in merged.warnings
    assert any("ignored a str" in w for w in merged.warnings)
    assert merge_cards().cards == []


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


def test_a3_two_chips_per_npu_with_phy_id():
    result = parse_npu_smi(A3_TABLE)
    check_invariants(result)
    assert result.warnings == []
    assert dicts(result) == [
        card(0, 0, "Ascend910", "OK", 171.5, 38.0, 52.0, 58012.0, 65536.0, 0.0, 0.0,
             "0000:9D:00.0", [(120341, "python3.9", 54321.0)], phy_id=0),
        card(0, 1, "Ascend910", "OK", None, 37.0, 49.0, 57960.0, 65536.0, 0.0, 0.0,
             "0000:9F:00.0", [(120342, None, 54300.0)], phy_id=1),
        card(1, 0, "Ascend910", "Warning", 180.2, 41.0, 0.0, 3413.0, 65536.0, 0.0, 0.0,
             "0000:99:00.0", phy_id=2),
        card(1, 1, "Ascend910", "OK", None, 40.0, 0.0, 3174.0, 65536.0, 0.0, 0.0,
             "0000:9B:00.0", phy_id=3),
    ]


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


def test_a3_in_container_with_masked_bus_and_squeezed_header():
    result = parse_npu_smi(A3_CONTAINER_TABLE)
    check_invariants(result)
    assert result.warnings == []
    assert dicts(result) == [
        card(4, 0, "Ascend910", "OK", 157.3, 32.0, 0.0, 3130.0, 65536.0, 0.0, 0.0, None,
             phy_id=8),
        card(4, 1, "Ascend910", "Alarm", None, 33.0, 0.0, 3131.0, 65536.0, 0.0, 0.0, None,
             [(998877, "mindspore_wo", 2048.0)], phy_id=9),
    ]


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


def test_driver_26_wide_columns_and_container_pid_column():
    result = parse_npu_smi(V26_TABLE)
    check_invariants(result)
    assert result.warnings == []
    assert dicts(result) == [
        card(0, 0, "910B3", "OK", 96.9, 36.0, 42.0, 52314.0, 65536.0, 0.0, 0.0, "0000:C1:00.0",
             [(1712733, "sglangschedul", 48954.0), (1712790, None, 151.0)]),
        card(1, 0, "910B3", "Alarm", 90.7, 37.0, 7.0, 53984.0, 65536.0, 0.0, 0.0, None,
             [(1712801, "python", 50112.0)]),
        card(2, 0, "910B3", "Critical", None, None, None, None, None, 0.0, 0.0, "0000:81:00.0"),
        card(3, 0, "910B3", "UNKNOWN", 88.0, 35.0, 0.0, 3402.0, 65536.0, 0.0, 0.0,
             "0000:82:00.0"),
    ]


def test_container_pid_column_in_the_middle_is_still_ignored():
    text = """\
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 153.7       45                0    / 0             |
| 0                         | 0000:C1:00.0  | 39          0    / 0          62810/ 65536         |
+===========================+===============+====================================================+
| NPU     Chip              | Process id    | Process id in container | Process name | Process memory(MB) |
| 0       0                 | 4242          | NA                      | train.py     | 1024               |
"""
    result = parse_npu_smi(text)
    assert result.warnings == []
    assert result.cards[0].processes == [{"pid": 4242, "name": "train.py", "memory_mb": 1024.0}]


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


def test_310p_chip_device_header_and_memory_only():
    result = parse_npu_smi(P310_TABLE)
    check_invariants(result)
    assert result.warnings == []
    # "Device" is the logical device id, not a physical id: phy_id stays None
    assert dicts(result) == [
        card(1, 0, "310P3", "OK", None, 51.0, 3.0, None, None, 1695.0, 21527.0, "0000:3B:00.0",
             [(3301, "infer_server", 620.0)]),
        card(1, 1, "310P3", "OK", None, 50.0, 0.0, None, None, 934.0, 21527.0, "0000:3B:00.0"),
        card(2, 0, "310P3", "OK", 15.4, 43.0, 0.0, None, None, 1070.0, 21534.0, None),
    ]


def test_blank_value_inside_a_cell_is_placed_by_header_alignment():
    text = """\
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 153.7                         0    / 0             |
| 0                         | 0000:C1:00.0  |             0    / 0          62810/ 65536         |
+===========================+===============+====================================================+
| 1                         | OK            |             44                0    / 0             |
| 0                         | 0000:C2:00.0  | 12          0    / 0                               |
+===========================+===============+====================================================+
"""
    result = parse_npu_smi(text)
    assert result.warnings == []
    assert dicts(result) == [
        card(0, 0, "910B3", "OK", 153.7, None, None, 62810.0, 65536.0, 0.0, 0.0, "0000:C1:00.0"),
        card(1, 0, None, "OK", None, 44.0, 12.0, None, None, 0.0, 0.0, "0000:C2:00.0"),
    ]


def test_masked_and_placeholder_values_are_none_without_warnings():
    text = """\
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     xxxxx               | -             | N/A         --                0    / 0             |
| 0                         | 0000:XX:xx.x  | ***         NA / NA           xxxx / 65536         |
+===========================+===============+====================================================+
"""
    result = parse_npu_smi(text)
    assert result.warnings == []
    assert dicts(result) == [
        card(0, 0, None, None, None, None, None, None, 65536.0, None, None, None)
    ]


def test_chip_with_unparseable_values_warns_per_value():
    text = """\
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
| 0     910B3               | Degraded      | 12.3.4      45                0    / 0             |
| 0                         | C1:00         | 39%         0    / 0          62810/ 65536         |
"""
    result = parse_npu_smi(text)
    assert dicts(result) == [
        card(0, 0, "910B3", "Degraded", None, 45.0, None, 62810.0, 65536.0, 0.0, 0.0, None)
    ]
    text_w = "\n".join(result.warnings)
    for needle in ("line 3: unexpected health value 'Degraded'", "line 3: Power(W)",
                   "line 4: bus id", "line 4: AICore(%)"):
        assert needle in text_w


def test_memory_units_in_headers_are_converted_to_mb():
    text = """\
| NPU   Name                | Health        | Power(mW)   Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(GB)  HBM-Usage(Blocks)    |
| 0     910B3               | OK            | 153700      45                0    / 0             |
| 0                         | 0000:C1:00.0  | 39          1    / 2          62810/ 65536         |
"""
    result = parse_npu_smi(text)
    assert dicts(result) == [
        card(0, 0, "910B3", "OK", 153.7, 45.0, 39.0, None, None, 1024.0, 2048.0, "0000:C1:00.0")
    ]
    assert result.warnings == ["line 4: unknown unit in 'HBM-Usage(Blocks)'"]


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


@pytest.mark.parametrize(
    "text, expected",
    [
        (KV_BOARD_CHIP, [kv_card(3, 0, name="910B3", bus_id="0000:82:00.0")]),
        (KV_MEMORY_910B, [kv_card(0, 0, hbm_total_mb=65536.0, memory_total_mb=0.0)]),
        (KV_COMMON, [kv_card(2, 0, aicore_pct=37.0, temp_c=47.0, power_w=210.5)]),
        (KV_HEALTH, [kv_card(5, 0, health="Alarm")]),
        (KV_USAGES_A3_CHIP1, [kv_card(4, 1, aicore_pct=55.0, hbm_used_mb=57671.68,
                                      hbm_total_mb=65536.0, memory_used_mb=0.0,
                                      memory_total_mb=0.0)]),
        (KV_TWO_CHIPS_LEADING, [kv_card(6, 0, temp_c=41.0), kv_card(6, 1, temp_c=44.0)]),
        (KV_TWO_CHIPS_TRAILING, [kv_card(6, 0, power_w=150.5), kv_card(6, 1)]),
    ],
    ids=["board-c", "memory-910b", "common", "health", "usages-a3-c1", "two-chips-leading",
         "two-chips-trailing"],
)
def test_key_value_layouts(text, expected):
    result = parse_npu_smi(text)
    check_invariants(result)
    assert dicts(result) == expected
    assert result.warnings == []


def test_key_value_unknown_keys_and_bad_values_warn():
    text = (
        "        NPU ID                         : 0\n"
        "        Chip ID                        : 0\n"
        "        Frobnication Level(%)          : 12\n"
        "        NPU Real-time Power(W)         : lots\n"
        "        NPU Temperature (C)            : 40\n"
        "        NPU Temperature (C)            : 41\n"
        "this line means nothing\n"
    )
    result = parse_npu_smi(text)
    assert dicts(result) == [kv_card(0, 0, temp_c=40.0)]
    w = "\n".join(result.warnings)
    assert "line 3: key 'Frobnication Level(%)' not recognised" in w
    assert "line 4: NPU Real-time Power(W): value 'lots' not understood" in w
    assert "line 6: NPU Temperature (C) given twice" in w
    assert "line 7: not understood: 'this line means nothing'" in w


def test_key_value_without_npu_id_or_values():
    result = parse_npu_smi("        NPU Real-time Power(W)         : 88.8\n")
    assert dicts(result) == [kv_card(None, None, power_w=88.8)]
    assert any("before any 'NPU ID'" in w for w in result.warnings)
    result = parse_npu_smi("        NPU ID                         : 9\n")
    assert dicts(result) == [kv_card(9, None)]
    assert any("NPU 9: no values recognised" in w for w in result.warnings)


def test_table_and_key_value_in_one_input_are_merged():
    text = load("info_910b4-1_masked_busid_partial.txt") + "\n" + KV_BOARD_CHIP.replace(
        ": 3", ": 1", 1)
    result = parse_npu_smi(text)
    check_invariants(result)
    assert [(c.npu, c.chip, c.name, c.bus_id) for c in result.cards] == [
        (0, 0, "910B4-1", None), (1, 0, "910B4-1", "0000:82:00.0")]
    assert any("name is '910B4-1' in one source and '910B3'" in w for w in result.warnings)


# ------------------------------------------------------ damaged table input


def test_empty_and_blank_input():
    for text in ("", "   \n\t\n", None, b"", "\n" * 1000):
        result = parse_npu_smi(text)
        assert result.cards == []
        assert result.warnings == ["empty input: no npu-smi output to parse"]


def test_non_text_input_does_not_raise():
    result = parse_npu_smi(12345)  # type: ignore[arg-type]
    check_invariants(result)
    assert result.cards == []


def test_row_cut_short_drops_only_the_partial_cell():
    text = load("info_910b4-1_masked_busid_partial.txt")
    cut = text[: text.index("88.1") + 2]  # "| 1     910B4-1 | OK | 88"
    result = parse_npu_smi(cut)
    check_invariants(result)
    assert dicts(result)[1] == card(1, None, "910B4-1", "OK", None, None, None, None, None,
                                    None, None, None)
    w = "\n".join(result.warnings)
    assert "line 10: row is cut short" in w
    assert "line 10: record of NPU 1 is incomplete" in w


def test_second_row_without_first_row():
    text = load("info_910b3_a2_8cards_busy.txt").splitlines()
    del text[6]  # first row of NPU 0
    result = parse_npu_smi("\n".join(text))
    assert dicts(result)[0]["npu"] is None
    assert dicts(result)[0]["bus_id"] == "0000:C1:00.0"
    assert any("second row of a chip record without its first row" in w
               for w in result.warnings)
    # its processes cannot be attached to it, so NPU 0 gets a card of its own
    assert any("not in the card table" in w for w in result.warnings)
    assert [c.npu for c in result.cards] == [None, 1, 2, 3, 4, 5, 6, 7, 0]


def test_rows_without_header_use_the_standard_layout():
    lines = load("info_910b3_a2_8cards_busy.txt").splitlines()
    body = "\n".join(lines[6:8])
    result = parse_npu_smi(body)
    assert dicts(result) == [dicts(parse_npu_smi("\n".join(lines)))[0] | {"processes": []}]
    assert any("before any header row" in w for w in result.warnings)


def test_unknown_column_and_garbage_rows_warn():
    text = """\
| NPU   Name                | Health        | Power(W)    Temp(C)           Fan(RPM)             |
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
| 0     910B3               | OK            | 153.7       45                1200                 |
| 0                         | 0000:C1:00.0  | 39          0    / 0          62810/ 65536         |
| hello | world |
+---- nonsense
"""
    result = parse_npu_smi(text)
    assert dicts(result) == [
        card(0, 0, "910B3", "OK", 153.7, 45.0, 39.0, 62810.0, 65536.0, 0.0, 0.0, "0000:C1:00.0")
    ]
    w = "\n".join(result.warnings)
    assert "line 1: unknown column 'Fan(RPM)' ignored" in w
    assert "line 5: row not understood" in w
    assert "line 6: not understood" in w


def test_concatenated_snapshots_warn_and_keep_processes_with_their_snapshot():
    text = load("info_910b3_a2_8cards_busy.txt")
    lines = text.splitlines(keepends=True)
    second = "".join(lines[:-3])  # without the last process row (pid 849 on NPU 7)
    result = parse_npu_smi(text + second)
    assert len(result.cards) == 16
    assert [len(c.processes) for c in result.cards] == [8] + [1] * 7 + [8] + [1] * 6 + [0]
    assert any("NPU 0 chip 0 is listed more than once" in w for w in result.warnings)


def test_very_long_line_is_skipped():
    text = load("info_910b4-1_masked_busid_partial.txt") + "| " + "9 " * 100_000 + "|\n"
    result = parse_npu_smi(text)
    assert len(result.cards) == 2
    assert any("line 12: 200003 characters long" in w for w in result.warnings)


def test_warnings_are_capped():
    result = parse_npu_smi("nonsense\n" * 5000)
    assert len(result.warnings) == MAX_WARNINGS + 1
    assert result.warnings[-1] == f"{5000 + 1 - MAX_WARNINGS} more warnings not shown"
    assert parse_npu_smi("x\n" * 50, max_warnings=3).warnings[-1] == "48 more warnings not shown"


# ------------------------------------------------------------------ formatting


def test_a_saved_listing_prints_as_the_card_table_with_what_mindpulse_reports(tmp_path, capsys):
    """`mindpulse telemetry parse-npu-smi FILE`: the records the sampler would report, in the
    card table every view prints (one renderer); --json keeps every field the parser read."""
    from mindpulse.launcher.cli import main

    cards = parse_npu_smi(A3_TABLE).cards[:2]
    recs = records_of_listing(cards)
    assert [(r["card"], r["util_pct"], r["memory_used_mb"], r["memory_total_mb"], r["power_w"], r["temp_c"])
            for r in recs] == [(0, 52.0, 58012.0, 65536.0, 171.5, 38.0), (1, 49.0, 57960.0, 65536.0, None, 37.0)]
    saved = tmp_path / "a3.txt"
    saved.write_text(A3_TABLE)
    assert main(["telemetry", "parse-npu-smi", str(saved)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["node", "card", "ranks", "util", "memory", "power", "W", "temp", "C", "health"], out
    assert out[2].split() == ["a3.txt", "0", "-", "52%", "58012/65536", "MB", "171.5", "38", "OK"], out
    assert out[3].split() == ["a3.txt", "1", "-", "49%", "57960/65536", "MB", "-", "37", "OK"], out
    usages = records_of_listing(parse_npu_smi(load("t_usages_910b.txt")).cards)
    assert usages[0]["memory_used_mb"] == 3276.8 and usages[0]["memory_total_mb"] == 65536.0, usages


def test_to_dict_has_exactly_the_contract_keys():
    assert list(NpuCard().to_dict()) == CARD_KEYS
    assert ParseResult().to_dict() == {"cards": [], "warnings": []}


# ------------------------------------------------------------ property tests

TABLE_FIXTURES = ["info_910b3_a2_8cards_busy.txt", "info_910b4-1_masked_busid_partial.txt"]
ALL_TEXTS = [load(n) for n in sorted(EXPECTED_FIXTURES)] + [
    A3_TABLE, A3_CONTAINER_TABLE, V26_TABLE, P310_TABLE, KV_COMMON, KV_TWO_CHIPS_TRAILING]

FAST = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _find(full: list[dict], c: dict) -> dict:
    matches = [f for f in full if f["npu"] == c["npu"] and c["chip"] in (None, f["chip"])]
    assert matches, c
    return matches[0]


def _assert_subset(c: dict, f: dict) -> None:
    """Every value read from a damaged input is the value the whole input gives."""
    for k in CARD_KEYS[:-1]:
        if c[k] is not None:
            assert c[k] == f[k], (k, c, f)
    assert len(c["processes"]) <= len(f["processes"])
    for p in c["processes"]:
        assert any(all(p[k] is None or p[k] == q[k] for k in p) for q in f["processes"])


@pytest.mark.parametrize("name", sorted(EXPECTED_FIXTURES))
def test_truncation_at_every_line(name):
    text = load(name)
    lines = text.splitlines(keepends=True)
    full = EXPECTED_FIXTURES[name]
    for n in range(len(lines) + 1):
        result = parse_npu_smi("".join(lines[:n]))
        check_invariants(result)
        for c in dicts(result):
            f = _find(full, c)
            _assert_subset(c, f)
            if name in TABLE_FIXTURES and {**c, "processes": []} != {**f, "processes": []}:
                assert any("incomplete" in w for w in result.warnings)


@pytest.mark.parametrize("name", TABLE_FIXTURES)
@FAST
@given(data=st.data())
def test_truncation_anywhere_in_a_table(name, data):
    text = load(name)
    cut = data.draw(st.integers(min_value=0, max_value=len(text)))
    result = parse_npu_smi(text[:cut])
    check_invariants(result)
    full = EXPECTED_FIXTURES[name]
    for c in dicts(result):
        _assert_subset(c, _find(full, c))


@FAST
@given(st.text(max_size=3000))
def test_random_text_never_raises(text):
    check_invariants(parse_npu_smi(text))


@FAST
@given(st.text(alphabet=st.sampled_from("|+-=:/ 0123456789.NAOKxChipBus\n"), max_size=3000))
def test_random_table_like_text_never_raises(text):
    check_invariants(parse_npu_smi(text))


@FAST
@given(st.lists(st.text(alphabet=st.characters(blacklist_characters="|+:",
                                               blacklist_categories=("Cs", "Cc", "Zl", "Zp")),
                        min_size=1, max_size=40), min_size=1, max_size=40))
def test_every_unstructured_line_gets_a_warning(lines):
    lines = [ln.replace("\n", " ").replace("\r", " ") for ln in lines]
    text = "\n".join(lines)
    result = parse_npu_smi(text)
    check_invariants(result)
    numbered = text.splitlines()
    for i, line in enumerate(numbered, 1):
        if line.strip():
            assert any(w.startswith(f"line {i}:") for w in result.warnings), (i, line)


@FAST
@given(st.binary(max_size=5000))
def test_random_bytes_never_raise(raw):
    check_invariants(parse_npu_smi(raw.decode("utf-8", errors="replace")))
    check_invariants(parse_npu_smi(raw))


@FAST
@given(st.sampled_from(ALL_TEXTS), st.randoms(use_true_random=False))
def test_shuffled_lines_never_raise(text, rnd):
    lines = text.splitlines()
    rnd.shuffle(lines)
    check_invariants(parse_npu_smi("\n".join(lines)))


@FAST
@given(st.sampled_from(ALL_TEXTS), st.binary(min_size=1, max_size=200),
       st.integers(min_value=0))
def test_fixture_with_garbage_spliced_in_never_raises(text, junk, where):
    where %= len(text) + 1
    spliced = text[:where] + junk.decode("utf-8", errors="replace") + text[where:]
    check_invariants(parse_npu_smi(spliced))


ALL_LINES = sorted({ln for t in ALL_TEXTS for ln in t.splitlines()})


@FAST
@given(st.lists(st.sampled_from(ALL_LINES), max_size=80))
def test_lines_mixed_from_all_layouts_never_raise(lines):
    check_invariants(parse_npu_smi("\n".join(lines)))


# Round trip: render random cards in each table layout, parse, get the same values back.

LAYOUTS = {
    # name: (cell widths, first-cell sub-width, third-cell sub-widths, chip header, hbm,
    #        container pid column)
    "a2": ((27, 15, 52), 6, (12, 18), "Chip", True, False),
    "a3": ((27, 15, 52), 6, (12, 18), "Chip  Phy-ID", True, False),
    "26x": ((27, 15, 70), 6, (21, 24), "Chip", True, True),
    "310p": ((31, 17, 54), 8, (13, 17), "Chip    Device", False, False),
}
NULLS = ["-", "NA", "N/A"]

values_st = st.fixed_dictionaries({
    "name": st.sampled_from(["910B3", "910B4-1", "Ascend910", "310P3", "910B2C", None]),
    "health": st.sampled_from(["OK", "Warning", "Alarm", "Critical", "UNKNOWN", None]),
    "power": st.one_of(st.none(), st.integers(0, 9999).map(lambda x: x / 10)),
    "temp": st.one_of(st.none(), st.integers(-20, 130)),
    "aicore": st.one_of(st.none(), st.integers(0, 100)),
    "mem": st.one_of(st.none(), st.tuples(st.integers(0, 99999), st.integers(0, 99999))),
    "hbm": st.one_of(st.none(), st.tuples(st.integers(0, 99999), st.integers(0, 99999))),
    "bus": st.one_of(st.none(), st.integers(0, 255).map(lambda b: f"0000:{b:02X}:00.0")),
    "phy": st.integers(0, 999),
    "procs": st.lists(st.tuples(st.integers(1, 4_194_304),
                                st.text("abcdefghijklmnopqrstuvwxyz0123456789/._-", max_size=15),
                                st.integers(0, 99999)), max_size=3),
})


def _num(v, rnd):
    return rnd.choice(NULLS) if v is None else str(v)


def _pair(p, rnd):
    if p is None:
        return rnd.choice(["NA   / NA", "-    / -"])
    return f"{p[0]:<5}/ {p[1]}"


def _cell(parts, widths, total):
    text = " " + "".join(p.ljust(w) for p, w in zip(parts[:-1], widths)) + parts[-1]
    return text.ljust(total)


def render_table(cards, layout, rnd):
    (w1, w2, w3), s1, (sa, sb), chip_hdr, hbm, container = LAYOUTS[layout]
    sep = "+" + "+".join("=" * w for w in (w1, w2, w3)) + "+"

    def row(c1, c2, c3):
        return f"|{c1}|{c2}|{c3}|"

    out = [row(_cell(["NPU", "Name"], [s1], w1), _cell(["Health"], [], w2),
               _cell(["Power(W)", "Temp(C)", "Hugepages-Usage(page)"], [sa, sb], w3)),
           row(_cell(chip_hdr.split(None, 1) if " " in chip_hdr else [chip_hdr], [s1], w1),
               _cell(["Bus-Id"], [], w2),
               _cell(["AICore(%)", "Memory-Usage(MB)"] + (["HBM-Usage(MB)"] if hbm else []),
                     [sa, sb], w3)),
           sep]
    for c in cards:
        out.append(row(_cell([str(c["npu"]), c["name"] or rnd.choice(NULLS)], [s1], w1),
                       _cell([c["health"] or rnd.choice(NULLS)], [], w2),
                       _cell([_num(c["power"], rnd), _num(c["temp"], rnd), "0    / 0"],
                             [sa, sb], w3)))
        first = [str(c["chip"])] + ([str(c["phy"])] if " " in chip_hdr else [])
        third = [_num(c["aicore"], rnd), _pair(c["mem"], rnd)]
        if hbm:
            third.append(_pair(c["hbm"], rnd))
        out.append(row(_cell(first, [s1], w1), _cell([c["bus"] or "NA"], [], w2),
                       _cell(third, [sa, sb], w3)))
        out.append(sep)
    names = ["NPU     Chip", "Process id", "Process name", "Process memory(MB)"]
    widths = [w1, w2, 20, 23] + ([25] if container else [])
    hdr = [f" {names[0]}", f" {names[1]}", f" {names[2]}", f" {names[3]}"]
    if container:
        hdr.append(" Process id in container")
    out.append("|" + "|".join(h.ljust(w) for h, w in zip(hdr, widths)) + "|")
    out.append(sep)
    for c in cards:
        if not c["procs"]:
            out.append(f"| No running processes found in NPU {c['npu']}".ljust(w1 + w2 + w3 + 2)
                       + "|")
        for pid, name, mem in c["procs"]:
            cells = [f" {c['npu']:<8}{c['chip']}", f" {pid}", f" {name}", f" {mem}"]
            if container:
                cells.append(" " + rnd.choice(["NA", str(pid % 1000)]))
            out.append("|" + "|".join(x.ljust(w) for x, w in zip(cells, widths)) + "|")
        out.append(sep)
    return "\n".join(out) + "\n"


def expected_dict(c, layout):
    hbm = LAYOUTS[layout][4]
    mem = c["mem"] or (None, None)
    hb = (c["hbm"] or (None, None)) if hbm else (None, None)
    f = lambda v: None if v is None else float(v)  # noqa: E731
    return card(c["npu"], c["chip"], c["name"], c["health"], f(c["power"]), f(c["temp"]),
                f(c["aicore"]), f(hb[0]), f(hb[1]), f(mem[0]), f(mem[1]), c["bus"],
                [(pid, None if name.lower() in ("", "-", "--", "---", "na", "n/a") else name,
                  float(mem_)) for pid, name, mem_ in c["procs"]],
                phy_id=c["phy"] if layout == "a3" else None)


@FAST
@given(st.sampled_from(sorted(LAYOUTS)), st.lists(values_st, min_size=1, max_size=6),
       st.randoms(use_true_random=False))
def test_rendered_tables_round_trip(layout, values, rnd):
    cards = []
    for i, v in enumerate(values):
        npu, chip = (i // 2, i % 2) if layout in ("a3", "310p") else (i, 0)
        cards.append({**v, "npu": npu, "chip": chip})
    text = render_table(cards, layout, rnd)
    result = parse_npu_smi(text)
    check_invariants(result)
    assert result.warnings == [], text
    assert dicts(result) == [expected_dict(c, layout) for c in cards], text


def test_five_megabyte_inputs_parse_whole():
    """A 5 MB table and 5 MB of garbage: every card of every copy, nothing raised. How fast is
    the benchmark's to say (bench/npu_smi_parse.py, docs/benchmarks.md), not a timed assert's."""
    table = load("info_910b3_a2_8cards_busy.txt")
    reps = 5_000_000 // len(table)
    result = parse_npu_smi(table * reps)
    check_invariants(result)
    assert len(result.cards) == 8 * reps
    # each copy's process table goes to the cards printed just above it
    assert [len(c.processes) for c in result.cards] == [8, 1, 1, 1, 1, 1, 1, 1] * reps

    rnd = random.Random(5)
    garbage = rnd.randbytes(5_000_000).decode("utf-8", errors="replace")
    check_invariants(parse_npu_smi(garbage))
