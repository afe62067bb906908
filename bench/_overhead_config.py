"""What the in-rank benchmark (bench/overhead.py) times and judges: its configurations and
their labels, the two models, the layouts each configuration runs in, and the targets with
the bare step each is stated for."""

from __future__ import annotations

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
PROFILE_STEPS = {"small": 100, "larger": 100}
"""Steps of `mp_default` run once more with its parts clocked (`PartClocks`) after the timed
repeats: the rank's CPU per step by part (100 on both models: a run's one-time costs, its first
fingerprint and the first use of its copies, spread over as many steps as a fine-tune's first
hundred, not over the 30 steps the larger model had before)."""
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
DATA_SEQUENCES = 8192
"""Random training sequences (a run cycles through them): too many for either model to learn by
heart over the benchmark's steps, so its loss and gradients stay those of a healthy run."""
