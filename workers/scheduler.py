"""MindSpore's dynamic-cluster scheduler (MS_ROLE=MS_SCHED), run as a driver subprocess.

`init()` in the scheduler role never returns while the cluster lives; the process exits
once every worker has unregistered. Run: `python -m mindpulse.workers.scheduler`.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    if os.environ.get("MS_ROLE") != "MS_SCHED":
        print("mindpulse scheduler: MS_ROLE must be MS_SCHED", file=sys.stderr)
        return 2
    import mindspore as ms
    from mindspore.communication import init

    ms.set_context(device_target=os.environ.get("MINDPULSE_DEVICE_TARGET", "CPU"))
    init()
    return 0


if __name__ == "__main__":
    sys.exit(main())
