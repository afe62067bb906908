"""Anomaly rules as configs: a change to the rules of a running job, checked as the config's own
entries are, and the run directory's files that carry it (`changes.py`); the aggregator
applies it (`aggregator/live_rules.py`)."""
