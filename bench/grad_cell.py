"""Step time of MonitoredTrainOneStepCell against nn.TrainOneStepCell, interleaved.

Same model, same batch, same optimizer settings; one process. Each repeat runs `--steps`
steps of each cell, alternating the cells step by step (the first cell alternates
between repeats). A step is timed until its outputs are on the host (the loss, and the
statistics vector for the monitored cell, as `Monitor` reads them). Reported per case:
median step time of each cell over the repeats, and the ratio monitored/plain (median
and range of the per-repeat ratios).

Cases: GRAPH mode with the small (recipe) and the larger model of bench/overhead.py,
and PYNATIVE mode (the recipe's default mode) with the small model.

A repeat run while other processes used the CPU (more than 0.3 cores on average) is
discarded and run again while `--max-seconds` allows.

Usage: .venv/bin/python bench/grad_cell.py [--steps 10] [--repeats 5] [--cases graph:small,...] [--json out.json]
"""

from __future__ import annotations

import os

os.environ["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = "python"

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import _common as C  # noqa: E402
import numpy as np  # noqa: E402

MODELS = {
    "small": dict(seq_length=64, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, batch_size=8),
    "larger": dict(seq_length=128, hidden_size=256, num_layers=4, num_heads=4, intermediate_size=512, batch_size=8),
}
CASES = ["graph:small", "graph:larger", "pynative:small"]


def run_case(mode: str, mname: str, steps: int, repeats: int, load: C.ForeignLoad, deadline: float) -> dict:
    import mindspore as ms
    from mindspore import nn

    from mindpulse.workers.recipes.llama_finetune import ModelShape, build_model, set_mode
    from mindpulse.workers.train_cell import MonitoredTrainOneStepCell

    spec = MODELS[mname]
    shape = ModelShape(**{k: spec[k] for k in ModelShape.__dataclass_fields__})
    bs = spec["batch_size"]
    set_mode(mode, "CPU")
    ms.set_seed(1234)
    model = build_model(shape, bs)
    set_mode(mode, "CPU")  # mindformers may have switched the mode
    opt = nn.AdamWeightDecay(model.trainable_params(), 1e-4, weight_decay=0.0)
    cells = {"plain": nn.TrainOneStepCell(model, opt),
             "monitored": MonitoredTrainOneStepCell(model, opt, fault_armed=False)}
    for c in cells.values():
        c.set_train()
    x = ms.Tensor(np.random.RandomState(0).randint(0, 256, (bs, shape.seq_length + 1)).astype(np.int32))

    def step(name: str) -> float:
        t = time.perf_counter()
        out = cells[name](x)
        if isinstance(out, tuple):
            for o in out:
                o.asnumpy()
        else:
            out.asnumpy()
        return time.perf_counter() - t

    for name in cells:  # compile and warm up
        for _ in range(3):
            step(name)
    if ms.get_context("mode") != (ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE):
        raise RuntimeError(f"the execution mode is not {mode}")
    def one_repeat(rep: int) -> dict[str, float]:
        times: dict[str, list[float]] = {k: [] for k in cells}
        names = list(cells) if rep % 2 == 0 else list(reversed(list(cells)))
        for i in range(steps):
            for name in (names if i % 2 == 0 else list(reversed(names))):
                times[name].append(step(name))
        return {k: statistics.median(v) for k, v in times.items()}

    # only repeats run while the machine was otherwise quiet count (while time allows)
    g = C.gated_repeats(load, repeats, deadline, one_repeat,
                        log=lambda m: print(f"[grad_cell] {mode}:{mname}: {m}", file=sys.stderr, flush=True))
    per_rep = {k: [r[k] for r in g["kept"]] for k in cells}
    ratios = [m / p for m, p in zip(per_rep["monitored"], per_rep["plain"])]
    return {"mode": mode, "model": mname, "shape": spec, "steps": steps, "repeats": len(g["kept"]),
            "discarded": g["discarded"], "disturbed_kept": g["disturbed_kept"], "foreign_cores": g["foreign"],
            "plain_s": C.summary(per_rep["plain"]), "monitored_s": C.summary(per_rep["monitored"]),
            "ratio": C.summary(ratios)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10, help="timed steps of each cell per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--max-seconds", type=float, default=120.0,
                    help="time after which disturbed repeats are no longer run again")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.time()
    load = C.ForeignLoad(interval_s=1.0).start()
    results = []
    cases = args.cases.split(",")
    for i, case in enumerate(cases):
        mode, mname = case.split(":")
        deadline = t0 + args.max_seconds * (i + 1) / len(cases)
        results.append(run_case(mode, mname, args.steps, args.repeats, load, deadline))
        print(f"[grad_cell] {case} done ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
    load.stop()
    out = {"cases": results}
    print(render(out))
    C.write_result(args.json, "grad_cell", out, t0)


def render(out: dict) -> str:
    rows = []
    for r in out["cases"]:
        p, m, q = r["plain_s"], r["monitored_s"], r["ratio"]
        rows.append([r["mode"].upper(), r["model"], C.fmt_ms(p["median"]), C.fmt_ms(m["median"]),
                     f"{q['median']:.3f}", f"{q['min']:.3f}-{q['max']:.3f}", f"{r['repeats']} x {r['steps']}"])
    text = C.table(["mode", "model", "TrainOneStepCell ms", "MonitoredTrainOneStepCell ms", "ratio",
                    "ratio range", "repeats x steps"], rows)
    disc = sum(r.get("discarded", 0) for r in out["cases"])
    kept = sum(r.get("disturbed_kept", 0) for r in out["cases"])
    if disc or kept:
        text += (f"\n\n{C.plural(disc, 'repeat')} beside other processes' load discarded and run again"
                 + (f"; {kept} kept although other processes were busy (no time left)" if kept else ""))
    return text


if __name__ == "__main__":
    main()
