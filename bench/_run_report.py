"""docs/benchmarks.md and the console report of `make bench` (bench/run_all.py), from the
pieces' stored results: the run's header, the targets table, the interference table and each
piece's section (rendered by its own script's `render`), then the dated investigations."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import _common as C
from _run_notes import NOTES
from _run_pieces import FOREIGN_BUSY_CORES, PERF_NAMES, PIECES, SLOW_FACTOR, Attempt
from _run_targets import targets_table

INVESTIGATIONS = C.BENCH / "investigations.md"
"""The dated notes measured by hand (docs/architecture.md's choices), copied at the end of the document."""

SECTIONS = [
    ("overhead", "overhead", "In-rank overhead of monitoring callbacks", "overhead.py"),
    ("grad_cell", "grad_cell", "The grad-statistics cell against a plain TrainOneStepCell", "grad_cell.py"),
    ("fanin", "fanin", "Aggregator fan-in with simulated ranks", "fanin.py"),
    ("exporter", "exporter", "Dashboards and trackers: the Prometheus scrape, and each sink's CPU", "exporter.py"),
    ("memory", "memory", "Aggregator memory over 100,000 steps", "memory.py"),
    ("stop_latency", "stop_latency", "Stop latency: injected NaN to every rank stopped", "stop_latency.py"),
    ("startup", "startup", "Start-up: `mindpulse launch` against bare `msrun`", "startup.py"),
    ("npu_smi", "npu_smi_parse", "`npu-smi` parsing speed", "npu_smi_parse.py"),
    ("rules", "rules", "Rules: false alarms on healthy runs, and every injected fault caught", "rules.py"),
]

RELATED = {"memory": ("memory_tb",), "exporter": ("fanin_sinks",)}
"""Pieces shown in another piece's section, after it (each rendered by its own script's module)."""
RELATED_TITLES = {"memory_tb": " (TensorBoard on)", "fanin_sinks": " (the fan-in with each tracker sink)"}


def module_of(piece: str) -> str:
    """The module that renders a piece's result: its script's."""
    return next(p.script for p in PIECES if p.name == piece).removesuffix(".py")


def load_result(results: Path, name: str) -> dict | None:
    """A piece's stored result in `results` (bench/results), None where it has none."""
    p = results / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def failed_pieces(attempts: dict[str, list[Attempt]]) -> tuple[str, ...]:
    """The performance pieces of `attempts` none of whose attempts succeeded."""
    return tuple(sorted(n for n, att in attempts.items() if n in PERF_NAMES and att and not any(a.ok for a in att)))


def _render(module: str, data: dict) -> str:
    return importlib.import_module(module).render(data)  # bench/ is on sys.path (this script's folder)


def build_report(pieces, attempts, machine, started, total_s, waited, budget_s, perf_s=None, *,
                 results: Path, perf_failed: tuple[str, ...] | None = None) -> dict:
    """The document and the console report; `results`: the folder the pieces' results are read from;
    `perf_failed`: the performance pieces that failed in every attempt of the run `perf_s` timed
    (None: read from `attempts`, which must then be that run's)."""
    res = {p.name: load_result(results, p.name) for p in pieces}
    m = machine
    rules_att = [a for a in attempts.get("rules", []) if a.kept]
    if perf_failed is None:
        perf_failed = failed_pieces(attempts)
    tt, verdicts = targets_table(res, perf_s, rules_att[0].wall_s if rules_att else 0.0, perf_failed=perf_failed)
    lines_console = [tt]
    doc = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`bench/run_all.py`); every figure below is the one that run printed. "
        "Each benchmark can also be run alone: `.venv/bin/python bench/<name>.py` (see its docstring). "
        "Benchmarks are never timed assertions in tests.",
        "",
        "| | |",
        "| --- | --- |",
        f"| machine | {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM"
        + (f"; pure Python {m['python_slowdown']:.1f}x slower than the reference machine the planned times are "
           "for (npu_smi parse rate)" + ("; every piece ran its reduced arguments" if m['python_slowdown'] > SLOW_FACTOR
                                         else "") if m.get("python_slowdown") else "") + " |",
        f"| OS | {m['os']} |",
        f"| software | Python {m['python']}, MindSpore {m['mindspore']} (CPU), MindFormers {m['mindformers']}, "
        f"Ray {m['ray']}, msgpack {m['msgpack']} |",
        f"| date | {started} |",
        "| command | `make bench` (= `.venv/bin/python bench/run_all.py`: the performance pieces); the rules "
        "campaign's rows: `make bench-rules` (= `bench/run_all.py --only rules`) |",
        f"| total run time | {total_s / 60:.1f} min (budget {budget_s / 60:.0f} min; "
        f"{waited:.0f} s of it waiting for other processes to go quiet) |",
        "",
        "## Targets",
        "",
        tt,
        "",
        "## Interference",
        "",
        interference_text(attempts, results),
        "",
    ]
    for name, module, title, script in SECTIONS:
        related = [name, *RELATED.get(name, ())]
        if not any(res.get(n) for n in related if n in res):
            if name in res:
                doc += [f"## {title}", "", f"Not measured in this run ({name} failed or did not fit the budget).", ""]
            continue
        doc += [f"## {title}", "", f"`bench/{script}`. {NOTES[name]}", ""]
        for n in related:
            data = res.get(n)
            if not data:
                continue
            text = _render(module if n == name else module_of(n), data)
            att = attempts.get(n) or []
            w = next((a for a in att if a.kept), att[-1] if att else None)
            if w is None:  # results run piece by piece outside this run (their parts say when)
                doc += [f"Finished {data['date']} after {data['wall_s']:.0f} s (run alone, not by this "
                        "`make bench`).", "", text, ""]
            else:
                doc += [f"Finished {data['date']} after {data['wall_s']:.0f} s; other processes used "
                        f"{w.foreign['mean_cores']:.2f} cores on average over the whole piece"
                        + (" (discarded repeats included)." if any(p.max_s for p in PIECES if p.name == n) else ".")
                        + (f" Arguments: `{' '.join(w.args)}`." if w.args else ""), "", text, ""]
            lines_console += [f"\n## {title}" + RELATED_TITLES.get(n, ""), text]
    doc += [INVESTIGATIONS.read_text().strip(), ""]
    squeeze = lambda text: re.sub(r"\n{3,}", "\n\n", text)  # noqa: E731
    return {"doc": squeeze("\n".join(doc)).rstrip() + "\n", "console": squeeze("\n".join(lines_console))}


