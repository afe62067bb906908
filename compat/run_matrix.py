"""Run the compatibility matrix: every supported MindSpore/MindFormers pair on the features it
has, each feature a real short launch in the pair's own cached venv; then rewrite
docs/compat.md with the table (compat/doc.py).

Venvs are built first (downloads: IO-bound), then the launches run one at a time (each takes
every core). `--lock FILE` holds an flock on FILE around each pair's launches, for a machine
where others launch too. Results land in compat/results/matrix.json; run directories of failing
cells in compat/results/runs/ (not kept in git).

Usage: .venv/bin/python compat/run_matrix.py [--pairs ms2.7.1-mf1.7.0,ms2.10.0 | --ci-pairs] [--steps 4]
       [--features recipe,...] [--no-docs] [--no-trials] [--lock FILE] [--build-only]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import doc  # noqa: E402
import features  # noqa: E402
import matrix  # noqa: E402
import mindformers_next  # noqa: E402
import venvs  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DOC = venvs.ROOT / "docs" / "compat.md"
DEFAULT_STEPS = 4


def machine() -> str:
    """The CPU model, its cores and the memory: what the seconds in the table were taken on."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass  # not Linux: platform's name stands
    mem = ""
    try:
        kb = int(next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
                 .split()[1])
        mem = f", {kb / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass  # no /proc/meminfo: the memory is left out
    return f"{platform.system()} {platform.machine()}, {model}, {os.cpu_count()} cores{mem}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default="", help="comma-separated pair names (default: all)")
    ap.add_argument("--features", default="", help="comma-separated features (default: each pair's)")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/compat.md")
    ap.add_argument("--no-trials", action="store_true", help="skip the MindFormers 2.x trial and checks")
    ap.add_argument("--lock", type=Path, default=None, help="flock this file around each pair's launches")
    ap.add_argument("--cache", type=Path, default=venvs.CACHE)
    ap.add_argument("--build-only", action="store_true",
                    help="build (or check) the pairs' venvs and launch nothing (e.g. beside other work)")
    ap.add_argument("--ci-pairs", action="store_true",
                    help="the pairs the test suite runs: the oldest and the newest (compat/matrix.py)")
    ap.add_argument("--docs-only", action="store_true", help="rewrite docs/compat.md from the last results")
    args = ap.parse_args(argv)
    if args.docs_only:
        DOC.write_text(doc.render(json.loads((RESULTS / "matrix.json").read_text())))
        return 0

    rows = matrix.supported_pairs() + ([] if args.no_trials else matrix.tried_pairs())
    wanted = {p for p in args.pairs.split(",") if p}
    unknown = wanted - {p.name for p, _ in rows}
    if unknown:
        print(f"--pairs: unknown {sorted(unknown)}; the pairs are {[p.name for p, _ in rows]}", file=sys.stderr)
        return 2
    if args.ci_pairs:
        wanted |= {p.name for p, _ in matrix.oldest_and_newest()}
    rows = [(p, f) for p, f in rows if not wanted or p.name in wanted]
    only = {f for f in args.features.split(",") if f}
    if only - {f.value for f in matrix.Feature}:
        print(f"--features: unknown {sorted(only - {f.value for f in matrix.Feature})}", file=sys.stderr)
        return 2

    log = lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", flush=True)
    started = time.monotonic()
    built: dict[str, venvs.Venv | str] = {}
    for pair, _ in rows:  # every venv first: downloads and installs, no launch yet
        try:
            built[pair.name] = venvs.ensure(pair, args.cache, log)
        except (venvs.BuildError, OSError, TimeoutError) as exc:
            built[pair.name] = str(exc)
            log(f"{pair.name}: not built: {exc}")
    if args.build_only:
        failed = [n for n, v in built.items() if isinstance(v, str)]
        log(f"venvs ready in {time.monotonic() - started:.0f} s" + (f"; not built: {failed}" if failed else ""))
        return 1 if failed else 0
    keep = RESULTS / "runs"
    for pair, _ in rows:
        shutil.rmtree(keep / pair.name, ignore_errors=True)
    out_rows = []
    for pair, feats in rows:
        venv = built[pair.name]
        row = {"name": pair.name, "pair": asdict(pair), "cells": {},
               "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}
        if isinstance(venv, str):
            row["build_error"] = venv
            out_rows.append(row)
            continue
        row.update(built_s=venv.built_s, reused=venv.reused, installed=venv.installed, missing=venv.missing,
                   kept=venv.kept)
        with features.held(args.lock):
            for feat in feats:
                if only and feat.value not in only:
                    continue
                log(f"{pair.name}: {feat.value} ...")
                cell = features.run(venv, feat, args.steps, keep)
                log(f"{pair.name}: {feat.value}: {'pass' if cell.passed else 'FAIL: ' + cell.reason} "
                    f"({cell.seconds:.0f} s)")
                row["cells"][feat.value] = {k: (v.value if isinstance(v, matrix.Feature) else v)
                                            for k, v in asdict(cell).items()}
                if cell.passed:
                    shutil.rmtree(keep / pair.name / feat.value, ignore_errors=True)
        out_rows.append(row)
    checks = []
    if not args.no_trials:
        for version in mindformers_next.releases_to_check(matrix.MINDFORMERS_CHECKED):
            log(f"mindformers {version}: reading its requirements and source")
            checks.append(asdict(mindformers_next.check_release(version)))
    if wanted or only:  # a subset: the other pairs' rows (and cells) stay as the last run left them
        out_rows = _merged(out_rows, [p.name for p, _ in matrix.supported_pairs() + matrix.tried_pairs()])
        if args.no_trials and (RESULTS / "matrix.json").exists():
            checks = json.loads((RESULTS / "matrix.json").read_text()).get("mindformers_next", [])
    results = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
               "python": platform.python_version(), "steps": args.steps, "ranks": features.RANKS,
               "wall_s": round(time.monotonic() - started), "pairs": out_rows, "mindformers_next": checks}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "matrix.json").write_text(json.dumps(results, indent=1) + "\n")
    if not args.no_docs:
        DOC.write_text(doc.render(results))
        log(f"wrote {DOC.relative_to(venvs.ROOT)}")
    failed = [f"{r['name']}/{c}" for r in out_rows if not r["pair"]["partial"]
              for c, v in r["cells"].items() if not v["passed"]] + \
             [r["name"] for r in out_rows if r.get("build_error") and not r["pair"]["partial"]]
    log(f"matrix done in {results['wall_s']} s; " + (f"failed: {failed}" if failed else "every supported cell passed"))
    return 1 if failed else 0


def _merged(rows: list[dict], order: list[str]) -> list[dict]:
    """This run's rows over the last run's (compat/results/matrix.json): a cell run now replaces
    the same cell, the others stay; rows in the matrix's order."""
    try:
        last = {r["name"]: r for r in json.loads((RESULTS / "matrix.json").read_text())["pairs"]}
    except (OSError, ValueError, KeyError):
        last = {}
    for row in rows:
        old = last.get(row["name"])
        if old and not row.get("build_error"):
            row["cells"] = {**old.get("cells", {}), **row["cells"]}
        last[row["name"]] = row
    return [last[n] for n in order if n in last]


if __name__ == "__main__":
    sys.exit(main())
