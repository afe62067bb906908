"""The node agent's whole process, as a launch runs it, for bench/fanin.py.

`agent_process_cost` starts a real aggregator and the launcher's `NodeAgents` for one node
(the real `NodeAgent` actor: relay with node pre-reduction, uplink, card telemetry,
watchdog), then plays that node's ranks from this process: each rank's own `RelayChannel`
(with the attempt's relay token) sends its real `StepPacket` of every step (the packets
bench/_node_sim.py builds: values by rank and step, fingerprints every collect step, rank
0's weight statistics, rank 0's decide at checkpoint candidates, when it waits for the
directive) and takes its lease from the node's lease board before the next step, and each
rank's `Heartbeat` (workers/heartbeat.py) beats over a channel of its own every
`monitor.heartbeat_s`. Within a step the ranks' frames are spread over `spread_ms` (the
ranks leave the step's all-reduce at about the same time, then each does its own
monitoring work), rank 0 last at a candidate.

Card telemetry is on at the default `monitor.telemetry_interval_s` with `world.device:
ascend`. There is no Ascend driver here: DCMI does not load, so the agent's sampler is the
`npu-smi` one, and the `npu-smi` it runs is a script (`fake_npu_smi`) that prints recorded
output, as tests/unit/fake_npu_smi.py feeds the sampler: for 8 cards the real capture of
an Atlas 800T A2 (tests/fixtures/npu-smi/info_910b3_a2_8cards_busy.txt and the 910B `-t`
listings); for 16 cards an Atlas A3 table (8 NPUs, two chips each, physical ids: the
layout tests/unit/test_npu_smi_layouts.py parses; no A3 capture exists) with the same listings
once per chip. The agent's side of every sample is real (32 `npu-smi` runs of an A3
sample: fork and exec, the locks, parsing, merging, the host's and the 16 rank processes'
statistics through psutil); the script's own CPU is not the tool's and is reported apart.
The rank processes the telemetry reads are stand-ins (`sleep`).
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import shlex
import shutil
import subprocess
import tempfile
import time
import types
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "npu-smi"
QUERIES = ("usages", "power", "temp", "memory")
MEMORY_910B = """\
        NPU ID                         : {npu}
        Chip Count                     : 1

        DDR Capacity(MB)               : 0
        HBM Capacity(MB)               : 65536
        Chip ID                        : {chip}
"""
"""No `-t memory` capture of a 910B board exists in the fixtures: this listing is made of the
keys the parser knows (as tests/unit/fake_npu_smi.py does)."""


def a3_table(npus: int = 8) -> str:
    """`npu-smi info` of an Atlas A3 node: two chips an NPU, physical ids, `-` for the second
    chip's power (the layout of A3_TABLE in tests/unit/npu_smi_cases.py, every NPU busy)."""
    sep = "+---------------------------+---------------+----------------------------------------------------+"
    big = "+===========================+===============+====================================================+"
    lines = [
        "+------------------------------------------------------------------------------------------------+",
        "| npu-smi 25.0.rc1.1               Version: 25.0.rc1.1                                           |",
        sep,
        "| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|",
        "| Chip  Phy-ID              | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |",
        big,
    ]
    for npu in range(npus):
        for chip in range(2):
            phy = 2 * npu + chip
            power = f"{171.5 - npu:<11.1f}" if chip == 0 else "-          "
            lines.append(f"| {npu:<5} {'Ascend910':<19} | {'OK':<13} | {power} {38 + chip:<17} 0    / 0             |")
            lines.append(f"| {chip:<5} {phy:<19} | 0000:{0x9D + phy:02X}:00.0  | {52 - chip:<11} 0    / 0          "
                         f"58012/ 65536         |")
            lines.append(sep if chip == 0 else big)
    lines += [sep, "| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |",
              big]
    for npu in range(npus):
        for chip in range(2):
            lines.append(f"| {npu:<7} {chip:<17} | {120341 + 2 * npu + chip:<13} | {'python3.9':<24} | "
                         f"{54321:<23} |")
    lines.append(big)
    return "\n".join(lines) + "\n"


