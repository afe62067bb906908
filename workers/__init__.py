"""What runs inside a rank: the train-step cell with grad statistics and the Monitor.

`from mindpulse.workers import Monitor` is the one line a user script needs.
"""

from typing import Any

__all__ = ["Monitor", "MonitoredTrainOneStepCell"]


def __getattr__(name: str) -> Any:
    # lazy: importing the package must not import MindSpore (the driver stays light)
    if name == "Monitor":
        from .monitor import Monitor

        return Monitor
    if name == "MonitoredTrainOneStepCell":
        from .train_cell import MonitoredTrainOneStepCell

        return MonitoredTrainOneStepCell
    raise AttributeError(name)
