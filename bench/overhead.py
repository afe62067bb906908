"""What monitoring costs inside one rank: mindpulse's default path as a launch runs it,
against a bare `nn.TrainOneStepCell` and against MindSpore's and MindFormers' callbacks,
interleaved in one run.

One process, GRAPH mode, `Model.train(..., dataset_sink_mode=False)`, one model (its
weights, optimizer and fixed random byte tokens shared by every configuration):

  none          `nn.TrainOneStepCell`, no callback (the baseline)
  mp_default    mindpulse's default path as a launch runs it: the recipe's
                `MonitoredTrainOneStepCell`, the `Monitor` callback over a `RankSession`
                built from `RankSettings` made by the launcher's own `rank_settings` (the
                default config: `monitor.collect_freq` 10, `monitor.max_lag_steps` 1,
                weight statistics on, `checkpoint.best_every_steps` 10, so rank 0 copies its
                weights and asks for the verdict every 10th step), its `RelayChannel` to a real node relay (the
                launcher's `NodeAgents` starting a `NodeAgent` actor: `RelayServer` +
                `NodePreReducer`, card telemetry on) streaming over its node uplink to a real aggregator actor
                (`start_aggregator` with the settings a launch passes; TensorBoard on) in a
                local Ray cluster; heartbeat thread on. Checkpoint *writing* is off (it is
                not monitoring): the aggregator still judges every 10th step and rank 0
                still copies the weights and takes the verdict, but the save it asks for is
                not written.
  mp_cell       the breakdown of `mp_default`: its `MonitoredTrainOneStepCell` alone, no
                callback (the rest of `mp_default`'s cost is the callback, the relay and
                the aggregator)
  mp_script     an unmodified `Model.train` script as auto-attach leaves it: a plain
                `nn.TrainOneStepCell` with the gradient statistics around its reducer
                (`attach_grad_stats`) and the `Monitor` auto-attach adds (the launch's
                settings; train cell, batch and tokens found in `Model.train`)
  mf_cell       MindFormers' `MFTrainOneStepCell` as the shipped YAML's runner_wrapper
                builds it (scale 1, clipping to norm 1), no callback
  mp_mindformers  the MindFormers path: that cell and `MindPulseMonitor` as
                `mindformers_job.run_for_rank` adds it (model shape, tokens per step)
  mf_cell_mf_loss  that cell and MindFormers' `MFLossMonitor`
  loss_monitor  MindSpore `LossMonitor()` (prints every step)
  mf_loss       MindFormers `MFLossMonitor` (prints every step)
  summary_1     MindSpore `SummaryCollector(collect_freq=1)`
  summary_10    MindSpore `SummaryCollector(collect_freq=10)` (like for like with mindpulse's
                default collect_freq)

The callbacks other than mindpulse's run on the plain cell. What differs from a launch:
world size 1 (one rank, one node), GRAPH mode (the shipped config trains in PYNATIVE), the
rank is this benchmark's process (not a Ray actor or an msrun worker), no driver loop polls
the aggregator, checkpoints are not written, and each timed run starts a new `Monitor` (a
launch has one for its whole run; its start, before the first step, is not timed) whose
steps continue the count of the previous one. The rank, the node agent and the aggregator
share this machine's cores as they do in a one-machine launch; the CPU time each process
used per step is reported next to the step times.

Timing: a callback placed first stamps the start of every step; a step's time runs to the
next step's start, so it holds the step and every callback's work for it. A repeat times
`--timed-steps-*` steps of every configuration in `--rounds-*` rounds: each round runs every
configuration once (`none` and `mp_default` always next to each other, the order reversing
from round to round and between repeats), and each run drops its first `WARMUP_STEPS`
steps and times the next `timed / rounds` (a multiple of 10: every run holds the same share
of collect, weight-statistics and decision steps). Why rounds: on this 2-core machine each
`Model.train` run settles at its own level (the same configuration run twice in a row
differs by ~11% in its mean step, sd over runs, whether it times 10 steps or 40), so the
ratio of two configurations' means over one run each is that noisy; over 4 runs each,
interleaved, its sd halves (measured: 0.137 -> 0.054 with 10-step runs). Reported per configuration: the MEAN step over all timed
steps (collect steps included: that is what a run pays) with its spread over repeats (the
min-max of the per-repeat means), the median step, and the ratio to `none` taken within
each repeat (mean over repeats and worst repeat). A target counts as met only when its
worst repeat meets it.

A repeat run while other processes used the CPU (more than 0.3 cores on average) is
discarded and run again while `--max-seconds` allows.

Usage: .venv/bin/python bench/overhead.py [--repeats-small 10] [--repeats-larger 4] [--rounds-small 4]
       [--rounds-larger 2]
       [--models small,larger] [--configs none,mp_default,...] [--max-seconds 300]
       [--json out.json] [--quick]
"""

from __future__ import annotations

import os

