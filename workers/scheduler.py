"""MindSpore's dynamic-cluster scheduler (MS_ROLE=MS_SCHED), run as a driver subprocess.

`init()` in the scheduler role never returns while the cluster lives; the process exits
once every worker has unregistered. Run: `python -m mindpulse.workers.scheduler`, with the
run's settings named in the environment (their `device_target`; CPU without them).
"""

from __future__ import annotations

import os
import sys

from mindpulse.workers.settings import load_settings


def main() -> int:
    if os.environ.get("MS_ROLE") != "MS_SCHED":
        print("mindpulse scheduler: MS_ROLE must be MS_SCHED", file=sys.stderr)
        return 2
    settings = load_settings()
    import mindspore as ms
    from mindspore.communication import init

    ms.set_context(device_target=settings.device_target if settings is not None else "CPU")
    init()
    return 0


if __name__ == "__main__":
    sys.exit(main())
