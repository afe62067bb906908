"""`npu-smi` parsing speed on the shared fixtures (tests/fixtures/npu-smi): cards/s and MB/s.

Every fixture is parsed many times in a loop (after a warm-up); repeated `--repeats`
times, reported as median and range of the repeats.

Usage: .venv/bin/python bench/npu_smi_parse.py [--seconds 1.0] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import time

import _common as C

FIXTURES = C.ROOT / "tests" / "fixtures" / "npu-smi"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=1.0, help="time per fixture and repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.time()
    from mindpulse.node.npu_smi import parse_npu_smi

    files = sorted(p for p in FIXTURES.glob("*.txt"))
    texts = [f.read_text(encoding="utf-8") for f in files]
    round_cards = sum(len(parse_npu_smi(t).cards) for t in texts)
    round_bytes = sum(len(t.encode()) for t in texts)
    rows = []
    all_cards_s, all_mb_s = [], []
    for rep in range(args.repeats):
        # all fixtures in turn (one round parses each once), as many rounds as fit
        n = 0
        t = time.perf_counter()
        while time.perf_counter() - t < args.seconds:
            for text in texts:
                parse_npu_smi(text)
            n += 1
        dt = time.perf_counter() - t
        all_cards_s.append(n * round_cards / dt)
        all_mb_s.append(n * round_bytes / dt / 1e6)
        for f in files:  # and each fixture on its own
            text = f.read_text(encoding="utf-8")
            n_cards = len(parse_npu_smi(text).cards)
            n = 0
            t = time.perf_counter()
            while True:
                for _ in range(20):
                    parse_npu_smi(text)
                n += 20
                dt = time.perf_counter() - t
                if dt >= args.seconds / len(files):
                    break
            if rep == 0:
                rows.append({"file": f.name, "bytes": len(text.encode()), "cards": n_cards, "parses_per_s": [],
                             "cards_per_s": []})
            row = next(r for r in rows if r["file"] == f.name)
            row["parses_per_s"].append(n / dt)
            row["cards_per_s"].append(n * n_cards / dt)
    for r in rows:
        r["parses_per_s"] = C.summary(r["parses_per_s"])
        r["cards_per_s"] = C.summary(r["cards_per_s"])
    out = {"files": rows, "cards_per_s": C.summary(all_cards_s), "mb_per_s": C.summary(all_mb_s),
           "repeats": args.repeats, "round_cards": round_cards, "round_bytes": round_bytes}
    print(render(out))
    C.write_result(args.json, "npu_smi", out, t0)


def render(out: dict) -> str:
    rows = [[r["file"], r["bytes"], r["cards"], f"{r['parses_per_s']['median']:.0f}",
             f"{r['cards_per_s']['median']:.0f}"] for r in out["files"]]
    c, m = out["cards_per_s"], out["mb_per_s"]
    return "\n".join([
        C.table(["fixture", "bytes", "cards", "parses/s", "cards/s"], rows),
        f"all {len(out['files'])} fixtures in turn ({out['round_cards']} cards, {out['round_bytes']} bytes a round): "
        f"{c['median']:.0f} cards/s (range {c['min']:.0f}-{c['max']:.0f}), "
        f"{m['median']:.2f} MB/s (range {m['min']:.2f}-{m['max']:.2f}) over {out['repeats']} repeats",
    ])


if __name__ == "__main__":
    main()