# the process that imports mindspore must use the pure-python protobuf; set before any import
os.environ["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = "python"

import argparse  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import _common as C  # noqa: E402
import numpy as np  # noqa: E402

CONFIGS = ["none", "mp_default", "mp_cell", "loss_monitor", "mf_loss", "mp_script", "mf_cell", "mp_mindformers",
           "mf_cell_mf_loss", "summary_10", "summary_1"]
LABELS = {
    "none": "TrainOneStepCell, no callback",
    "mp_default": "mindpulse default (cell + Monitor + relay)",
    "mp_cell": "of which: MonitoredTrainOneStepCell alone",
    "loss_monitor": "MindSpore LossMonitor",
    "mf_loss": "MindFormers MFLossMonitor",
    "mp_script": "mindpulse, unmodified script (auto-attach: plain cell + grad probe + Monitor)",
    "mf_cell": "MindFormers MFTrainOneStepCell, no callback",
    "mp_mindformers": "mindpulse, MindFormers path (MFTrainOneStepCell + MindPulseMonitor)",
    "mf_cell_mf_loss": "MFTrainOneStepCell + MFLossMonitor",
    "summary_1": "SummaryCollector(collect_freq=1)",
    "summary_10": "SummaryCollector(collect_freq=10)",
}
MODELS = {
    # the recipe's model (cluster_configs/local_cpu.yaml)
    "small": dict(seq_length=64, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, batch_size=8,
                  timed=40, repeats=8, rounds=4),
    # sized so that a step takes about 200 ms on the machine it was first measured on
    "larger": dict(seq_length=128, hidden_size=256, num_layers=4, num_heads=4, intermediate_size=512, batch_size=8,
                   timed=20, repeats=3, rounds=2),
}
STEP_TARGET_MS = {"small": 13.0, "larger": 200.0}
"""The bare step each target is stated for (issue 13: <= 1.15x "at the 13 ms step", <= 1.03x
"at the ~200 ms step"). Fixed costs weigh less against a longer step, so on a machine where
the default batch gives a much longer step the batch is lowered to bring the bare step
closest to these (`calibrate_batch`); the batch sizes tried and their steps are reported."""
CALIBRATE_SLACK = 1.2
"""A bare step up to this factor over its target keeps the batch it has."""
CPU_OF = ("rank", "aggregator", "node agent")
"""Processes whose CPU time per step is reported (the rank is this process)."""
TARGETS = {"small": 1.05, "larger": 1.01}
"""Default monitoring against a bare TrainOneStepCell, the rank pinned to its own core
(`Layout`), mean step over all steps, worst repeat: <= 1.05x at the ~13 ms step, <= 1.01x at
the ~200 ms step."""
OVER_MF_LIMIT_MS = 0.5
"""...and in every repeat, default monitoring adds at most this much more to a step than
MindFormers' MFLossMonitor adds to the same bare step."""
PINNED_CONFIGS = ("none", "mp_default", "mp_cell", "loss_monitor", "mf_loss", "mp_script", "mf_cell",
                  "mp_mindformers", "mf_cell_mf_loss")
"""Configurations timed with the rank pinned (the targets' layout). SummaryCollector is timed
unpinned only: pinned, its writer process (the rank's child) shares the rank's one core and
a step took ~9x the bare step (117 ms against 13 ms in a quick run), which would take most of
the piece's time for a figure no target reads."""
UNPINNED_CONFIGS = ("none", "mp_default", "loss_monitor", "mf_loss", "summary_10", "summary_1")
"""Configurations timed again with every process free to use every core (shown beside)."""
WARMUP_STEPS = 3  # dropped from every run (first steps after a Model.train start)
COLLECT_FREQ = 10  # the default config's monitor.collect_freq: timed steps come in multiples of it
DEADLINE_SHARE = {("small", True): 0.3, ("small", False): 0.4, ("larger", True): 0.85, ("larger", False): 1.0}
"""Of --max-seconds: when each model's pinned and unpinned repeats must end (disturbed repeats
are run again only until then)."""
PROFILE_STEPS = {"small": 100, "larger": 30}
"""Steps of `mp_default` run once more with its parts clocked (`PartClocks`) after the timed
repeats: the rank's CPU per step by part."""
PATHS = {
    # path: (mindpulse's configuration, MFLossMonitor's on the same cell, that cell bare)
    "recipe": ("mp_default", "mf_loss", "none"),
    "unmodified Model.train script": ("mp_script", "mf_loss", "none"),
    "MindFormers": ("mp_mindformers", "mf_cell_mf_loss", "mf_cell"),
}
"""Issue 49's target 1, path by path: mindpulse's mean added time at most MFLossMonitor's on the
same cell (the recipe's monitored cell has no MFLossMonitor twin: its cell's own cost is in
mindpulse's figure, MFLossMonitor's is on the plain cell)."""
FIRST_STEP_LIMIT_MS = 50.0
"""Issue 49: the MindFormers path's first step (its Monitor's start included) adds at most this
to MFLossMonitor's first step on the same cell."""
CPU_LIMIT_MS = {"small": 0.3, "larger": 0.5}
"""Issue 49: the callback's own CPU (the training thread's, every step counted) per step."""
TRAIN_STEPS = 1_000_000
"""The runs' train.steps: a long run (no step of the benchmark is the last one)."""


class Launch:
    """The parts of a launch the rank talks to, for one model: the aggregator actor (as the
    launcher's attempt starts it) and one node agent with its relay (the launcher's
    `NodeAgents`), and the `RankSettings` the launcher would write to job.json."""

    def __init__(self, name: str, shape: dict, tmp: Path):
        import secrets

        import ray
        import yaml

        from mindpulse.aggregator.core import actor_name, start_aggregator
        from mindpulse.config import load_config
        from mindpulse.launcher.node_agents import NodeAgents
        from mindpulse.launcher.spec import aggregator_settings, rank_settings

        sets = [f"job.recipe.{k}={shape[k]}" for k in ("seq_length", "hidden_size", "num_layers", "num_heads",
                                                       "intermediate_size")]
        sets += ["world.nodes=1", "world.ranks_per_node=1", "train.mode=graph", f"train.steps={TRAIN_STEPS}",
                 f"train.batch_size={shape['batch_size']}", f"output.root={tmp}"]
        self.cfg, _ = load_config(None, sets)
        cfg = self.cfg
        self.run_dir = tmp / f"run-{name}"
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        plain = cfg.to_dict()
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(plain, sort_keys=False))
        # what launcher/attempt.py hands the aggregator (no resume, first attempt)
        agg_settings = aggregator_settings(cfg, config_yaml=(self.run_dir / "config.yaml").read_text())
        self.name = f"bench-overhead-{name}-{os.getpid()}"
        self.aggregator = start_aggregator(self.name, cfg.ray.namespace, self.run_dir, cfg.world.world_size,
                                           cfg.monitor.per_print_step, cfg.train.steps or None,
                                           node_id=ray.get_runtime_context().get_node_id(), settings=agg_settings)
        ray.get(self.aggregator.ping.remote(), timeout=120)
        token = secrets.token_hex(16)
        self.nodes = NodeAgents(cfg)
        self.nodes.place(self.aggregator, token)
        # the rank's process, for the telemetry's per-process figures: a stand-in, as in
        # bench/fanin.py, not this process (the agent's last stop ends a run's ranks still
        # running, and the rank here is the benchmark itself)
        self.stand_in = subprocess.Popen(["sleep", "86400"])
        self.nodes.start_telemetry({0: self.stand_in.pid}, lambda m: print(f"[overhead] {m}", file=sys.stderr))
        self.pids = {"aggregator": ray.get(self.aggregator.ping.remote(), timeout=60),
                     "node agent": self.nodes.pids()[0]}
        self.settings = rank_settings(cfg, run_dir=str(self.run_dir), run_id=self.name, attempt=0,
                                      aggregator=actor_name(self.name), ray_address="", relays=self.nodes.relays(),
                                      resume=None, relay_token=token)

    def close(self) -> dict:
        """Stop the node agent and the aggregator (as a launch ends); the aggregator's summary."""
        import ray

        snap: dict = {}
        self.nodes.flush(kill=False)
        try:
            snap = ray.get(self.aggregator.close.remote(), timeout=60)
        except Exception as exc:  # a benchmark still reports what it measured: said
            print(f"[overhead] aggregator close: {exc}", file=sys.stderr)
        self.nodes.shutdown()
        self.nodes.release()
        self.stand_in.kill()
        self.stand_in.wait()
        try:
            ray.kill(self.aggregator, no_restart=True)
        except Exception:  # best effort cleanup: the actor may be gone already
            pass
        return snap


class NoCheckpointWrites:
    """Rank 0's checkpoint writer with the writing left out: the verdict is waited for and
    followed, only the file is not written (saving is not monitoring)."""

    def __init__(self):
        self.asked = 0

    def write(self, directive, step, epoch, train_cell) -> None:
        self.asked += 1


