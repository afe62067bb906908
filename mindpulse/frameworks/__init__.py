"""The frameworks mindpulse runs on, judged without importing them (the head runs without
MindSpore): the supported MindSpore and MindFormers ranges (`framework_support.py`), the
probe of a node that `doctor` and `launch` run on every host (`framework_probe.py`, which
reads the CANN, driver and firmware files with `ascend_versions.py`), and the lines msrun
writes that mindpulse acts on (`msrun_text.py`)."""
