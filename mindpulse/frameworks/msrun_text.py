"""The lines MindSpore's msrun writes that mindpulse acts on: the node agent while msrun runs
(`node/msrun_output.py`), the driver when it reads a node's msrun log after the attempt
(`launcher/msrun_logs.py`).

msrun (MindSpore 2.9, `parallel/cluster/process_entity/_api.py`) polls its workers once a
second; when one has exited with an error it writes `KILLED_OTHERS` and SIGKILLs the rest.
"""

from __future__ import annotations

KILLED_OTHERS = "There's worker exits with exception, kill all other workers."
