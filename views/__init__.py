"""Offline views of a run directory (report, top): they read a run through one reader that
replays its packets with the aggregator's own reducer."""
