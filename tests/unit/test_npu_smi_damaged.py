"""Tests for the npu-smi output parser: damaged input (empty, cut short, rows out of place,
garbage, snapshots run together, very long lines), each read as far as it goes, with a
warning that says where."""

from __future__ import annotations

from npu_smi_cases import card, check_invariants, dicts, load

from mindpulse.node.npu_smi import MAX_WARNINGS, parse_npu_smi


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
