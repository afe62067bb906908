"""The shared formatters: one rule per kind of value, and the differences the views keep on
purpose (a console table's fixed format, a report's scientific notation at the extremes)."""

from __future__ import annotations

import datetime as dt
import math

import pytest

from mindpulse.common import formatting as fmt


def test_missing_is_a_dash_and_a_broken_figure_stays_visible():
    for f in (fmt.number, fmt.metric, fmt.cell, fmt.general):
        assert f(None) == "-"
        assert f(math.nan) == "nan" and f(math.inf) == "inf" and f(-math.inf) == "-inf"
    assert fmt.number("nan") == "nan", "text read back from JSON is shown as it is"
    assert fmt.number(True) == "True" and fmt.metric(False) == "False", "a flag is not a number"
    assert fmt.is_number(3) and fmt.is_number(0.5)
    assert not any(fmt.is_number(x) for x in (True, None, "1", math.nan, math.inf))


def test_number_keeps_its_format_and_metric_goes_scientific_at_the_extremes():
    assert fmt.number(2) == "2.0000" and fmt.number(2.16694, ".3f") == "2.167"
    assert fmt.number(2e-7) == "0.0000" and fmt.number(3e9, ".1f") == "3000000000.0"
    assert fmt.metric(2e-7) == "2.000e-07" and fmt.metric(3e9) == "3.000e+09"
    assert fmt.metric(0.0) == "0.0000" and fmt.metric(0.001) == "0.0010" and fmt.metric(999999.0) == "999999.0000"
    assert fmt.metric(2, ".2f") == "2.00", "an int metric gets its decimals"
    assert fmt.general(0.000123) == "0.000123" and fmt.general(1e6) == "1e+06" and fmt.general(7) == "7"


def test_cell_formats_floats_and_shows_everything_else_as_it_is():
    assert fmt.cell(2.5) == "2.5000" and fmt.cell(1e6, ".6g") == "1.000e+06"
    assert fmt.cell(1e6, ".6g", scientific=False) == "1e+06"
    assert fmt.cell(1234567) == "1234567" and fmt.cell(1234567, ".6g", scientific=False) == "1234567"
    assert fmt.cell("best") == "best" and fmt.cell(True) == "True"


def test_millis_rate_and_size():
    assert fmt.millis(0.2034) == "203" and fmt.millis(None) == "-" and fmt.millis(math.nan) == "nan"
    assert fmt.rate(1234.4) == "1,234" and fmt.rate(42.46) == "42.5" and fmt.rate(None) == "-"
    assert fmt.size(512) == "512 B" and fmt.size(3 * 1024 * 1024 // 2) == "1.5 MiB"
    assert fmt.size(5 * 1024 ** 5) == "5120.0 TiB" and fmt.size(-1) == "-" and fmt.size(None) == "-"


@pytest.mark.parametrize(("seconds", "text"), [
    (4.23, "4.2 s"), (42.4, "42 s"), (72, "1 min 12 s"), (8 * 3600 + 200, "8 h 03 min"),
    (3 * 86400 + 4 * 3600, "3 d 04 h"), (-1, "-"), (math.nan, "-"), (None, "-"),
])
def test_duration_in_human_units(seconds, text):
    assert fmt.duration(seconds) == text


def test_clock_and_counts():
    assert fmt.clock(75.9) == "01:15" and fmt.clock(3 * 3600 + 62) == "3:01:02"
    assert fmt.clock(None) == fmt.clock(-1) == fmt.clock(math.inf) == "--:--"
    assert fmt.plural(1, "rank") == "1 rank" and fmt.plural(2, "rank") == "2 ranks"
    assert fmt.plural(0, "batch", "batches") == "0 batches"


def test_dates_are_local_with_their_offset_and_a_span_names_the_day_once():
    ts = 1_700_000_000.0
    local = dt.datetime.fromtimestamp(ts).astimezone()
    text = fmt.when(ts)
    assert text.startswith(f"{local:%Y-%m-%d %H:%M:%S} UTC")
    assert fmt.when(0) == fmt.when(None) == "-"
    span = fmt.time_span(ts, ts + 60)
    assert span.startswith(f"{local:%Y-%m-%d %H:%M:%S} → ") and span.count(f"{local:%Y-%m-%d}") == 1
    later = dt.datetime.fromtimestamp(ts + 3 * 86400).astimezone()
    assert f"{later:%Y-%m-%d}" in fmt.time_span(ts, ts + 3 * 86400)
    assert fmt.time_span(None, ts) == text == fmt.time_span(ts, None)
