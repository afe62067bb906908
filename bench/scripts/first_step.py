"""The start-up benchmark's training script: tests/integration/scripts/user_train.py's
data-parallel regression, monitored with one line, plus a callback that prints the wall
clock time at the end of the first step (`BENCH_FIRST_STEP <rank> <unix time>`).

The same file runs under `mindpulse launch` (job.script) and under bare `msrun`; outside
mindpulse `Monitor` only logs and never blocks.
"""

import argparse
import time

T_IMPORT = time.time()

import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
from mindspore import nn  # noqa: E402
from mindspore.communication import get_group_size, get_rank, init  # noqa: E402
from mindspore.train import Model  # noqa: E402
from mindspore.train.callback import Callback  # noqa: E402

from mindpulse.workers import Monitor, MonitoredTrainOneStepCell  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
args = parser.parse_args()

ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
init()
rank, size = get_rank(), get_group_size()
ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
ms.set_seed(3)

rng = np.random.RandomState(100 + rank)
w_true = np.linspace(-1, 1, 16).astype(np.float32).reshape(16, 1)
x = rng.randn(args.steps * 8, 16).astype(np.float32)
y = x @ w_true

net = nn.Dense(16, 1)
loss_net = nn.WithLossCell(net, nn.MSELoss())
opt = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
train_net = MonitoredTrainOneStepCell(loss_net, opt)


class FirstStep(Callback):
    def on_train_step_end(self, run_context):
        if run_context.original_args().cur_step_num == 1:
            print(f"BENCH_FIRST_STEP {rank} {time.time():.6f} {T_IMPORT:.6f}", flush=True)


ds = ms.dataset.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(8)
Model(train_net).train(1, ds, callbacks=[FirstStep(), Monitor()], dataset_sink_mode=False)
print(f"rank {rank}/{size} done", flush=True)
