"""The in-rank benchmark's moving parts for one model (bench/overhead.py): the launch the rank
talks to (aggregator actor, node agent and relay, the rank's settings), the model with its
train cells and each configuration's callbacks, one timed `Model.train` run, and the batch
calibration that brings the bare step to the length a target names."""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _overhead_config import CALIBRATE_SLACK, DATA_SEQUENCES, STEP_TARGET_MS, TRAIN_STEPS, WARMUP_STEPS


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
        # more random sequences than the benchmark's steps can learn by heart, taken in turn
        # across runs (`dataset`): on a few batches seen again and again the small model drove its
        # loss to 0.03 and diverged at step 1,476 (Adam on near-zero gradients), and the monitor
        # rightly stopped the run it watched for a gradient explosion
        self.data_pos = 0
        self.data = np.random.RandomState(0).randint(0, 256, (DATA_SEQUENCES, shape.seq_length + 1)).astype(np.int32)
        self.params = sum(int(np.prod(p.shape)) for p in self.net.trainable_params())
        self.shape = shape
        self.launch = launch
        self.tmp = tmp
        self.next_offset = 0
        self.monitors: list = []
        self.first_steps: dict[str, list[float]] = {}
        """Seconds from each run's start to its second step's start, by configuration."""

    def dataset(self, steps: int | None = None):
        """The next `steps` batches: each run goes on through the sequences where the last one
        stopped (a run that started at the first sequence each time trained on its first few
        batches only, and over the benchmark's ~1,500 steps the model learnt them by heart)."""
        import mindspore as ms

        data, bs, n = self.data, self.bs, steps or self.steps
        start, self.data_pos = self.data_pos, self.data_pos + n * bs

        class Src:
            def __len__(self):
                return n * bs

            def __getitem__(self, i):
                return (data[(start + i) % len(data)],)

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
            stops = [m.session.stopped for m in cbs  # this run's monitor, where it has one
                     if getattr(getattr(m, "session", None), "stopped", None) is not None]
            raise RuntimeError(f"{cfg}: {len(stamp.t)} of {n} steps ran"
                               + (f" (the monitor stopped it at step {stops[0].step}: {stops[0].reason})" if stops else ""))
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