class Rig:
    """One model, its two train cells (plain and monitored, over the same network and
    optimizer), its data, and the per-configuration callbacks."""

    def __init__(self, name: str, spec: dict, launch: Launch | None, tmp: Path):
        import mindspore as ms
        from mindspore import nn

        from mindpulse.workers.recipes.llama_finetune import ModelShape, build_model, lr_schedule, set_mode
        from mindpulse.workers.train_cell import MonitoredTrainOneStepCell

        self.name = name
        self.bs = spec["batch_size"]
        self.timed = spec["timed"] // spec["rounds"]  # per run
        self.steps = WARMUP_STEPS + self.timed + 1  # the last step's end has no next start
        shape = ModelShape(**{k: spec[k] for k in ModelShape.__dataclass_fields__})
        set_mode("graph", "CPU")
        ms.set_seed(1234)
        self.net = build_model(shape, self.bs)
        set_mode("graph", "CPU")  # mindformers may have switched the mode
        # the recipe's optimizer: a learning-rate schedule as a Tensor (one value per step)
        lrs = lr_schedule(1e-4, 5, 100_000)
        self.opt = nn.AdamWeightDecay(self.net.trainable_params(), learning_rate=ms.Tensor(np.array(lrs, np.float32)),
                                      weight_decay=0.0)
        self.plain = nn.TrainOneStepCell(self.net, self.opt)
        self.plain.set_train()
        self._script_cell: Any = None
        self._mf_cell: Any = None
        # as the recipe builds it (faults armed from the run's settings: none here)
        self.monitored = MonitoredTrainOneStepCell(self.net, self.opt)
        self.monitored.set_train()
        self.data = np.random.RandomState(0).randint(0, 256, (64, shape.seq_length + 1)).astype(np.int32)
        self.params = sum(int(np.prod(p.shape)) for p in self.net.trainable_params())
        self.shape = shape
        self.launch = launch
        self.tmp = tmp
        self.next_offset = 0
        self.monitors: list = []
        self.first_steps: dict[str, list[float]] = {}
        """Seconds from each run's start to its second step's start, by configuration."""

    def dataset(self, steps: int | None = None):
        import mindspore as ms

        data, bs, n = self.data, self.bs, steps or self.steps

        class Src:
            def __len__(self):
                return n * bs

            def __getitem__(self, i):
                return (data[i % len(data)],)

        return ms.dataset.GeneratorDataset(Src(), ["input_ids"], shuffle=False).batch(bs, drop_remainder=True)

    def callbacks(self, cfg: str, steps: int) -> tuple[object, list]:
        """(train cell, callbacks) of a configuration for a run of `steps` steps."""
        from mindspore.train.callback import LossMonitor, SummaryCollector

        if cfg == "none":
            return self.plain, []
        if cfg == "mp_cell":
            return self.monitored, []
        if cfg == "loss_monitor":
            return self.plain, [LossMonitor()]
        if cfg in ("summary_1", "summary_10"):
            d = tempfile.mkdtemp(prefix="summary-", dir=self.tmp)
            # the dataset graph is off: SummaryCollector crashes at step 1 with it here
            return self.plain, [SummaryCollector(d, collect_freq=1 if cfg == "summary_1" else 10,
                                                 collect_specified_data={"collect_dataset_graph": False})]
        if cfg == "mf_loss":
            from mindformers.core.callback import MFLossMonitor

            return self.plain, [MFLossMonitor(learning_rate=1e-4, per_print_times=1, origin_epochs=1,
                                              dataset_size=steps, global_batch_size=self.bs)]
        if cfg in ("mf_cell", "mf_cell_mf_loss"):
            cbs = []
            if cfg == "mf_cell_mf_loss":
                from mindformers.core.callback import MFLossMonitor

                cbs = [MFLossMonitor(learning_rate=1e-4, per_print_times=1, origin_epochs=1, dataset_size=steps,
                                     global_batch_size=self.bs)]
            return self.mf_cell(), cbs
        if cfg == "mp_script":
            from mindpulse.workers.monitor import Monitor

            # what auto-attach adds to an unmodified script's Model.train: the Monitor with the
            # launch's settings (train cell, batch and tokens found in Model.train) on the
            # script's own cell, whose gradient reducer carries the statistics probe
            mon = self._monitor(Monitor(settings=self.launch.settings, step_offset=self._offset(steps)))
            return self.script_cell(), [mon]
        if cfg == "mp_mindformers":
            from mindpulse.workers.mindformers_monitor import MindPulseMonitor

            # as mindformers_job.run_for_rank adds it (model shape, tokens per step)
            mon = self._monitor(MindPulseMonitor(
                settings=self.launch.settings, step_offset=self._offset(steps),
                model_shape=(self.shape.num_layers, self.shape.hidden_size, self.shape.seq_length),
                tokens_per_step=self.shape.seq_length * self.bs))
            return self.mf_cell(), [mon]
        if cfg == "mp_default":
            from mindpulse.workers.monitor import Monitor

            assert self.launch is not None
            # steps keep counting up across runs: the aggregator only ever sees new steps
            offset = self.next_offset
            self.next_offset = offset + steps + 1
            from mindpulse.workers.recipes.llama_finetune import flops_per_token

            # as the recipe gives them: the per-step TFLOPS work is part of what is measured
            mon = Monitor(settings=self.launch.settings, train_cell=self.monitored, step_offset=offset,
                          tokens_per_step=self.shape.seq_length * self.bs,
                          flops_per_token=flops_per_token(self.shape, self.params))
            mon.session.checkpoints = NoCheckpointWrites()
            self.monitors.append(mon)
            return self.monitored, [mon]
        raise ValueError(cfg)

    def _offset(self, steps: int) -> int:
        """Steps keep counting up across runs: the aggregator only ever sees new steps."""
        offset = self.next_offset
        self.next_offset = offset + steps + 1
        return offset

    def _monitor(self, mon):
        assert self.launch is not None
        mon.session.checkpoints = NoCheckpointWrites()
        self.monitors.append(mon)
        return mon

    def script_cell(self):
        """An unmodified script's `nn.TrainOneStepCell`, as auto-attach leaves it (the gradient
        statistics around its reducer: workers/grad_probe.py)."""
        if self._script_cell is None:
            from mindspore import nn

            from mindpulse.workers.grad_probe import attach_grad_stats

            cell = nn.TrainOneStepCell(self.net, self.opt)
            cell.set_train()
            done = attach_grad_stats(cell, 0)
            if done != "attached":
                raise RuntimeError(f"the script path's gradient statistics: {done}")
            self._script_cell = cell
        return self._script_cell

    def mf_cell(self):
        """MindFormers' train cell as the shipped YAML's runner_wrapper builds it (scale 1,
        clipping to norm 1: the global norm is in its outputs), over the same model."""
        if self._mf_cell is None:
            from mindformers.wrapper import MFTrainOneStepCell

            from mindpulse.workers.cpu_fallbacks import enable_cpu_fallbacks

            enable_cpu_fallbacks()
            cell = MFTrainOneStepCell(self.net, self.opt, use_clip_grad=True, max_grad_norm=1.0, scale_sense=1.0)
            cell.set_train()
            self._mf_cell = cell
        return self._mf_cell

    def run(self, cfg: str, steps: int | None = None) -> tuple[list[float], dict[str, float]]:
        """The timed steps' times of one run, and the CPU seconds per step (over the whole
        run) of this process and of the aggregator and node agent processes."""
        import mindspore as ms
        from mindspore.train import Model
        from mindspore.train.callback import Callback

        from mindpulse.workers.recipes.llama_finetune import set_mode

        class Stamp(Callback):
            def __init__(self):
                self.t: list[float] = []
                self.modes: set[int] = set()

            def on_train_begin(self, run_context):
                self.begin = time.perf_counter()

            def on_train_step_begin(self, run_context):
                self.t.append(time.perf_counter())
                self.modes.add(ms.get_context("mode"))

            def on_train_end(self, run_context):
                self.modes.add(ms.get_context("mode"))

        n = steps or self.steps
        cell, cbs = self.callbacks(cfg, n)
        set_mode("graph", "CPU")  # whatever a callback's constructor did to the context
        stamp = Stamp()
        procs = self.processes()
        cpu0 = {k: _cpu(p) for k, p in procs.items()}
        Model(cell).train(1, self.dataset(n), callbacks=[stamp, *cbs], dataset_sink_mode=False)
        cpu = {k: (_cpu(p) - cpu0[k]) / n for k, p in procs.items()}
        if stamp.modes != {ms.GRAPH_MODE}:
            raise RuntimeError(f"{cfg}: the execution mode changed during the run ({stamp.modes})")
        if len(stamp.t) != n:
            raise RuntimeError(f"{cfg}: {len(stamp.t)} of {n} steps ran")
        # from the run's start (every callback's on_train_begin: a Monitor's start) to the
        # second step's start: what a run's first step costs, for the MindFormers path's target
        self.first_steps.setdefault(cfg, []).append(stamp.t[1] - stamp.begin)
        return [b - a for a, b in zip(stamp.t, stamp.t[1:])][WARMUP_STEPS:], cpu

    def processes(self) -> dict:
        import psutil

        if not hasattr(self, "_procs"):
            self._procs = {"rank": psutil.Process()}
            for name, pid in (self.launch.pids.items() if self.launch is not None else ()):
                try:
                    self._procs[name] = psutil.Process(pid)
                except psutil.Error:
                    pass
        return self._procs

    def monitor_errors(self) -> int:
        return sum(m.session.errors + (m.session.channel.failures if m.session.channel else 0) for m in self.monitors)

    def saves_asked(self) -> int:
        return sum(getattr(m.session.checkpoints, "asked", 0) for m in self.monitors)


