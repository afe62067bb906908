"""Tests for the npu-smi output parser: the real captures.

Real captures live in ``tests/fixtures/npu-smi`` (see its README.md); their expected cards are
in ``npu_smi_cases.py``. The layouts with no capture are tested in test_npu_smi_layouts.py,
damaged input in test_npu_smi_damaged.py, and properties of any input in
test_npu_smi_properties.py.
"""

from __future__ import annotations

import pytest
from npu_smi_cases import (
    A3_TABLE,
    CARD_KEYS,
    EXPECTED_FIXTURES,
    FIXTURES,
    check_invariants,
    dicts,
    kv_card,
    load,
)

from mindpulse.node.npu_smi import NpuCard, ParseResult, merge_cards, parse_npu_smi
from mindpulse.node.samplers.npu_smi import records_of_listing


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
