"""What a run config resolves to while the job runs: the hang limit `monitor.hang_timeout_s:
auto` gives after the steps seen so far, the schedule of special steps and a rank monitor's
settings (both computed once in the launcher and shipped to every rank).
"""

from __future__ import annotations

import math

from mindpulse.config.rank_settings import MonitorSettings, Schedule
from mindpulse.config.schema import Device, RunConfig

AUTO_HANG_MIN_S = 60.0
"""`monitor.hang_timeout_s: auto`: never below this (published detectors name a stuck rank in 15-30 s;
HCCL's own timeout is 1,800 s)."""
AUTO_HANG_STEPS = 10
"""... from this many reduced steps on: 20 x their p99 step time (before: AUTO_HANG_EARLY_S)."""
AUTO_HANG_FACTOR = 20.0
AUTO_HANG_EARLY_S = 300.0
CPU_AUTO_HANG_S = 25.0
"""`auto` on CPU ranks: MindSpore's CPU collectives give up on a peer after 30 s (a ring
all-reduce's receive, measured with MindSpore 2.9; MS_RECEIVE_MSG_TIMEOUT does not change it),
so a stuck rank would surface as a collective error of the ranks waiting for it, named as the
root cause. The hang is named before that, unless the steps themselves are longer: then 2x the
slowest rank's step time (p99, or the longest so far before 10 steps), never less than a step."""


def auto_hang_timeout(step_times: list[float], device: str = "") -> float:
    """The hang limit `auto` gives after these reduced steps' step times (the slowest rank's,
    newest last): max(60 s, 20 x their p99) from 10 steps on, 300 s before; on CPU ranks at
    most 25 s (CPU_AUTO_HANG_S)."""
    times = sorted(t for t in step_times if t is not None and math.isfinite(t) and t >= 0)
    p99 = times[max(0, math.ceil(0.99 * len(times)) - 1)] if len(times) >= AUTO_HANG_STEPS else None
    limit = AUTO_HANG_EARLY_S if p99 is None else max(AUTO_HANG_MIN_S, AUTO_HANG_FACTOR * p99)
    if device != Device.CPU.value:
        return limit
    step = p99 if p99 is not None else (times[-1] if times else 0.0)
    return min(limit, max(CPU_AUTO_HANG_S, 2 * step))



def schedule_of(cfg: RunConfig) -> Schedule:
    """The run's special steps, computed once here and shipped to every rank."""
    return Schedule(
        total_steps=cfg.train.steps,
        collect_freq=cfg.monitor.collect_freq,
        max_lag_steps=cfg.monitor.max_lag_steps,
        save_best=cfg.checkpoint.save_best_ckpt,
        save_every=cfg.checkpoint.save_checkpoint_steps,
        best_every=cfg.checkpoint.best_every_steps,
        eval_every=cfg.eval.every_steps,
        eval_per_epoch=cfg.eval.per_epoch,
    )


def monitor_settings_of(cfg: RunConfig) -> MonitorSettings:
    """What a rank's monitor needs of `monitor.*`."""
    m = cfg.monitor
    return MonitorSettings(
        decision_timeout_s=m.decision_timeout_s,
        # a few beats per hang timeout, never slower than every 5 s
        heartbeat_s=max(0.5, min(5.0, (m.hang_timeout_s or AUTO_HANG_MIN_S) / 4)),
        weight_stats=m.weight_stats,
        histogram_regex=m.histogram_regex,
    )
