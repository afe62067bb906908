"""Step time of MonitoredTrainOneStepCell against nn.TrainOneStepCell, interleaved.

Usage: .venv/bin/python bench/grad_cell.py [--steps 40] [--mode pynative|graph]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--mode", choices=["pynative", "graph"], default="pynative")
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    import mindspore as ms
    from mindspore import nn

    from mindpulse.workers.recipes.llama_finetune import ModelShape, build_model, set_mode
    from mindpulse.workers.train_cell import MonitoredTrainOneStepCell

    set_mode(args.mode, "CPU")
    model = build_model(ModelShape(), args.batch_size)
    set_mode(args.mode, "CPU")
    opt = nn.AdamWeightDecay(model.trainable_params(), 1e-4)
    cells = {"plain": nn.TrainOneStepCell(model, opt), "monitored": MonitoredTrainOneStepCell(model, opt)}
    x = ms.Tensor(np.random.RandomState(0).randint(0, 256, (args.batch_size, 65)).astype(np.int32))
    times: dict[str, list[float]] = {k: [] for k in cells}
    for k, c in cells.items():  # warm-up/compile
        c.set_train()
        for _ in range(3):
            out = c(x)
    for i in range(args.steps):
        for k, c in (cells.items() if i % 2 == 0 else reversed(list(cells.items()))):
            t = time.perf_counter()
            out = c(x)
            (out[0] if isinstance(out, tuple) else out).asnumpy()
            times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        q = statistics.quantiles(v, n=4)
        print(f"{k:10s} median {med[k] * 1000:8.2f} ms  IQR {q[0] * 1000:.2f}-{q[2] * 1000:.2f} ms")
    print(f"ratio monitored/plain: {med['monitored'] / med['plain']:.3f} ({args.mode})")


if __name__ == "__main__":
    main()
