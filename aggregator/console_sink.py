"""The console: the lines the driver prints (`launcher/progress.py` takes them from the actor's
`poll`), kept here until it does. A reduced step's cluster table (and the card table under it)
every `monitor.per_print_step` steps, at the last step, at an evaluation and at a stop; each
anomaly, note and checkpoint as a line.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

from mindpulse.reduction.reducer import ReducedStep
from mindpulse.reporting import tables
from mindpulse.wire.directives import Directive

from .sink import Sink

CONSOLE_LINES = 1000
"""Console lines kept until the driver polls them."""


class ConsoleSink(Sink):
    def __init__(self, *, per_print_step: int, total_steps: int | None, straggler_threshold: float,
                 card_tflops: Callable[[dict[str, Any]], float | None] | None = None,
                 errors: Counter[str] | None = None):
        """`card_tflops`: a card's achieved TFLOPS (the card table's column, `ComputeWatch.card_tflops`);
        `errors`: where a table that could not be drawn is counted (`table_error`)."""
        self.lines: deque[str] = deque(maxlen=CONSOLE_LINES)
        self.per_print_step = max(1, per_print_step)
        self.total_steps = total_steps
        self.straggler_threshold = straggler_threshold
        self.card_tflops = card_tflops
        self.errors: Counter[str] = errors if errors is not None else Counter()
        self.cards: dict[tuple[str, Any], dict[str, Any]] = {}
        """Each card's newest record, by (node, card): the card table under the cluster table."""

    def say(self, text: str) -> None:
        self.lines.append(text)

    def drain(self) -> list[str]:
        out = list(self.lines)
        self.lines.clear()
        return out

    def due(self, red: ReducedStep, directive: Directive | None) -> bool:
        """Whether the step's table is printed: every per_print_step steps, the last step, an
        evaluation, a stop."""
        return (red.step % self.per_print_step == 0 or bool(self.total_steps and red.step == self.total_steps)
                or any(k.startswith("eval_") for k in red.extra)
                or (directive is not None and directive.action.stops))

    # ---- the hooks ------------------------------------------------------------------------
    def on_reduced(self, red: ReducedStep, also: Sequence[tuple[str, Any]] = (),
                   directive: Directive | None = None) -> None:
        if not self.due(red, directive):
            return
        try:  # a table is a view: it must never cost a stop or a save decided at the step
            text = tables.cluster_table(red, self.total_steps, self.straggler_threshold)
            if self.cards:
                text += "\n" + tables.card_table(self.cards.values(), self.card_tflops)
        except Exception as exc:  # a sink's failure must not stop the aggregator: counted, said in its place
            self.errors["table_error"] += 1
            text = f"step {red.step}: the cluster table could not be drawn ({type(exc).__name__}: {exc})"
        self.say(text)

    def on_anomaly(self, record: dict[str, Any]) -> None:
        rank = record.get("rank")
        where = f" (rank {rank})" if rank is not None else ""
        self.say(f"ANOMALY {record.get('rule')}{where} -> {record.get('action')}: {record.get('message')}")

    def on_note(self, text: str) -> None:
        self.say(text)

    def on_telemetry(self, node: str, cards: list[dict[str, Any]], ts: float, step: int) -> None:
        for card in cards:
            self.cards[(node, card.get("card"))] = card

    def on_checkpoint(self, step: int, entries: Sequence[dict[str, Any]] = ()) -> None:
        for e in entries:
            self.say(f"checkpoint ({e.get('kind')}) step {e.get('step')}: {e.get('path')}")

    def on_rank_error(self, rank: int, step: int = 0, message: str = "") -> None:
        self.say(f"rank {rank}: {message}")


__all__ = ["CONSOLE_LINES", "ConsoleSink"]