def _gating(name: str, data: dict | None) -> str:
    """What a gated piece says about the repeats it discarded or kept beside foreign load."""
    if not data:
        return "-"
    if name == "overhead":
        parts = [f"{m}: {r.get('discarded', 0)} discarded, {r.get('disturbed_kept', 0)} kept disturbed"
                 for m, r in data["results"].items()]
    elif name == "grad_cell":
        parts = [f"{c['mode']}:{c['model']}: {c.get('discarded', 0)} discarded, {c.get('disturbed_kept', 0)} kept "
                 "disturbed" for c in data["cases"]]
    elif name == "fanin":
        parts = [f"{data.get('rerun', 0)} configurations run again, {data.get('disturbed', 0)} kept disturbed"]
    elif "discarded" in data:
        parts = [f"{data.get('discarded', 0)} discarded, {data.get('disturbed_kept', 0)} kept disturbed"]
    else:
        return "-"
    return "; ".join(parts)


def interference_text(attempts: dict[str, list[Attempt]], results: Path) -> str:
    lines = [
        "The machine may be shared. A thread sampled the CPU used by processes outside this run (every 2 s here, "
        f"every 1 s inside the pieces). A repeat counts as disturbed when other processes used more than "
        f"{FOREIGN_BUSY_CORES} cores on average while it ran. The pieces with repeats (in-rank overhead, grad cell, "
        "fan-in, stop latency, start-up) wait for the machine to go quiet before each repeat and run a disturbed "
        "repeat again while their time allows, so their figures come from quiet repeats unless the table says some "
        "were kept disturbed; the others run again whole when disturbed (the run with less foreign load is kept).",
        ""]
    rows = []
    for name, att in attempts.items():
        for i, a in enumerate(att, 1):
            rows.append([name, i, ("ok, kept" if a.kept else "ok") if a.ok else f"failed (rc {a.rc})", f"{a.wall_s:.0f}",
                         f"{a.foreign['mean_cores']:.2f}", f"{a.foreign['max_cores']:.2f}",
                         _gating(name, load_result(results, name)) if a.kept else "-",
                         "; ".join(a.foreign["top"])[:100] or "-"])
    lines.append(C.table(["piece", "attempt", "result", "seconds", "foreign cores (mean over the piece)",
                          "foreign cores (peak)", "disturbed repeats", "busiest foreign processes"], rows))
    return "\n".join(lines)
