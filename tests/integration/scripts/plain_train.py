"""A user's data-parallel MindSpore script as MindSpore's tutorials write it: no mindpulse
import, its own callbacks (LossMonitor, TimeMonitor, ModelCheckpoint), `init()` and
DATA_PARALLEL as in the msrun tutorial, `Model.train` with dataset sink mode on.

`--cell model`: Model builds the train cell (network + loss_fn + optimizer);
`--cell own`: the script builds `nn.TrainOneStepCell` itself and hands it to Model;
`--cell loss_scale`: the script builds `nn.TrainOneStepWithLossScaleCell` with a dynamic scale;
`--loop hand`: a hand-written loop calling its own train cell (no Model.train).
"""

import argparse
import os

import mindspore as ms
import numpy as np
from mindspore import nn
from mindspore.communication import get_group_size, get_rank, init
from mindspore.train import CheckpointConfig, LossMonitor, Model, ModelCheckpoint, TimeMonitor

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--mode", choices=["pynative", "graph"], default="graph")
parser.add_argument("--cell", choices=["model", "own", "loss_scale"], default="model")
parser.add_argument("--loop", choices=["model", "hand"], default="model")
parser.add_argument("--ckpt-dir", default="./ckpt")
parser.add_argument("--save-stagger", type=float, default=0.0,
                    help="ranks above 0 wait rank x this many seconds before their ModelCheckpoint saves: with one "
                         "folder for every rank, MindSpore's own save (isfile, then remove, then write) races "
                         "between ranks that save at the same instant")
parser.add_argument("--overflow-at", type=int, default=0, help="make the inputs of this step overflow (1-based)")
parser.add_argument("--linger-at-exit", type=float, default=0.0,
                    help="a worker thread that never joins keeps the process alive this long after the script "
                         "(as MindSpore's SummaryRecord writer process sometimes does)")
args = parser.parse_args()

ms.set_context(mode=ms.GRAPH_MODE if args.mode == "graph" else ms.PYNATIVE_MODE, device_target="CPU")
init()
rank, size = get_rank(), get_group_size()
ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
ms.set_seed(3)

rng = np.random.RandomState(100 + rank)
w_true = np.linspace(-1, 1, 16).astype(np.float32).reshape(16, 1)
x = rng.randn(args.steps * 8, 16).astype(np.float32)
y = x @ w_true
if args.overflow_at:  # a finite loss whose gradients, times the loss scale, overflow float32
    x[(args.overflow_at - 1) * 8 : args.overflow_at * 8] *= 1e10
    y[(args.overflow_at - 1) * 8 : args.overflow_at * 8] *= 1e10

net = nn.Dense(16, 1)
loss_fn = nn.MSELoss()
opt = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
if args.cell == "model":
    model = Model(net, loss_fn, opt)
    train_cell = None
elif args.cell == "own":
    train_cell = nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), opt)
    model = Model(train_cell)
else:
    scale = nn.DynamicLossScaleUpdateCell(loss_scale_value=2.0**64, scale_factor=2, scale_window=4)
    train_cell = nn.TrainOneStepWithLossScaleCell(nn.WithLossCell(net, loss_fn), opt, scale_sense=scale)
    model = Model(train_cell)

if args.loop == "hand":
    cell = train_cell or nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), opt)
    for i in range(args.steps):
        loss = cell(ms.Tensor(x[i * 8 : (i + 1) * 8]), ms.Tensor(y[i * 8 : (i + 1) * 8]))
else:
    ds = ms.dataset.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(8)
    # `{rank}` in --ckpt-dir: a folder per rank (without it every rank writes one folder, as
    # some users' scripts do: mindpulse warns, and two ranks may trip over each other's files)
    ckpt = ModelCheckpoint(prefix="plain", directory=os.path.abspath(args.ckpt_dir.format(rank=rank)),
                           config=CheckpointConfig(save_checkpoint_steps=args.steps, keep_checkpoint_max=1))
    callbacks = [LossMonitor(), TimeMonitor(), ckpt]
    if args.save_stagger and rank:

        class SaveAfterRankZero(ms.train.Callback):
            """Before the steps ModelCheckpoint writes on: the first (its graph) and the last."""

            def step_end(self, run_context):
                import time

                if run_context.original_args().cur_step_num in (1, args.steps):
                    time.sleep(args.save_stagger * rank)

        callbacks.insert(2, SaveAfterRankZero())
    model.train(1, ds, callbacks=callbacks, dataset_sink_mode=True)
print(f"rank {rank}/{size} done", flush=True)
if args.linger_at_exit:
    import threading
    import time

    threading.Thread(target=time.sleep, args=(args.linger_at_exit,), name="summary-writer-join").start()