def fake_npu_smi(folder: Path) -> Path:
    """An executable `folder/bin/npu-smi` that prints recorded output for the sampler's
    commands (`info`, `info -t Q -i N`) from `folder/current` (`use_cards`): 8 cards, the
    Atlas 800T A2 capture; 16, an A3 node. Every answer is a file made here; the script only
    `cat`s it."""
    for cards in (8, 16):
        d = folder / f"cards{cards}"
        d.mkdir(parents=True, exist_ok=True)
        chips = 2 if cards == 16 else 1
        npus = cards // chips
        if chips == 2:
            (d / "info.txt").write_text(a3_table(npus))
        else:
            shutil.copy(FIXTURES / "info_910b3_a2_8cards_busy.txt", d / "info.txt")
        for q in QUERIES:
            for npu in range(npus):
                parts = []
                for chip in range(chips):
                    text = (MEMORY_910B if q == "memory" else (FIXTURES / f"t_{q}_910b.txt").read_text()
                            .replace("NPU ID                         : 0", "NPU ID                         : {npu}")
                            .replace("Chip ID                        : 0", "Chip ID                        : {chip}"))
                    parts.append(text.format(npu=npu, chip=chip))
                (d / f"{q}_{npu}.txt").write_text("\n".join(parts))
    use_cards(folder, 16)
    cur = shlex.quote(str(folder / "current"))
    script = f"""#!/bin/sh
if [ "$1" = info ] && [ $# -eq 1 ]; then exec cat {cur}/info.txt; fi
if [ "$1" = info ] && [ "$2" = -t ] && [ "$4" = -i ] && [ -f {cur}/"$3_$5.txt" ]; then exec cat {cur}/"$3_$5.txt"; fi
echo "Error: unsupported arguments $*" >&2
exit 255
"""
    (folder / "bin").mkdir(exist_ok=True)
    path = folder / "bin" / "npu-smi"
    path.write_text(script)
    path.chmod(0o755)
    return path


def use_cards(folder: Path, cards: int) -> None:
    """Which recorded node the fake `npu-smi` in `folder` answers for (8 or 16 cards)."""
    if cards not in (8, 16):
        raise ValueError(f"recorded npu-smi output exists for 8 and 16 cards, not {cards}")
    link = folder / "current"
    tmp = folder / "current.new"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(folder / f"cards{cards}")
    tmp.replace(link)


def _cpu(proc: Any) -> tuple[float, float]:
    """(the process's own CPU seconds, its reaped children's: the npu-smi runs)."""
    t = proc.cpu_times()
    return t.user + t.system, t.children_user + t.children_system


