"""MindSpore's dynamic-cluster scheduler (MS_ROLE=MS_SCHED), run as a driver subprocess.

`init()` in the scheduler role never returns while the cluster lives; the process exits
once every worker has unregistered. Run: `python -m mindpulse.workers.scheduler`, with the
run's settings named in the environment (their `device_target`; CPU without them).
"""

from __future__ import annotations

import os
import sys

from mindpulse.frameworks.framework_support import Framework, FrameworkVersionError
from mindpulse.workers import framework_check
from mindpulse.workers.settings import load_settings


def main() -> int:
    if os.environ.get("MS_ROLE") != "MS_SCHED":
        print("mindpulse scheduler: MS_ROLE must be MS_SCHED", file=sys.stderr)
        return 2
    settings = load_settings()
    try:  # a missing or unsupported MindSpore is named in one line, not a traceback from its import
        framework_check.check((Framework.MINDSPORE,))
    except FrameworkVersionError as exc:
        print(f"mindpulse scheduler: {exc}", file=sys.stderr, flush=True)
        return framework_check.REFUSED_EXIT
    import mindspore as ms
    from mindspore.communication import init

    ms.set_context(device_target=settings.device_target if settings is not None else "CPU")
    init()
    return 0


if __name__ == "__main__":
    sys.exit(main())
