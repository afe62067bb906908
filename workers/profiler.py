"""MindSpore's Profiler over the configured window of steps (`profile.steps`), in the
configured ranks only, into `RUN_DIR/profile/rank_<r>/` (the report links it).

A profiler that fails to start or finish is logged and given up: profiling never stops
training.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from mindpulse.config.rank_settings import RankSettings

log = logging.getLogger(__name__)


class ProfileWindow:
    def __init__(self, rank: int, first: int, last: int, out_dir: str):
        self.rank = rank
        self.window: tuple[int, int] | None = (first, last)
        self.out_dir = out_dir
        self._profiler: Any = None

    @staticmethod
    def for_rank(settings: RankSettings | None, rank: int) -> ProfileWindow | None:
        """The rank's window, or None when this rank does not profile."""
        if settings is None:
            return None
        steps = settings.profile.steps
        if len(steps) != 2 or rank not in settings.profile.ranks:
            return None
        return ProfileWindow(rank, steps[0], steps[1], os.path.join(settings.run_dir, "profile", f"rank_{rank}"))

    def begin(self, step: int) -> None:
        """Call before `step` runs: starts the profiler at the window's first step."""
        if self.window is None or step != self.window[0] or self._profiler is not None:
            return
        try:
            from mindspore import Profiler

            os.makedirs(self.out_dir, exist_ok=True)
            self._profiler = Profiler(output_path=self.out_dir, start_profile=False)
            self._profiler.start()
            log.info("[rank %d] profiling steps %d..%d into %s", self.rank, *self.window, self.out_dir)
        except Exception as exc:  # profiling is optional: training goes on without it, logged
            log.error("[rank %d] the profiler did not start: %s", self.rank, exc)
            self.window = None

    def end(self, step: int, force: bool = False) -> None:
        """Call after `step` ran: stops and analyses at the window's last step (or now, with `force`)."""
        if self._profiler is None or self.window is None or not (force or step >= self.window[1]):
            return
        prof, self._profiler, self.window = self._profiler, None, None
        try:
            prof.stop()
            prof.analyse()
        except Exception as exc:  # profiling is optional: training goes on without its report, logged
            log.error("[rank %d] the profiler did not finish: %s", self.rank, exc)
