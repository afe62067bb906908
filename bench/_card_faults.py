"""A card over temperature, through the telemetry samplers' recorded inputs (bench/rules.py).

No Ascend card here: the node's sampler is the real `NpuSmiSampler` inside the real
`NodeSampler` (the node agent's telemetry thread, at `monitor.telemetry_interval_s`), running a
script that prints recorded `npu-smi` output (the Atlas 800T A2 capture of tests/fixtures/npu-smi,
8 cards: `_agent_node.fake_npu_smi`). Its samples go, as the agent ships them, as
`TelemetryPacket`s into a real `AggregatorCore` (the aggregator's code, in this process) with
the default rules. At a random moment one card's recorded temperature (its `npu-smi info` row
and its `-t temp` listing) is raised above the `card_overload` limit; the firing is timed from
that switch.
"""

from __future__ import annotations

import random
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _agent_node import fake_npu_smi, use_cards
from _rules_records import Injection, detect

HOT_C = 99
"""The injected temperature: above the default limit (`CARD_LIMITS["temp_c"]`, 95 C)."""


def hot_copy(folder: Path, npu: int, temp_c: int = HOT_C) -> Path:
    """`folder/hot{npu}`: the 8-card recording with NPU `npu` at `temp_c` degrees (its `info`
    row and its `-t temp` listing); everything else as recorded."""
    src, dst = folder / "cards8", folder / f"hot{npu}"
    shutil.copytree(src, dst, dirs_exist_ok=True)
    info = (dst / "info.txt").read_text().splitlines(keepends=True)
    row = re.compile(rf"^\| {npu}\s+\S+\s+\| \S+\s+\| \S+\s+(\d+)")
    for i, line in enumerate(info):
        m = row.match(line)
        if m:
            a, b = m.span(1)
            info[i] = line[:a] + f"{temp_c:<{b - a}d}"[: max(b - a, len(str(temp_c)))] + line[b:]
            break
    else:
        raise ValueError(f"NPU {npu} has no row in the recorded npu-smi info")
    (dst / "info.txt").write_text("".join(info))
    t = dst / f"temp_{npu}.txt"
    t.write_text(re.sub(r"(NPU Temperature \(C\)\s+:\s+)\d+", rf"\g<1>{temp_c}", t.read_text()))
    return dst


def switch(folder: Path, target: Path) -> None:
    link, tmp = folder / "current", folder / "current.new"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    tmp.replace(link)


def one_card_run(seed: int, settings: Any, before_s: tuple[float, float], timeout_s: float) -> dict[str, Any]:
    """One run: the sampler ships recorded samples for a random time in `before_s`, then a
    random card turns hot; until the rule fires or `timeout_s` after the switch."""
    from mindpulse.aggregator.anomaly_log import read_records
    from mindpulse.aggregator.core import AggregatorCore
    from mindpulse.node.telemetry import NodeSampler, NpuSmiSampler, telemetry_packet

    rng = random.Random(seed)
    npu = rng.randrange(8)
    wait_s = rng.uniform(*before_s)
    tmp = Path(tempfile.mkdtemp(prefix="mindpulse-bench-card-"))
    lock = threading.Lock()
    try:
        exe = fake_npu_smi(tmp)
        use_cards(tmp, 8)
        hot = hot_copy(tmp, npu)
        core = AggregatorCore(tmp / "run", 8, 1000, None, settings)
        interval = float(settings.config.monitor.telemetry_interval_s)

        def ship(sample: dict[str, Any]) -> None:
            with lock:  # the actor's loop takes one batch at a time
                core.ingest([telemetry_packet(sample).encode()])

        sampler = NodeSampler("node0", NpuSmiSampler(str(exe), lock_path=None), {r: r for r in range(8)},
                              interval_s=interval)
        sampler.start(ship)
        try:
            time.sleep(wait_s)
            switch(tmp, hot)
            at = time.time()
            seen: dict[int, float] = {}
            firings: list[dict[str, Any]] = []
            deadline = at + timeout_s
            while time.time() < deadline:
                recs = list(read_records(tmp / "run"))
                for i, r in enumerate(recs):
                    if i not in seen:
                        seen[i] = time.time()
                        firings.append(dict(r, seen_at=seen[i]))
                if any(f.get("rule") == "card_overload" for f in firings):
                    break
                time.sleep(0.1)
        finally:
            sampler.stop()
            with lock:
                core.close()
        inj = Injection(f"card {npu} at {HOT_C} C (rank {npu})", npu, 0, at)
        det = detect(firings, inj, ("card_overload",))
        det.step = det.steps = None  # telemetry has no steps here (no rank trains): seconds only
        from mindpulse.aggregator.policies import build_rules

        cfg = settings.config
        for_s = next((r.config.for_s for r in build_rules(list(cfg.anomalies)) if r.kind == "card_overload"), None)
        return {"spec": inj.spec, "rank": npu, "seed": seed, "before_s": wait_s, "interval_s": interval, "for_s": for_s,
                "firings": firings, "detection": det.to_record(), "samples": sampler.samples_taken}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def card_runs(n: int, seed: int, settings: Any, before_s: tuple[float, float] = (6.0, 16.0),
              timeout_s: float = 90.0) -> list[dict[str, Any]]:
    """`n` runs side by side (threads: each mostly waits for its sampler), seeds `seed + i`."""
    out: list[dict[str, Any] | None] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = one_card_run(seed + i, settings, before_s, timeout_s)
        except BaseException as exc:  # reported by the caller with the run's number
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + before_s[1] + 60)
    if errors:
        raise RuntimeError(f"a card run failed: {errors[0]!r}") from errors[0]
    return [r for r in out if r is not None]
