"""Exceptions shared by the rank-side code (no MindSpore import: the rank actor uses it)."""

from mindpulse.common.errors import MindpulseError


class StopTraining(MindpulseError):
    """Every rank must stop before running another step (e.g. a `desync` stop at step 0,
    before the first update). The rank ends cleanly: exit code 0, the run's status comes
    from the aggregator's stop."""
