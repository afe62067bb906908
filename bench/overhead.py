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
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import _common as C  # noqa: E402
from _overhead_config import (  # noqa: E402
    CALIBRATE_SLACK,
    COLLECT_FREQ,
    CONFIGS,
    DEADLINE_SHARE,
    MODELS,
    PATHS,
    PINNED_CONFIGS,
    PROFILE_STEPS,
    STEP_TARGET_MS,
    UNPINNED_CONFIGS,
    WARMUP_STEPS,
)
from _overhead_layout import Layout  # noqa: E402
from _overhead_parts import CALLBACKS_ALONE, PartClocks  # noqa: E402
from _overhead_report import model_result, render, targets_of  # noqa: E402
from _overhead_rig import Launch, Rig, calibrate_batch  # noqa: E402

__all__ = ["main", "render"]  # render: bench/run_all.py writes this piece's section with it


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
            results[key] = model_result(mname, spec, rig, calibration, cfgs, g, repeats, layout.describe(), pinned)
            if pinned and launch is not None and args.profile:
                with PartClocks() as clocks:
                    _, cpu = rig.run("mp_default", steps=PROFILE_STEPS[mname])
                # once more with the callbacks alone clocked: the target's figure carries none of
                # the parts' wrappers (~2 us of thread clock reads each call)
                with PartClocks(only_total=True) as alone:
                    rig.run("mp_default", steps=PROFILE_STEPS[mname])
                profiles[mname] = dict(clocks.per_step(PROFILE_STEPS[mname]),
                                       **{"the rank process, every thread": cpu["rank"],
                                          CALLBACKS_ALONE: alone.per_step(PROFILE_STEPS[mname])["callback total"]})
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

    targets = targets_of(results, profiles)
    out = {"results": results, "targets": targets, "profile": profiles,
           "profile_steps": {m: PROFILE_STEPS[m] for m in profiles}}
    print(render(out))
    C.write_result(args.json, "overhead", out, t0)


if __name__ == "__main__":
    main()