def calibrate_batch(mname: str, spec: dict) -> tuple[int, dict[int, float]]:
    """The batch size (the default, or a halving of it) whose bare `TrainOneStepCell` step
    is closest to `STEP_TARGET_MS[mname]` on this machine, and the median step (ms) of every
    batch tried. Starts at the default and halves while the step is over the target by more
    than `CALIBRATE_SLACK`; never raises the batch (a faster machine keeps the default)."""
    import mindspore as ms
    from mindspore import nn

    from mindpulse.workers.recipes.llama_finetune import ModelShape, build_model, set_mode

    target = STEP_TARGET_MS[mname]
    shape = ModelShape(**{k: spec[k] for k in ModelShape.__dataclass_fields__})
    tried: dict[int, float] = {}
    bs = spec["batch_size"]
    while bs >= 1:
        set_mode("graph", "CPU")
        ms.set_seed(1234)
        net = build_model(shape, bs)
        set_mode("graph", "CPU")
        cell = nn.TrainOneStepCell(net, nn.AdamWeightDecay(net.trainable_params(), 1e-4, weight_decay=0.0))
        cell.set_train()
        x = ms.Tensor(np.random.RandomState(0).randint(0, 256, (bs, shape.seq_length + 1)).astype(np.int32))
        for _ in range(3):
            cell(x).asnumpy()
        times = []
        t_end = time.perf_counter() + max(1.0, 10 * target / 1000)
        while len(times) < 5 or time.perf_counter() < t_end:
            t = time.perf_counter()
            cell(x).asnumpy()
            times.append(time.perf_counter() - t)
        tried[bs] = statistics.median(times) * 1000
        if tried[bs] <= target * CALIBRATE_SLACK:
            break
        bs //= 2
    best = min(tried, key=lambda b: abs(math.log(tried[b] / target)))
    return best, tried


def _cpu(proc) -> float:
    try:
        t = proc.cpu_times()
        return t.user + t.system
    except Exception:  # a process psutil can no longer read: no CPU figure
        return float("nan")


class Layout:
    """Where the processes run. Pinned: every thread of the rank (this process: the training
    thread and MindSpore's, the monitor's heartbeat) on core 0, and every other process of
    the run (Ray's GCS and raylet, the aggregator, the node agent, Ray's workers; all are
    this process's descendants) plus this benchmark's own load sampler on the other cores,
    as on an Ascend server where msrun `--bind_core` gives each rank its own cores and the
    node agent and aggregator never share them. Unpinned: everything on every core (a
    one-machine launch on this 2-core machine). A process or thread started later inherits
    its parent's cores; `apply` is called again before every timed run anyway."""

    RANK_CORES = frozenset({0})

    def __init__(self, helper_threads: list, ray_roots: list[int]):
        self.all = frozenset(os.sched_getaffinity(0))
        self.others = self.all - self.RANK_CORES
        self.helpers = helper_threads
        self.ray_roots = ray_roots
        """The processes `ray.init` started (GCS, raylet, ...): they and their descendants
        are the run's other processes; a process the rank starts itself (SummaryCollector's
        writer) is the rank's and stays on its cores."""
        self.pinned: bool | None = None

    @property
    def can_pin(self) -> bool:
        return bool(self.others) and self.RANK_CORES <= self.all

    def apply(self, pinned: bool) -> dict[str, int]:
        """Move every thread of every process of the run; how many threads went where."""
        import psutil

        rank = self.RANK_CORES if pinned else self.all
        others = self.others if pinned else self.all
        helpers = {t.native_id for t in self.helpers if t.native_id is not None}
        moved = {"rank": 0, "others": 0}
        for tid in _threads(os.getpid()):
            to_others = tid in helpers
            moved["others" if to_others else "rank"] += _set_cores(tid, others if to_others else rank)
        for pid in self._ray_processes(psutil):
            for tid in _threads(pid):
                moved["others"] += _set_cores(tid, others)
        self.pinned = pinned
        return moved

    def _ray_processes(self, psutil) -> set[int]:
        out: set[int] = set()
        for pid in self.ray_roots:
            try:
                proc = psutil.Process(pid)
                out.add(pid)
                out.update(c.pid for c in proc.children(recursive=True))
            except psutil.Error:  # a process that ended meanwhile
                pass
        return out

    def describe(self) -> str:
        if not self.pinned:
            return f"every process on cores {sorted(self.all)}"
        return f"the rank on core {sorted(self.RANK_CORES)}, every other process on cores {sorted(self.others)}"


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:  # the process ended meanwhile: nothing to move
        return []


