"""Parser for the text printed by Huawei's ``npu-smi`` tool (the telemetry sampler that runs
the tool is :mod:`mindpulse.node.samplers.npu_smi`).

Two kinds of output are understood, and may even be mixed in one input:

* the full table of ``npu-smi info`` (:mod:`.table_layout`);
* the per-card ``key : value`` listings of ``npu-smi info -t ... -i N [-c CHIP]``
  (:mod:`.key_value_layout`), several of one card combined with :func:`merge_cards`.

:func:`parse_npu_smi` (:mod:`.parse`) reads either; what it returns, and how one printed
value is read, is :mod:`.values` (the sampler turns cards into card records, which the one
card table prints). Nothing here raises on bad input: every public function returns what could
be read, plus human-readable warnings for what could not. Only the standard library is
used.
"""

from __future__ import annotations

from .merge import merge_cards
from .parse import parse_npu_smi
from .values import HEALTH_VALUES, MAX_WARNINGS, NpuCard, ParseResult

__all__ = [
    "HEALTH_VALUES",
    "MAX_WARNINGS",
    "NpuCard",
    "ParseResult",
    "parse_npu_smi",
    "merge_cards",
]
