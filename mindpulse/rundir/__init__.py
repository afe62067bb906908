"""The run directory's files: file modes and atomic writes (`rundir_io.py`), `metrics.msgpack`
(`metrics_store.py`) and its one replay (`replay.py`), the checkpoint manifest
(`checkpoint_manifest.py`), and `trackers.json` (`tracker_runs.py`)."""