def _set_cores(tid: int, cores: frozenset[int]) -> int:
    """`sched_setaffinity` moves one thread (a Linux task), not its process."""
    try:
        os.sched_setaffinity(tid, cores)
        return 1
    except OSError:  # a thread that ended meanwhile
        return 0


VERDICT = "verdict (rank 0, every 10th step: asking and reading it, its CPU, not the wait)"
WEIGHTS_COPY = "candidate's weights copied to the host (rank 0, every 10th step)"
PARTS = {
    # part: the functions (module, class or None, name) whose time it is, on the rank's training thread
    "reading the step's outputs (loss, statistics, learning rate)": [
        ("mindpulse.workers.monitor", "Monitor", "_split"), ("mindpulse.workers.monitor", "Monitor", "_probe_stats"),
        ("mindpulse.workers.monitor", None, "lr_of_step")],
    "collect steps: fingerprint and weight statistics": [
        ("mindpulse.workers.session", "RankSession", "_fingerprint"),
        ("mindpulse.workers.weight_stats", "WeightStats", "collect"),
        ("mindpulse.workers.weight_stats", "WeightStats", "keep_previous")],
    "packet encode": [("mindpulse.wire.protocol", "StepPacket", "encode")],
    "channel send": [("mindpulse.workers.channel", "RelayChannel", "send_step")],
    VERDICT: [("mindpulse.workers.channel", "RelayChannel", "decide"),
              ("mindpulse.workers.channel", "RelayChannel", "decide_later"),
              ("mindpulse.workers.channel", "RelayChannel", "verdict")],
    WEIGHTS_COPY: [("mindpulse.workers.weights_copy", "WeightsCopy", "take")],
    "lease check": [("mindpulse.workers.session", "RankSession", "_check_lease")],
    "step hooks (faults, profiler)": [("mindpulse.workers.session", "RankSession", "before_step"),
                                      ("mindpulse.workers.session", "RankSession", "after_step")],
}
PART_TOTAL = [("mindpulse.workers.monitor", "Monitor", "on_train_step_begin"),
              ("mindpulse.workers.monitor", "Monitor", "on_train_step_end")]
PART_RECORD = ("mindpulse.workers.session", "RankSession", "_record")
PART_SHIP = ("mindpulse.workers.session", "RankSession", "_ship")


class PartClocks:
    """The rank thread's CPU time in each part of the monitor's path: every function a part
    names is wrapped (for one run) to add its `time.thread_time()` span to the part. A
    wrapper costs well under a microsecond, so unlike a profiler the figures are the path's
    own. Nested functions are named once each (their spans are cumulative)."""

    def __init__(self):
        import importlib

        self.spent: dict[tuple, float] = {}
        self.wall: dict[tuple, float] = {}
        self.calls: dict[tuple, int] = {}
        self._undo: list[tuple[Any, str, Any]] = []
        self._importlib = importlib

    def __enter__(self) -> PartClocks:
        keys = {k for ks in PARTS.values() for k in ks} | set(PART_TOTAL) | {PART_RECORD, PART_SHIP}
        for key in keys:
            mod, cls, name = key
            owner = self._importlib.import_module(mod)
            if cls is not None:
                owner = getattr(owner, cls)
            own = name in vars(owner)  # else inherited: the wrapper goes on this class, then is removed
            orig = getattr(owner, name)
            self.spent[key], self.calls[key] = 0.0, 0

            def wrapped(*a, _orig=orig, _key=key, **kw):
                t, w = time.thread_time(), time.perf_counter()
                try:
                    return _orig(*a, **kw)
                finally:
                    self.spent[_key] += time.thread_time() - t
                    self.wall[_key] = self.wall.get(_key, 0.0) + time.perf_counter() - w
                    self.calls[_key] += 1

            setattr(owner, name, wrapped)
            self._undo.append((owner, name, orig if own else None))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, orig in reversed(self._undo):
            if orig is None:
                delattr(owner, name)
            else:
                setattr(owner, name, orig)

    def per_step(self, steps: int) -> dict[str, float]:
        """CPU seconds per step by part (parts do not overlap: the packet's build is `record`
        less what it calls that has a part of its own)."""

        def cum(keys) -> float:
            return sum(self.spent.get(k, 0.0) for k in keys)

        out = {part: cum(keys) for part, keys in PARTS.items()}
        collect = out["collect steps: fingerprint and weight statistics"]
        out["packet build (RankSession.record less the parts above)"] = max(
            0.0, cum([PART_RECORD]) - cum([PART_SHIP]) - collect)
        total = cum(PART_TOTAL)
        out["rest of the callback"] = max(0.0, total - sum(out.values()))
        out["callback total"] = total
        # what the rank waited for (wall clock less its own CPU: blocked, not working)
        for name, keys in (("wait: the verdict (wall, less its CPU)", PARTS[VERDICT]),
                           ("wait: the lease (wall, less its CPU)", PARTS["lease check"])):
            out[name] = max(0.0, sum(self.wall.get(k, 0.0) - self.spent.get(k, 0.0) for k in keys))
        out["callback wall total"] = sum(self.wall.get(k, 0.0) for k in PART_TOTAL)
        return {k: v / steps for k, v in out.items()}


def summarize(runs: list[list[float]]) -> dict:
    """Per-repeat means and medians of one configuration's timed steps."""
    means = [statistics.fmean(r) for r in runs]
    pooled = [x for r in runs for x in r]
    return {"mean": statistics.fmean(pooled), "median": statistics.median(pooled), "mean_min": min(means),
            "mean_max": max(means), "max": max(pooled), "rep_means": means,
            "rep_medians": [statistics.median(r) for r in runs]}


