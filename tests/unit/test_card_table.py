"""The console's card table: a row per card up to MAX_CARD_ROWS; above, the cards worth a
look (hottest, most power-hungry, fullest, idlest, unhealthy) and one line over all."""

from __future__ import annotations

import random

from mindpulse.reporting.tables import CARD_ROWS_PER_KIND, MAX_CARD_ROWS, card_table


def _cards(nodes: int, per_node: int = 8) -> list[dict]:
    rnd = random.Random(7)
    return [{"node": f"node{n}-h{n}", "card": c, "ranks": [n * per_node + c], "util_pct": 90.0 + rnd.random(),
             "memory_used_mb": 30000.0 + rnd.random(), "memory_total_mb": 65536.0, "power_w": 300.0 + rnd.random(),
             "temp_c": 55.0 + rnd.random(), "health": "OK"} for n in range(nodes) for c in range(per_node)]


def test_a_small_cluster_gets_a_row_per_card():
    cards = _cards(MAX_CARD_ROWS // 8)
    text = card_table(cards)
    assert len(text.splitlines()) == 2 + len(cards), text
    assert "more cards" not in text


def test_a_big_cluster_lists_the_cards_worth_a_look_and_one_line_over_all():
    cards = _cards(512)  # 4,096 cards
    cards[1234].update(temp_c=97.0)
    cards[2345].update(util_pct=0.0)
    cards[3456].update(health="Alarm")
    cards[77].update(memory_used_mb=65000.0)
    text = card_table(cards)
    lines = text.splitlines()
    rows = lines[2:-1]
    assert len(rows) <= 5 * CARD_ROWS_PER_KIND, f"{len(rows)} rows"
    listed = {(r.split()[0], int(r.split()[1])) for r in rows}
    for i in (1234, 2345, 3456, 77):
        assert (cards[i]["node"], cards[i]["card"]) in listed, f"card {i} is worth a row: {cards[i]}"
    assert lines[-1].startswith(f"{len(cards) - len(rows):,} more cards not listed"), lines[-1]
    assert "temp 55/" in lines[-1] and "/97 C" in lines[-1] and "util 0/" in lines[-1], lines[-1]


def test_the_worst_health_is_listed_before_unknown_and_infinities_stay_out_of_the_line():
    cards = _cards(100)  # 800 cards
    for c in cards[:100]:
        c["health"] = "UNKNOWN"
    cards[90]["health"] = "Critical"
    cards[500]["temp_c"] = float("inf")
    text = card_table(cards)
    listed = {(r.split()[0], int(r.split()[1])) for r in text.splitlines()[2:-1]}
    assert (cards[90]["node"], cards[90]["card"]) in listed, "a Critical card is always worth a row"
    assert "inf" not in text.splitlines()[-1] and "nan" not in text.splitlines()[-1], text.splitlines()[-1]
