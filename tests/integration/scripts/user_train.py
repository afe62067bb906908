"""A user's own data-parallel MindSpore script, monitored with one line (see README).

Launched by `mindpulse launch` with `job.script`; every rank runs it with MS_* set.
`--loop manual` uses `monitor.step(...)` in a hand-written loop instead of Model.train.
"""

import argparse

import mindspore as ms
import numpy as np
from mindspore import nn
from mindspore.communication import get_group_size, get_rank, init
from mindspore.train import Model

from mindpulse.workers import Monitor, MonitoredTrainOneStepCell

parser = argparse.ArgumentParser()
parser.add_argument("--loop", choices=["model", "manual"], default="model")
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--mode", choices=["pynative", "graph"], default="pynative")
parser.add_argument("--seed-per-rank", action="store_true", help="a deliberate bug: each rank its own seed")
args = parser.parse_args()

ms.set_context(mode=ms.GRAPH_MODE if args.mode == "graph" else ms.PYNATIVE_MODE, device_target="CPU")
init()
rank, size = get_rank(), get_group_size()
ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
ms.set_seed(3 + (rank if args.seed_per_rank else 0))

# y = x @ w_true: a regression every rank shards by rank
rng = np.random.RandomState(100 + rank)
w_true = np.linspace(-1, 1, 16).astype(np.float32).reshape(16, 1)
x = rng.randn(args.steps * 8, 16).astype(np.float32)
y = x @ w_true

net = nn.Dense(16, 1)
loss_net = nn.WithLossCell(net, nn.MSELoss())
opt = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
train_net = MonitoredTrainOneStepCell(loss_net, opt)

if args.loop == "model":
    ds = ms.dataset.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(8)
    Model(train_net).train(1, ds, callbacks=[Monitor()], dataset_sink_mode=False)
else:
    monitor = Monitor(network=net, batch_size=8, train_cell=train_net)
    for i in range(args.steps):
        out = train_net(ms.Tensor(x[i * 8 : (i + 1) * 8]), ms.Tensor(y[i * 8 : (i + 1) * 8]))
        if monitor.step(out, optimizer=opt).stop:
            break
    monitor.finish()
print(f"rank {rank}/{size} done")