def _model_result(mname: str, spec: dict, rig: Rig, calibration: dict, cfgs: list[str], g: dict, repeats: int,
                  layout: str, pinned: bool) -> dict:
    """One model's figures in one layout, from its kept repeats."""
    rows = {}
    kept = g["kept"]
    base = [statistics.fmean(r["none"][0]) for r in kept]
    for c in cfgs:
        s = summarize([r[c][0] for r in kept])
        ratios = [m / b for m, b in zip(s["rep_means"], base)]
        med_ratios = [m / statistics.median(r["none"][0]) for m, r in zip(s["rep_medians"], kept)]
        cpu = {k: statistics.fmean(r[c][1][k] for r in kept) for k in kept[0][c][1]}
        rows[c] = {"label": LABELS[c], "step_s": s, "cpu_s_per_step": cpu,
                   "ratio": {"mean": statistics.fmean(ratios), "min": min(ratios), "max": max(ratios),
                             "worst": max(ratios), "per_repeat": ratios},
                   "median_ratio": {"mean": statistics.fmean(med_ratios), "min": min(med_ratios),
                                    "max": max(med_ratios)}}
    over_mf = None
    if "mp_default" in rows and "mf_loss" in rows:
        # per repeat: what mindpulse adds to the bare step, less what MFLossMonitor adds to it
        over_mf = [(m - f) * 1000 for m, f in zip(rows["mp_default"]["step_s"]["rep_means"],
                                                  rows["mf_loss"]["step_s"]["rep_means"])]
    return {
        "shape": {k: v for k, v in spec.items() if k not in ("timed", "repeats", "rounds")}, "params": rig.params,
        "step_target_ms": STEP_TARGET_MS.get(mname), "batch_calibration": calibration,
        "timed_steps": spec["timed"], "rounds": spec["rounds"], "repeats": len(kept), "repeats_asked": repeats,
        "discarded": g["discarded"], "disturbed_kept": g["disturbed_kept"], "foreign_cores": g["foreign"],
        "waited_s": g["waited_s"], "configs": rows, "layout": layout, "pinned": pinned, "over_mf_ms": over_mf,
        "mindpulse": None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats-small", type=int, default=MODELS["small"]["repeats"])
    ap.add_argument("--repeats-larger", type=int, default=MODELS["larger"]["repeats"])
    ap.add_argument("--models", default="small,larger")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="none always runs (the baseline)")
    ap.add_argument("--timed-steps-small", type=int, default=MODELS["small"]["timed"])
    ap.add_argument("--timed-steps-larger", type=int, default=MODELS["larger"]["timed"])
    ap.add_argument("--rounds-small", type=int, default=MODELS["small"]["rounds"],
                    help="runs per configuration and repeat, interleaved; the timed steps split among them")
    ap.add_argument("--rounds-larger", type=int, default=MODELS["larger"]["rounds"])
    for m in MODELS:
        ap.add_argument(f"--batch-{m}", default="auto",
                        help=f"batch size, or 'auto': the default ({MODELS[m]['batch_size']}) halved until the bare "
                             f"step is within {CALIBRATE_SLACK}x of the ~{STEP_TARGET_MS[m]:.0f} ms its target names")
    ap.add_argument("--no-pin", action="store_true",
                    help="time only with every process free to use every core (no pinned layout)")
    ap.add_argument("--pinned-only", action="store_true",
                    help="time only in the targets' layout (the rank pinned), not again unpinned")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="skip the profiled run of the default path (the rank's CPU per step by part)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="2 repeats, 10 or 20 timed steps (a smoke run)")
    ap.add_argument("--max-seconds", type=float, default=300.0,
                    help="time after which disturbed repeats are no longer run again")
    args = ap.parse_args()
    configs = ["none"] + [c for c in args.configs.split(",") if c and c != "none"]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown configurations {sorted(unknown)} (known: {CONFIGS})")
    if args.quick:
        args.repeats_small = args.repeats_larger = 2
        args.timed_steps_small, args.timed_steps_larger = 20, 10
        args.rounds_small, args.rounds_larger = 2, 1
    for m in MODELS:
        timed, rounds = getattr(args, f"timed_steps_{m}"), getattr(args, f"rounds_{m}")
        if rounds < 1 or timed % (rounds * COLLECT_FREQ):
            ap.error(f"--timed-steps-{m} ({timed}) must split into --rounds-{m} ({rounds}) runs of a multiple of "
                     f"{COLLECT_FREQ} steps (collect steps in every run)")
    t0 = time.time()
    load = C.ForeignLoad(interval_s=1.0).start()
    logging.basicConfig(level=logging.WARNING)
    tmp = Path(tempfile.mkdtemp(prefix="mindpulse-bench-overhead-"))
    import mindspore  # noqa: F401  (mindspore before ray, in this order)

    # mindformers' context singleton switches MindSpore to PYNATIVE the first time it is
    # created (MFLossMonitor creates it in its first step): create it now, set GRAPH after
    from mindformers.core.context.build_context import get_context as mf_get_context

    mf_get_context("mode")
    from mindpulse.workers.recipes.llama_finetune import set_mode

    set_mode("graph", "CPU")

    import psutil
    import ray

    before_ray = {c.pid for c in psutil.Process().children()}
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             logging_level=logging.WARNING, configure_logging=False, namespace="mindpulse")
    layout = Layout([load._thread], [c.pid for c in psutil.Process().children() if c.pid not in before_ray])
    if args.no_pin or not layout.can_pin:
        print(f"[overhead] not pinned: {'--no-pin' if args.no_pin else f'only cores {sorted(layout.all)}'}",
              file=sys.stderr, flush=True)
    layouts = [False] if args.no_pin or not layout.can_pin else [True] if args.pinned_only else [True, False]
    results: dict[str, dict] = {}
    profiles: dict[str, dict[str, float]] = {}
    for mname in args.models.split(","):
        spec = dict(MODELS[mname])
        layout.apply(layouts[0])  # the targets' layout: the bare step is calibrated in it
        batch_arg = getattr(args, f"batch_{mname}")
        calibration: dict[int, float] = {}
        if batch_arg == "auto":
            spec["batch_size"], calibration = calibrate_batch(mname, spec)
            print(f"[overhead] {mname}: batch {spec['batch_size']} (bare step ms by batch: "
                  + ", ".join(f"{b}: {t:.1f}" for b, t in calibration.items()) + ")", file=sys.stderr, flush=True)
        else:
            spec["batch_size"] = int(batch_arg)
        spec["timed"] = getattr(args, f"timed_steps_{mname}")
        spec["rounds"] = getattr(args, f"rounds_{mname}")
        launch = Launch(mname, spec, tmp) if "mp_default" in configs else None
        rig = Rig(mname, spec, launch, tmp)
        for cfg in configs:  # compile outside the measurement
            rig.run(cfg, steps=WARMUP_STEPS + 3)

        for pinned in layouts:
            cfgs = configs if len(layouts) == 1 else [
                c for c in configs if c in (PINNED_CONFIGS if pinned else UNPINNED_CONFIGS)]
            repeats = getattr(args, f"repeats_{mname}")
            if not pinned and len(layouts) > 1:
                repeats = max(2, math.ceil(repeats / 2))

            def one_repeat(rep: int, rig=rig, mname=mname, rounds=spec["rounds"], cfgs=cfgs, pinned=pinned
                           ) -> dict[str, tuple[list[float], dict[str, float]]]:
                times: dict[str, list[float]] = {c: [] for c in cfgs}
                cpus: dict[str, list[dict[str, float]]] = {c: [] for c in cfgs}
                for k in range(rounds):
                    for cfg in (cfgs if (rep + k) % 2 == 0 else list(reversed(cfgs))):
                        layout.apply(pinned)  # a process started since (a Ray worker) goes where it belongs
                        t, cpu = rig.run(cfg)
                        times[cfg] += t
                        cpus[cfg].append(cpu)
                out = {c: (times[c], {k: statistics.fmean(d[k] for d in cpus[c]) for k in cpus[c][0]}) for c in cfgs}
                print(f"[overhead] {mname} {'pinned' if pinned else 'unpinned'} repeat {rep + 1} done "
                      f"({time.time() - t0:.0f}s): "
                      + ", ".join(f"{c} {statistics.fmean(v[0]) * 1000:.1f}" for c, v in out.items()),
                      file=sys.stderr, flush=True)
                return out

            deadline = t0 + args.max_seconds * DEADLINE_SHARE.get((mname, pinned), 1.0)
            layout.apply(pinned)
            g = C.gated_repeats(load, repeats, deadline, one_repeat,
                                log=lambda m, name=mname: print(f"[overhead] {name}: {m}", file=sys.stderr, flush=True))
            key = mname if pinned or len(layouts) == 1 else f"{mname} (unpinned)"
            results[key] = _model_result(mname, spec, rig, calibration, cfgs, g, repeats, layout.describe(), pinned)
            if pinned and launch is not None and args.profile:
                with PartClocks() as clocks:
                    _, cpu = rig.run("mp_default", steps=PROFILE_STEPS[mname])
                profiles[mname] = dict(clocks.per_step(PROFILE_STEPS[mname]),
                                       **{"the rank process, every thread": cpu["rank"]})
        fs = rig.first_steps
        first: dict[str, Any] = {}
        for path, (mp, mf, _) in PATHS.items():
            if fs.get(mp) and fs.get(mf):
                # warm-up runs included (their graphs were compiled by then: the first run of
                # each configuration is dropped)
                a, b = fs[mp][1:], fs[mf][1:]
                if a and b:
                    first[path] = (statistics.fmean(a) - statistics.fmean(b)) * 1000
                    first["runs"] = min(len(a), len(b))
        if mname in results:
            results[mname]["first_step_ms"] = first
        snap = launch.close() if launch is not None else {}
        for key in (mname, f"{mname} (unpinned)"):
            if key in results and launch is not None:
                results[key]["mindpulse"] = {
                    "monitor_wait_s": snap.get("monitor_wait_s"), "steps_reduced": snap.get("steps_completed"),
                    "packets": snap.get("packets"), "monitor_errors": rig.monitor_errors(),
                    "saves_asked": rig.saves_asked()}

    ray.shutdown()
    load.stop()
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)

    targets = []
    for mname, r in results.items():
        if mname not in TARGETS or "mp_default" not in r["configs"]:
            continue
        ra = r["configs"]["mp_default"]["ratio"]
        floor = r["configs"].get("loss_monitor", {}).get("ratio")
        beside = results.get(f"{mname} (unpinned)", {}).get("configs", {}).get("mp_default", {}).get("ratio")
        targets.append({"model": mname, "none_step_s": r["configs"]["none"]["step_s"]["mean"], "pinned": r["pinned"],
                        "limit": TARGETS[mname], "mean_ratio": ra["mean"], "worst_ratio": ra["worst"],
                        "met": ra["worst"] <= TARGETS[mname], "repeats": r["repeats"],
                        "noise_floor_worst": floor["worst"] if floor else None,
                        "unpinned_worst": beside["worst"] if beside else None,
                        "unpinned_mean": beside["mean"] if beside else None})
        over = r.get("over_mf_ms")
        if over:
            targets.append({"model": mname, "kind": "over_mf", "pinned": r["pinned"], "limit_ms": OVER_MF_LIMIT_MS,
                            "worst_ms": max(over), "mean_ms": statistics.fmean(over), "repeats": len(over),
                            "met": max(over) <= OVER_MF_LIMIT_MS,
                            "none_step_s": r["configs"]["none"]["step_s"]["mean"]})
        for path, (mp, mf, bare) in PATHS.items():
            if not all(c in r["configs"] for c in (mp, mf, bare)):
                continue
            reps = r["configs"]
            base = reps[bare]["step_s"]["rep_means"]
            mp_added = [(m - b) * 1000 for m, b in zip(reps[mp]["step_s"]["rep_means"], base)]
            mf_added = [(m - b) * 1000 for m, b in zip(reps[mf]["step_s"]["rep_means"], base)]
            over = [a - f for a, f in zip(mp_added, mf_added)]
            targets.append({"model": mname, "kind": "path", "path": path, "pinned": r["pinned"],
                            "mp_added_ms": statistics.fmean(mp_added), "mf_added_ms": statistics.fmean(mf_added),
                            "worst_over_ms": max(over), "repeats": len(over),
                            "met": statistics.fmean(mp_added) <= statistics.fmean(mf_added),
                            "worst_met": max(over) <= 0.0,
                            "bare_step_s": reps[bare]["step_s"]["mean"], "disturbed_kept": r.get("disturbed_kept")})
        first = r.get("first_step_ms") or {}
        if "MindFormers" in first:
            targets.append({"model": mname, "kind": "first_step", "path": "MindFormers", "pinned": r["pinned"],
                            "added_ms": first["MindFormers"], "limit_ms": FIRST_STEP_LIMIT_MS,
                            "met": first["MindFormers"] <= FIRST_STEP_LIMIT_MS, "runs": first.get("runs")})
    for mname, parts in profiles.items():
        cpu = parts.get("callback total")
        if cpu is not None and mname in CPU_LIMIT_MS:
            targets.append({"model": mname, "kind": "callback_cpu", "cpu_ms": cpu * 1000, "limit_ms": CPU_LIMIT_MS[mname],
                            "met": cpu * 1000 <= CPU_LIMIT_MS[mname],
                            "verdict_wait_ms": parts.get("wait: the verdict (wall, less its CPU)", 0.0) * 1000})
    out = {"results": results, "targets": targets, "profile": profiles,
           "profile_steps": {m: PROFILE_STEPS[m] for m in profiles}}
    print(render(out))
    C.write_result(args.json, "overhead", out, t0)