def agent_process_cost(rpn: int, rate: float, seconds: float, npu_smi_dir: Path, idle_s: float = 5.0,
                       spread_ms: float = 1.0) -> dict[str, Any]:
    """The whole node-agent process's CPU with `rpn` ranks (and cards) at `rate` steps/s. Ray
    is initialised by the caller with "NPU" resources, `fake_npu_smi(npu_smi_dir)`'s bin
    folder first on PATH. Measured: `idle_s` with telemetry on and no rank sending, then
    `seconds` of steps."""
    import _common as C
    import psutil
    import ray
    from _node_sim import step_packet

    from mindpulse.aggregator.core import start_aggregator
    from mindpulse.config import load_config
    from mindpulse.config.derived import monitor_settings_of, schedule_of
    from mindpulse.launcher.node_agents import NodeAgents
    from mindpulse.workers.channel import RelayChannel
    from mindpulse.workers.heartbeat import Heartbeat

    tmp = Path(tempfile.mkdtemp(prefix="mp-agent-"))
    overrides = ["world.nodes=1", f"world.ranks_per_node={rpn}", "world.device=ascend", f"output.root={tmp}",
                 "train.steps=1000000"]
    cfg, _ = load_config(None, overrides)
    sched = schedule_of(cfg)
    lag = cfg.monitor.max_lag_steps
    hb_s = monitor_settings_of(cfg).heartbeat_s
    use_cards(npu_smi_dir, rpn)
    stand_ins = [subprocess.Popen(["sleep", str(int(idle_s + seconds + 120))]) for _ in range(rpn)]
    nodes = agg = None
    try:
        settings = C.aggregator_settings(*overrides)
        agg = start_aggregator(f"agent-{os.getpid()}-{rpn}", "mindpulse-bench", tmp, rpn,
                               cfg.monitor.per_print_step, None, settings=settings)
        ray.get(agg.ping.remote(), timeout=120)
        token = secrets.token_hex(16)
        nodes = NodeAgents(cfg)
        nodes.place(agg, token)
        agent = nodes.agents[0]
        # what NodeAgents.start_telemetry asks each agent (called here to read the source it picked)
        tele = ray.get(agent.start_telemetry.remote({r: p.pid for r, p in enumerate(stand_ins)}), timeout=60)
        if tele.get("source") != "npu-smi":
            raise RuntimeError(f"the node agent's telemetry is {tele} (npu-smi expected: PATH starts with "
                               f"{npu_smi_dir})")
        host, _, port = nodes.relays()[0].rpartition(":")
        chans = [RelayChannel(host, int(port), cfg.monitor.decision_timeout_s, token=token) for _ in range(rpn)]
        hb_settings = types.SimpleNamespace(monitor=types.SimpleNamespace(heartbeat_s=hb_s))
        cur = {"step": 0}
        beats = [Heartbeat(hb_settings, r, lambda: cur["step"], lambda: cur["step"] + 1,  # type: ignore[arg-type]
                           connect=lambda: RelayChannel(host, int(port), 60.0, token=token)) for r in range(rpn)]
        proc = psutil.Process(nodes.pids()[0])
        rngs = [random.Random(r) for r in range(rpn)]
        order = random.Random(rpn)
        # the ranks start: step 0's fingerprint, the heartbeats
        for r, ch in enumerate(chans):
            ch.send_step(step_packet(r, 0, rate, sched, rngs[r]).encode(), 0)
        for hb in beats:
            hb.start()
        for ch in chans:
            ch.lease(0)
        time.sleep(1.0)
        c0, k0 = _cpu(proc)
        time.sleep(idle_s)  # ranks between steps (a long step), telemetry on
        c1, k1 = _cpu(proc)
        steps = int(rate * seconds)
        decision_waits = []
        t0 = time.time()
        for s in range(1, steps + 1):
            due = t0 + (s - 1) / rate
            if time.time() < due:
                time.sleep(due - time.time())
            cur["step"] = s - 1
            pkts = {r: step_packet(r, s, rate, sched, rngs[r]).encode() for r in range(rpn)}
            offs = sorted(order.random() * spread_ms / 1000 for _ in range(rpn))
            ranks = list(range(rpn))
            order.shuffle(ranks)
            if sched.is_candidate(s):  # rank 0 decides, last: it waits for the directive
                ranks.remove(0)
                ranks.append(0)
            start = time.time()
            for r, off in zip(ranks, offs):
                if time.time() < start + off:
                    time.sleep(max(0.0, start + off - time.time()))
                if r == 0 and sched.is_candidate(s):
                    w0 = time.time()
                    chans[0].decide(pkts[0], s, expect=1)
                    decision_waits.append(time.time() - w0)
                else:
                    chans[r].send_step(pkts[r], s)
            for ch in chans:
                ch.lease(s - lag)
        wall = time.time() - t0
        c2, k2 = _cpu(proc)
        for hb in beats:
            hb.stop()
        for ch in chans:
            ch.close()
        nodes.flush(kill=False)
        snap = ray.get(agg.close.remote(), timeout=60)
        nodes.shutdown()
        nodes.release()
        nodes = None
    finally:
        try:
            if nodes is not None:
                nodes.shutdown()
                nodes.release()
            if agg is not None:
                ray.kill(agg)
        except Exception:  # already failing, or gone: the error that got here is the one to report
            logging.getLogger(__name__).exception("node agent cleanup")
        for p in stand_ins:
            p.kill()
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    busy = c2 - c1
    return {"ranks": rpn, "cards": rpn, "rate": rate, "steps": steps, "seconds": round(wall, 2),
            "telemetry_interval_s": cfg.monitor.telemetry_interval_s, "heartbeat_s": hb_s, "spread_ms": spread_ms,
            "cpu_frac": round(busy / wall, 4), "cpu_ms_per_step": round(busy / steps * 1000, 3),
            "idle_cpu_frac": round((c1 - c0) / idle_s, 4),
            "npu_smi_children_cpu_frac": round((k2 - k1) / wall, 4),
            "decision_wait_max_ms": round(max(decision_waits) * 1000, 1) if decision_waits else None,
            "decisions": len(decision_waits),
            "reduced": snap.get("steps_completed"),
            "rejected": (snap.get("packets") or {}).get("rejected")}
