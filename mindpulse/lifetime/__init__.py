"""Processes' lifetimes: telling a process from a later one with the same pid
(`process_identity.py`), ending a run's processes (`processes.py`: SIGTERM, grace, SIGKILL, the
parent-death signal), and what every rank process is started with (`rank_processes.py`)."""