def render(out: dict) -> str:
    lines = []
    for mname, r in out["results"].items():
        sh = r["shape"]
        quiet = (f"; {C.plural(r['discarded'], 'repeat')} beside other processes' load discarded and run again"
                 if r.get("discarded") else "")
        if r.get("disturbed_kept"):
            quiet += f"; {C.plural(r['disturbed_kept'], 'repeat')} kept although other processes were busy (no time left)"
        lines.append(f"\n{mname} model ({r.get('layout', 'unpinned')}): {sh['num_layers']} layers, hidden {sh['hidden_size']}, seq {sh['seq_length']}, "
                     f"batch {sh['batch_size']}, {r['params'] / 1e6:.2f} M parameters; {r['repeats']} repeats x "
                     f"{r['timed_steps']} timed steps per configuration, in {r.get('rounds', 1)} interleaved runs of "
                     f"{r['timed_steps'] // r.get('rounds', 1)}{quiet}\n")
        if r.get("batch_calibration"):
            cal = r["batch_calibration"]
            lines.append(f"batch {sh['batch_size']} chosen so the bare step is closest to the ~{r['step_target_ms']:.0f} "
                         "ms its target names (bare TrainOneStepCell, median step by batch size: "
                         + ", ".join(f"{b}: {t:.1f} ms" for b, t in cal.items()) + ")\n")
        rows = []
        base = r["configs"]["none"]["step_s"]["mean"]
        for v in r["configs"].values():
            st, ra = v["step_s"], v["ratio"]
            cpu = v.get("cpu_s_per_step") or {}
            rows.append([v["label"], C.fmt_ms(st["mean"]), f"{C.fmt_ms(st['mean_min'])}-{C.fmt_ms(st['mean_max'])}",
                         C.fmt_ms(st["median"]), C.fmt_ms(st["max"]), f"{(st['mean'] - base) * 1000:+.2f}",
                         f"{ra['mean']:.3f}", f"{ra['min']:.3f}-{ra['max']:.3f}", f"{ra['worst']:.3f}",
                         f"{v['median_ratio']['mean']:.3f}",
                         " / ".join(f"{cpu[k] * 1000:.1f}" if k in cpu else "-" for k in CPU_OF)])
        lines.append(C.table(["configuration", "mean step ms", "mean: range over repeats", "median step ms",
                              "slowest step ms", "mean over baseline ms", "ratio (of means)", "ratio range",
                              "worst repeat", "ratio of medians", "CPU ms per step: " + " / ".join(CPU_OF)], rows))
        mp = r.get("mindpulse")
        if mp:
            pk = mp.get("packets") or {}
            lines.append(f"\nmindpulse path: the rank blocked on the aggregator {mp.get('monitor_wait_s') or 0:.3f} s "
                         f"in all over {mp.get('steps_reduced')} reduced steps (`monitor_wait_s`, warm-up and "
                         f"decision steps included); {mp.get('saves_asked')} checkpoint saves asked for (not "
                         f"written); packets accepted {pk.get('accepted')}, rejected {pk.get('rejected')}; monitor "
                         f"errors and channel failures {mp.get('monitor_errors')}")
    lines.append("")
    for t in out["targets"]:
        where = "rank pinned to its own core" if t.get("pinned") else "unpinned"
        if t.get("kind") in ("path", "first_step", "callback_cpu"):
            continue  # below
        if t.get("kind") == "over_mf":
            lines.append(
                f"- target ({t['model']} model, {t['none_step_s'] * 1000:.0f} ms step, {where}): default mindpulse path "
                f"adds <= MFLossMonitor's added time + {t['limit_ms']:.1f} ms, worst repeat: {t['worst_ms']:+.2f} ms "
                f"(mean {t['mean_ms']:+.2f} ms, n={t['repeats']}): {'met' if t['met'] else 'MISSED'}")
            continue
        lines.append(
            f"- target ({t['model']} model, {t['none_step_s'] * 1000:.0f} ms step, {where}): default mindpulse path "
            f"<= {t['limit']:.2f}x a bare TrainOneStepCell, mean step over all steps, worst repeat: "
            f"{t['worst_ratio']:.3f} (mean over repeats {t['mean_ratio']:.3f}, n={t['repeats']}): "
            f"{'met' if t['met'] else 'MISSED'}"
            + (f"; unpinned beside it: worst {t['unpinned_worst']:.3f} (mean {t['unpinned_mean']:.3f})"
               if t.get("unpinned_worst") is not None else ""))
        if t.get("noise_floor_worst") is not None:
            lines.append(
                f"  - noise floor in the same run: MindSpore's LossMonitor (one scalar read a step) has a worst repeat of "
                f"{t['noise_floor_worst']:.3f}x" + (" — above the limit itself: on this machine a repeat's ratio moves "
                                                    "by more than the target for reasons other than monitoring"
                                                    if t["noise_floor_worst"] > t["limit"] else ""))
    for t in out["targets"]:
        where = "rank pinned to its own core" if t.get("pinned") else "unpinned"
        if t.get("kind") == "path":
            lines.append(
                f"- target ({t['model']} model, {where}), {t['path']} path: mindpulse's mean added time "
                f"{t['mp_added_ms']:+.2f} ms a step <= MFLossMonitor's on the same cell {t['mf_added_ms']:+.2f} ms "
                f"(bare step {t['bare_step_s'] * 1000:.0f} ms; worst repeat of the difference {t['worst_over_ms']:+.2f} "
                f"ms, n={t['repeats']}): {'met' if t['met'] else 'MISSED'}"
                + ("" if t["worst_met"] or not t["met"] else " (not in every repeat)"))
        elif t.get("kind") == "first_step":
            lines.append(
                f"- target ({t['model']} model, {where}): the MindFormers path's first step (its Monitor's start "
                f"included) adds {t['added_ms']:+.1f} ms to MFLossMonitor's on the same cell (mean over "
                f"{t['runs']} runs, graphs compiled) <= {t['limit_ms']:.0f} ms: {'met' if t['met'] else 'MISSED'}")
        elif t.get("kind") == "callback_cpu":
            lines.append(
                f"- target ({t['model']} model): the callback's own CPU {t['cpu_ms']:.3f} ms a step (training "
                f"thread, every step counted) <= {t['limit_ms']:.1f} ms: {'met' if t['met'] else 'MISSED'}; "
                f"rank 0's wait for the checkpoint verdict: {t['verdict_wait_ms']:.3f} ms a step")
    for mname, parts in (out.get("profile") or {}).items():
        n = (out.get("profile_steps") or {}).get(mname)
        lines.append(f"\nThe rank's CPU per step by part ({mname} model, pinned; one more run of the default path over "
                     f"{n} steps with each part's functions wrapped to add up the training thread's CPU clock; the "
                     "waits are wall-clock time blocked on the relay; the last row is the whole rank process's CPU, "
                     "every thread, training included):\n")
        total = parts.get("callback total") or 0.0
        not_cpu = ("the rank process, every thread", "callback wall total")
        rows = [[k, f"{v * 1000:.3f}", f"{v / total * 100:.0f}%" if total and k not in not_cpu and
                 not k.startswith("wait:") else "-"] for k, v in parts.items()]
        lines.append(C.table(["part", "ms per step", "of the callback's CPU"], rows))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
