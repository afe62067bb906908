"""Step time of MonitoredTrainOneStepCell against nn.TrainOneStepCell, interleaved.

Same model, same batch, same optimizer settings; one process. Each repeat runs `--steps`
steps of each cell, alternating the cells step by step (the first cell alternates
between repeats). A step is timed until its outputs are on the host (the loss, and the
statistics vector for the monitored cell, as `Monitor` reads them). Per repeat, each
cell's mean step over all its timed steps (outliers included: they are what a run pays),
and the ratio monitored/plain of those means. Reported per case: the cells' mean step
(mean over repeats), and the ratio's mean, median, spread (min-max) and worst repeat
over the repeats. A target (`--target`, on `--target-cases`) counts as met only when the
worst repeat meets it.

Cases: GRAPH mode with the small (recipe) and the larger model (bench/overhead.py's
shapes), and PYNATIVE mode (the recipe's default mode) with the small model. One
process: the gradient reducer is the identity, so the cell's global norm is its local
one; data parallel adds a second sum of squares over the reduced gradients (not here).
The monitored cell is built as a rank builds it (no fault armed; NaN/Inf counting chosen
by the gradients' size).

`--cell-file F` times the `MonitoredTrainOneStepCell` of another version of
workers/train_cell.py instead (e.g. `git show HEAD:workers/train_cell.py > /tmp/old.py`),
to measure a before/after pair with the same method.

A repeat run while other processes used the CPU (more than 0.3 cores on average) is
discarded and run again while `--max-seconds` allows.

Usage: .venv/bin/python bench/grad_cell.py [--steps 10] [--repeats 5] [--cases graph:small,...]
       [--target 1.05] [--target-cases graph:larger] [--cell-file F] [--json out.json]
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
TARGET = 1.05
TARGET_CASES = ["graph:larger"]


def load_cell_class(cell_file: str | None):
    """`MonitoredTrainOneStepCell` from workers/train_cell.py, or from another version of
    that file (loaded as a module of the same package, so its relative imports resolve)."""
    if not cell_file:
        from mindpulse.workers.train_cell import MonitoredTrainOneStepCell

        return MonitoredTrainOneStepCell
    import importlib.util

    import mindpulse.workers  # noqa: F401  (the package the file's relative imports need)

    spec = importlib.util.spec_from_file_location("mindpulse.workers._bench_train_cell", cell_file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.MonitoredTrainOneStepCell


def ratio_summary(ratios: list[float]) -> dict[str, float]:
    out = C.summary(ratios)
    out["mean"] = statistics.mean(ratios) if ratios else float("nan")
    out["worst"] = out["max"]
    return out


def run_case(mode: str, mname: str, steps: int, repeats: int, load: C.ForeignLoad, deadline: float,
             cell_cls) -> dict:
    import mindspore as ms
    from mindspore import nn

    from mindpulse.workers.recipes.llama_finetune import ModelShape, build_model, set_mode

    spec = MODELS[mname]
    shape = ModelShape(**{k: spec[k] for k in ModelShape.__dataclass_fields__})
    bs = spec["batch_size"]
    set_mode(mode, "CPU")
    ms.set_seed(1234)
    model = build_model(shape, bs)
    set_mode(mode, "CPU")  # mindformers may have switched the mode
    opt = nn.AdamWeightDecay(model.trainable_params(), 1e-4, weight_decay=0.0)
    cells = {"plain": nn.TrainOneStepCell(model, opt),
             "monitored": cell_cls(model, opt, fault_armed=False)}
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
        return {k: statistics.mean(v) for k, v in times.items()}

    # only repeats run while the machine was otherwise quiet count (while time allows)
    g = C.gated_repeats(load, repeats, deadline, one_repeat,
                        log=lambda m: print(f"[grad_cell] {mode}:{mname}: {m}", file=sys.stderr, flush=True))
    per_rep = {k: [r[k] for r in g["kept"]] for k in cells}
    ratios = [m / p for m, p in zip(per_rep["monitored"], per_rep["plain"])]
    n_params = len(opt.parameters)
    n_values = int(sum(int(np.prod(p.shape)) for p in opt.parameters))
    return {"mode": mode, "model": mname, "shape": spec, "grad_tensors": n_params, "grad_values": n_values,
            "steps": steps, "repeats": len(g["kept"]),
            "discarded": g["discarded"], "disturbed_kept": g["disturbed_kept"], "foreign_cores": g["foreign"],
            "plain_s": dict(C.summary(per_rep["plain"]), mean=statistics.mean(per_rep["plain"])),
            "monitored_s": dict(C.summary(per_rep["monitored"]), mean=statistics.mean(per_rep["monitored"])),
            "ratio": ratio_summary(ratios), "ratios": ratios}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10, help="timed steps of each cell per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--max-seconds", type=float, default=120.0,
                    help="time after which disturbed repeats are no longer run again")
    ap.add_argument("--target", type=float, default=TARGET,
                    help="ratio the worst repeat must stay under on the target cases")
    ap.add_argument("--target-cases", default=",".join(TARGET_CASES))
    ap.add_argument("--cell-file", default=None,
                    help="time the MonitoredTrainOneStepCell of this file (another version of workers/train_cell.py)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.time()
    cell_cls = load_cell_class(args.cell_file)
    target_cases = [c for c in args.target_cases.split(",") if c]
    load = C.ForeignLoad(interval_s=1.0).start()
    results = []
    cases = args.cases.split(",")
    for i, case in enumerate(cases):
        mode, mname = case.split(":")
        deadline = t0 + args.max_seconds * (i + 1) / len(cases)
        r = run_case(mode, mname, args.steps, args.repeats, load, deadline, cell_cls)
        if case in target_cases:
            r["target"] = args.target
            r["target_met"] = bool(r["repeats"]) and r["ratio"]["worst"] <= args.target
        results.append(r)
        print(f"[grad_cell] {case} done ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
    load.stop()
    out = {"cases": results, "cell_file": args.cell_file}
    print(render(out))
    C.write_result(args.json, "grad_cell", out, t0)


def render(out: dict) -> str:
    rows = []
    for r in out["cases"]:
        p, m, q = r["plain_s"], r["monitored_s"], r["ratio"]
        target = "-"
        if "target" in r:
            target = f"<= {r['target']:.2f}: " + ("met" if r.get("target_met") else "not met")
        rows.append([r["mode"].upper(), r["model"], C.fmt_ms(p.get("mean", p["median"])),
                     C.fmt_ms(m.get("mean", m["median"])), f"{q.get('mean', q['median']):.3f}", f"{q['median']:.3f}",
                     f"{q['min']:.3f}-{q['max']:.3f}", f"{q.get('worst', q['max']):.3f}", target,
                     f"{r['repeats']} x {r['steps']}"])
    text = C.table(["mode", "model", "TrainOneStepCell ms", "MonitoredTrainOneStepCell ms", "ratio mean",
                    "ratio median", "ratio spread", "worst repeat", "target (worst repeat)", "repeats x steps"],
                   rows)
    if out.get("cell_file"):
        text += f"\nMonitored cell from {out['cell_file']}.\n"
    disc = sum(r.get("discarded", 0) for r in out["cases"])
    kept = sum(r.get("disturbed_kept", 0) for r in out["cases"])
    if disc or kept:
        text += (f"\n\n{C.plural(disc, 'repeat')} beside other processes' load discarded and run again"
                 + (f"; {kept} kept although other processes were busy (no time left)" if kept else ""))
    return text


if __name__ == "__main__":
    main()
