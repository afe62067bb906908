"""mindpulse: launch a data-parallel MindSpore fine-tune on every card and watch it as one job.

The code lives in three folders mapped under this import root: `mindpulse.launcher`
(driver: CLI, config, Ray, backends), `mindpulse.workers` (inside a rank) and
`mindpulse.aggregator` (packets, reduction, decisions, sinks).
"""

__version__ = "0.1.0"
