"""A fake ``npu-smi`` for the telemetry tests: a shell script written into a test's tmp_path
that prints the real captures of ``tests/fixtures/npu-smi`` for the arguments it gets
(``npu-smi info``, ``npu-smi info -t usages|power|temp|memory -i N``, the ``NPU ID`` line set
to N), fails, or hangs as a test asks, and logs when each run started and ended; with the
readers of that log."""

from __future__ import annotations

import shlex
from pathlib import Path

import psutil

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "npu-smi"

# Synthesised (no capture in the fixtures): a 910B `-t memory` listing consistent with
# t_usages_910b.txt (DDR 0 MB, HBM 65536 MB).
MEMORY_910B_SYNTH = """\
        NPU ID                         : 0
        Chip Count                     : 1

        DDR Capacity(MB)               : 0
        HBM Capacity(MB)               : 65536
        Chip ID                        : 0
"""

SET_910B = {
    "info": "info_910b3_a2_8cards_busy.txt",
    "usages": "t_usages_910b.txt",
    "power": "t_power_910b.txt",
    "temp": "t_temp_910b.txt",
    "memory": ("text", MEMORY_910B_SYNTH),
}
SET_310B = {
    "info": ("fail", 1, "Usage: npu-smi info <watch|proc-mem|-h|-m|-l|-t type -i id -c chip_id>"),
    "usages": "t_usages_310b_200i_a2.txt",
    "power": "t_power_310b_200i_a2.txt",
    "temp": "t_temp_310b_200i_a2.txt",
    "memory": "t_memory_310b_200i_a2.txt",
}

_SET_NPU_ID = r's/^\([[:space:]]*NPU ID[[:space:]]*:[[:space:]]*\)0[[:space:]]*$/\1'


def make_fake_npu_smi(tmp_path: Path, spec: dict, *, log: Path | None = None,
                      delay_s: float = 0.0, name: str = "npu-smi") -> Path:
    """Write an executable fake ``npu-smi``.

    ``spec`` maps ``info``, ``m`` (``info -m``) and the ``-t`` kinds to what the script
    does: a fixture file name, ``("text", str)``, ``("fail", rc, stderr)`` or
    ``("sleep", seconds)`` (writes its pid to ``<name>.pid`` and the pid of its ``sleep``
    child to ``<name>.child``). With ``log``, each run appends ``start PID TS ARGS`` and
    ``end PID TS`` lines (``delay_s`` between them).
    """
    d = tmp_path / (name + ".d")
    d.mkdir(exist_ok=True)
    cases = []
    for kind, action in spec.items():
        if isinstance(action, str):
            action = ("file", str(FIXTURES / action))
        if action[0] == "text":
            f = d / f"{kind}.txt"
            f.write_text(action[1])
            action = ("file", str(f))
        if action[0] == "file":
            body = f'sed "{_SET_NPU_ID}$npu/" {shlex.quote(action[1])}'
        elif action[0] == "fail":
            body = f"echo {shlex.quote(action[2])} >&2; finish; exit {int(action[1])}"
        elif action[0] == "sleep":
            pid = shlex.quote(str(tmp_path / f"{name}.pid"))
            child = shlex.quote(str(tmp_path / f"{name}.child"))
            body = f"echo $$ > {pid}; sleep {action[1]} & echo $! > {child}; wait"
        else:
            raise ValueError(action)
        cases.append(f"  {kind}) {body} ;;")
    logq = shlex.quote(str(log)) if log else "''"
    script = f"""#!/bin/sh
LOG={logq}
finish() {{ if [ -n "$LOG" ]; then echo "end $$ $(date +%s.%N)" >> "$LOG"; fi; }}
if [ -n "$LOG" ]; then echo "start $$ $(date +%s.%N) $*" >> "$LOG"; fi
npu=0
kind=unknown
if [ "$1" = info ] && [ $# -eq 1 ]; then kind=info
elif [ "$1" = info ] && [ "$2" = -m ]; then kind=m
elif [ "$1" = info ] && [ "$2" = -t ] && [ "$4" = -i ]; then kind="$3"; npu="$5"
fi
sleep {delay_s}
case "$kind" in
{chr(10).join(cases)}
  *) echo "Error: unsupported arguments $*" >&2; finish; exit 255 ;;
esac
finish
"""
    path = tmp_path / name
    path.write_text(script)
    path.chmod(0o755)
    return path


def read_log(log: Path) -> list[tuple[float, float, str]]:
    """(start, end, args) of every run in a fake's log."""
    open_runs: dict[str, tuple[float, str]] = {}
    runs = []
    for line in log.read_text().splitlines():
        parts = line.split(" ", 3)
        if parts[0] == "start":
            open_runs[parts[1]] = (float(parts[2]), parts[3] if len(parts) > 3 else "")
        elif parts[0] == "end":
            start, args = open_runs.pop(parts[1])
            runs.append((start, float(parts[2]), args))
    assert not open_runs, f"runs without an end: {open_runs}"
    return runs


def assert_no_overlap(runs: list[tuple[float, float, str]]) -> None:
    runs = sorted(runs)
    for a, b in zip(runs, runs[1:]):
        assert b[0] >= a[1], f"npu-smi runs overlap: {a} and {b}"


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
