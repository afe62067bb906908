"""The pieces `make bench` runs (bench/run_all.py): each piece's script, arguments and planned
time, the budgets, the reference machine's speed the plans are for, and what one attempt at a
piece left."""

from __future__ import annotations

from dataclasses import dataclass, field

import _common as C

FOREIGN_BUSY_CORES = C.QUIET_CORES
"""Mean cores used by other processes above which a piece counts as disturbed."""


RULES_PLANNED_S = 2700.0
"""The rules campaign (bench/rules.py): 12 healthy launches (13 min on 2026-12-07) and 40 fault
launches, 5 rounds of 8 kinds (about 6 min a round), each paying the launch's start-up
(about 15 s here) besides its steps."""
PERF_BUDGET_S = 1200.0
"""The performance pieces (all but the rules campaign) fit in 20 minutes on this machine."""


@dataclass
class Piece:
    name: str
    script: str
    args: list[str]
    planned_s: float
    """Expected wall time on the 2-core reference machine (for the budget)."""
    reduced_args: list[str] = field(default_factory=list)
    """Arguments used instead when the budget is short."""
    reduced_s: float = 0.0
    max_s: float = 0.0
    """Gated pieces (repeats beside foreign load are run again inside the piece): the most
    time they may take with such reruns (`--max-seconds`); 0 for the others."""


PIECES = [
    Piece("npu_smi", "npu_smi_parse.py", ["--seconds", "1.0", "--repeats", "5"], 15),
    Piece("grad_cell", "grad_cell.py", ["--steps", "10", "--repeats", "5"], 80,
          ["--steps", "6", "--repeats", "3"], 50, max_s=110),
    Piece("overhead", "overhead.py", [], 430, ["--repeats-small", "5", "--repeats-larger", "2"], 260, max_s=430),
    # replayed senders (bench/_replay.py): 40 s a run, so the 32,768-rank target's row is over ~40 steps
    Piece("fanin", "fanin.py", ["--targets", "--repeats", "2", "--seconds", "40", "--agent-seconds", "20"], 330,
          ["--targets", "--repeats", "1", "--seconds", "30", "--agent-repeats", "2", "--agent-seconds", "15"], 200),
    Piece("exporter", "exporter.py", ["--scrapes", "10", "--sink-steps", "300"], 60,
          ["--scrapes", "5", "--sink-steps", "100"], 30),
    # planned times estimated from a 64-rank smoke run (3 sinks, 36 s), not yet from a timed 4,096-rank one
    Piece("fanin_sinks", "fanin.py", ["--ranks", "4096", "--rate", "2", "--seconds", "15", "--repeats", "1",
                                      "--sink", "none,mlflow,swanlab"], 150,
          ["--ranks", "4096", "--rate", "2", "--seconds", "10", "--repeats", "1", "--sink", "none,mlflow,swanlab"],
          110),
    Piece("memory", "memory.py", ["--steps", "100000", "--tensorboard", "off"], 30),
    Piece("memory_tb", "memory.py", ["--steps", "8000", "--tensorboard", "on"], 45,
          ["--steps", "4000", "--tensorboard", "on"], 25),
    Piece("stop_latency", "stop_latency.py", ["--repeats", "2"], 70, ["--repeats", "1"], 40, max_s=110),
    Piece("startup", "startup.py", ["--repeats", "3"], 120, ["--repeats", "2"], 80, max_s=170),
    # real launches one after another (about 60): planned from a quiet 2-core machine; its own
    # repeats are the campaign's, so it is never run again whole (max_s: no rerun)
    Piece("rules", "rules.py", [], RULES_PLANNED_S, ["--quick"], 420, max_s=RULES_PLANNED_S),
]
PERF_NAMES = {p.name for p in PIECES if p.name != "rules"}
"""`make bench`'s pieces; the rules campaign is `make bench-rules`."""


REFERENCE_CARDS_PER_S = 26607.0
"""`npu_smi_parse.py`'s median rate (all fixtures in turn, pure Python) on the reference
machine the planned times are for (Intel Xeon, 2 cores, 2026-12-04 08:00). The first piece
measures it here: a machine whose Python runs more than `SLOW_FACTOR` times slower takes
every piece's reduced arguments, reserves more time for the pieces to come, and gives each
piece a timeout scaled to its speed (measured on an AMD EPYC VM on 2026-12-04: 4.0x slower,
and two pieces were killed at the reference machine's timeouts)."""
SLOW_FACTOR = 1.5


@dataclass
class Attempt:
    args: list[str]
    rc: int
    wall_s: float
    foreign: dict
    log: str
    ok: bool
    kept: bool = False
