"""Tests for the npu-smi output parser: what holds for any input (hypothesis): cut anywhere,
random text and bytes, lines shuffled and mixed, garbage spliced in, random cards rendered in
each table layout and read back, and 5 MB inputs."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from npu_smi_cases import (
    A3_CONTAINER_TABLE,
    A3_TABLE,
    CARD_KEYS,
    EXPECTED_FIXTURES,
    KV_COMMON,
    KV_TWO_CHIPS_TRAILING,
    P310_TABLE,
    V26_TABLE,
    card,
    check_invariants,
    dicts,
    load,
)

from mindpulse.node.npu_smi import parse_npu_smi

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
