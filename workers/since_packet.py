"""The seconds a rank spent outside its steps between two step packets, by cause."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SincePacket:
    """Seconds a rank spent outside its steps since its last step packet, by cause; the next
    packet carries them (goodput badput) and they start again from zero."""

    monitor_wait_s: float = 0.0
    """Blocked on the aggregator (a verdict, a lease)."""
    checkpoint_s: float = 0.0
    """Writing checkpoints."""
    profile_s: float = 0.0
    """Starting and stopping the profiler."""
    monitor_self_s: float = 0.0
    """In mindpulse's own code (the callback, the step's packet, the channel), the above and
    evaluation left out: what watching costs the rank (`RankSession.record`)."""

    def outside(self) -> float:
        """The seconds so far that are not mindpulse's own work (waits, checkpoints, profiler)."""
        return self.monitor_wait_s + self.checkpoint_s + self.profile_s

    def take(self) -> dict[str, float]:
        """The seconds by `StepPacket` field, reset to zero."""
        out = dict(vars(self))
        for name in out:
            setattr(self, name, 0.0)
        return out
