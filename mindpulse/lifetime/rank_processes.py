"""What every rank process is started with and how long it may take to end: the one
definition the launcher (which starts rank actors and node agents) and the node agent (which
spawns ranks, msrun and the scheduler) share.
"""

from __future__ import annotations

# Every Ray worker (and subprocess) that imports mindspore needs the pure-Python protobuf from
# the start (Ray imports protobuf first; mindspore's generated code then fails to load). The one
# definition: the launcher gives it to every actor it starts, the node agent to what it spawns.
WORKER_ENV = {"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}

RANK_EXIT_GRACE_S = 5.0
"""How long a rank process may take to exit once its run ended, before it is killed."""
