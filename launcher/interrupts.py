"""The user's interrupts (Ctrl-C, SIGTERM, SIGHUP) and the launcher's waits on Ray that
must hear them.

While a run trains, the first interrupt stops every rank after the same step and the second
kills (`supervision.AttemptWatch`). Before any step has run there is nothing to finish:
an interrupt while the launcher starts an attempt (placing the nodes, starting the agents,
the scheduler and the ranks) ends the launch at once. Ray runs Python's signal handlers
while `ray.get` waits but keeps waiting (measured: a Ctrl-C during the placement group's
wait took effect only after its 120 s timeout), so the start's waits go through `get`, which
looks at the interrupts between short slices.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

SLICE_S = 0.25
"""How often a wait looks at the interrupts."""


class Interrupts:
    """Ctrl-C, SIGTERM and SIGHUP, counted: the first stops every rank after the same step
    (at once before any step ran), the second kills."""

    def __init__(self) -> None:
        self.count = 0

    def on_signal(self, signum: int, frame: Any) -> None:
        self.count += 1

    def pending(self) -> bool:
        return self.count > 0


def start_up_interrupted(attempt: int) -> str:
    """The run's message when the user interrupted attempt `attempt` before its first step."""
    if attempt == 0:
        return "interrupted by the user during start-up, before any step"
    return f"interrupted by the user during the start-up of attempt {attempt}, before any of its steps"


class StartInterrupted(BaseException):
    """The user interrupted while the launcher was starting an attempt. A BaseException,
    like KeyboardInterrupt: the start's own `except Exception` handlers (which turn errors
    into refusals or failed attempts) must let it through to the controller."""


def get(refs: Any, timeout: float, interrupted: Callable[[], bool] | None, what: str = "") -> Any:
    """`ray.get(refs, timeout=timeout)` that raises StartInterrupted as soon as
    `interrupted()` is true (checked before waiting and every SLICE_S); a plain `ray.get`
    when `interrupted` is None. Results and errors are `ray.get`'s own."""
    import ray

    pending = list(refs) if isinstance(refs, list) else [refs]
    if interrupted is None or not pending:
        return ray.get(refs, timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        if interrupted():
            raise StartInterrupted(f"interrupted while waiting for {what or 'the cluster'}")
        left = deadline - time.monotonic()
        if left <= 0:
            raise ray.exceptions.GetTimeoutError(f"{what or 'a Ray call'} did not finish within {timeout:g} s")
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=min(SLICE_S, left))
        if not pending:
            return ray.get(refs)  # every one is ready: returns at once
        if ready:
            ray.get(ready)  # one that failed raises now, as ray.get of them all would, not at the timeout
