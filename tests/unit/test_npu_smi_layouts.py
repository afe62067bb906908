"""Tests for the npu-smi output parser: the layouts npu-smi prints that have no capture in
``tests/fixtures/npu-smi`` (their texts, synthesised from its README, are in
``npu_smi_cases.py``), table and key:value alike."""

from __future__ import annotations

import pytest
from npu_smi_cases import (
    A3_CONTAINER_TABLE,
    A3_TABLE,
    KV_BOARD_CHIP,
    KV_COMMON,
    KV_HEALTH,
    KV_MEMORY_910B,
    KV_TWO_CHIPS_LEADING,
    KV_TWO_CHIPS_TRAILING,
    KV_USAGES_A3_CHIP1,
    P310_TABLE,
    V26_TABLE,
    card,
    check_invariants,
    dicts,
    kv_card,
    load,
)

from mindpulse.node.npu_smi import parse_npu_smi

# ---------------------------------------------------------------- tables


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
