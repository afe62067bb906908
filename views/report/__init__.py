"""Offline report of a run directory: PNG plots and one self-contained HTML page, and the
run's end-of-run summary as console text (`mindpulse report`, and the launcher at the end of
every run).

One module a job, each reading the one before it:

* `data` — `load_run`: what the run left (metrics replayed through `run_reader`, summary,
  config, anomalies, checkpoint manifest, profiler folders) as one `RunData`;
* `headline` — the verdict and the figures that matter (`Headline`), computed once;
* `rows` — the rank, attempt, anomaly and checkpoint tables as display strings;
* `markers` — anomaly, checkpoint and restart markers on the figures, and their links;
* `plots` — the figures (matplotlib's Agg canvas; only what was measured);
* `text` — `final_tables`: the console text;
* `html` — the page, and `build_report`, which writes it with the figures.

Every number, size, duration and date is written by `mindpulse.common.formatting`.
"""

from .data import RunData, load_run
from .headline import Headline, compute_text, goodput_text, headline
from .html import build_report
from .plots import PLOT_NAMES
from .text import final_tables

__all__ = ["build_report", "compute_text", "final_tables", "goodput_text", "headline", "load_run", "Headline",
           "RunData", "PLOT_NAMES"]
