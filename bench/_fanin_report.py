"""The fan-in benchmark's text (bench/fanin.py): what a run simulated and left out, in words,
and its section of docs/benchmarks.md (`render`, bench/run_all.py), with each tracker sink's
runs (`render_sinks`)."""

from __future__ import annotations

import _common as C
from _fanin_driver import HANG_CHECK_S, POLL_S
from _fanin_targets import P99_MIN_STEPS, p99_label


def simulated(r: dict) -> str:
    """What a run's nodes sent, and what of a real job it leaves out, in words (the target
    rows of docs/benchmarks.md)."""
    sent = (f"every rank's step packets (values by rank and step) through the real node pre-reducer, a heartbeat "
            f"from every rank every {r['heartbeat_s']:g} s, {r['cards_per_node']} cards' telemetry from every node "
            f"every {r['telemetry_interval_s']:g} s, rank 0's decide at checkpoint candidates; the console table every "
            f"{r['per_print_step']} steps, drained by a driver poll every {POLL_S:g} s beside the hang check every "
            f"{HANG_CHECK_S:g} s")
    out = ["the nodes' relays (each node's batches are made before the run)", "checkpoint writes", "evaluation"]
    tracker = TRACKER_SAID.get(r.get("sink") or "none")
    if tracker:
        sent += f"; {tracker[0]}"
        out.append(tracker[1])
    if r.get("senders") == "replay":
        from _replay import CYCLE

        sent += (f"; the senders replay pre-encoded frames (bench/_replay.py: each group leader's frame of a step "
                 f"built before the run by the real node pre-reducer and `GroupLeader`, {CYCLE} steps' worth "
                 "replayed in a cycle with the step written in, over one real uplink per leader; each node's "
                 "heartbeats as one record, each node's telemetry sample encoded once), so that the harness takes "
                 "little of the aggregator's core")
        out.insert(0, "the member-to-leader streams and the leaders' merging at run time (their frames are built "
                      "before the run)")
    elif r["group_size"] > 1 and r.get("hop_groups", 0) < r["groups"]:
        rest = r["groups"] - r.get("hop_groups", 0)
        members = r["nodes"] - r["groups"] - r.get("hop_members", 0)
        out.insert(0, f"the member-to-leader stream in {rest} of {r['groups']} groups (their {members:,} members hand "
                      "their batches to the leader in-process: no member stream, acknowledgement or lease push for "
                      "them; the other " + (f"{r['hop_groups']} groups' members stream as node agents do"
                                            if r.get("hop_groups") else "groups have none") + ")")
    return f"simulated: {sent}; left out: " + ", ".join(out)


TRACKER_SAID = {
    "mlflow": ("MLflow on (`sinks.mlflow.enabled`): the scalars TensorBoard writes logged to a file store on this "
               "machine's disk from the sink's writer thread in the aggregator's process (counted in its CPU)",
               "an MLflow tracking server (no network round trip: a file store)"),
    "swanlab": ("SwanLab on (`sinks.swanlab.enabled`, offline): the same scalars written by SwanLab's own threads "
                "in the aggregator's process (counted in its CPU)",
                "SwanLab's upload (offline mode writes files only)"),
}
"""A tracker sink's run in words: (what it adds to what was simulated, what it leaves out)."""


def tracker_failures(r: dict) -> list[str]:
    """What the console said of a run's tracker failing (it did not start, or a write failed)."""
    return [x for x in r.get("tracker_lines") or [] if "failed" in x or "did not start" in x]


def render_sinks(out: dict) -> str:
    """The fan-in with each tracker sink (bench/run_all.py's exporter section)."""
    rows, said = [], []
    base = [r["aggregator_cpu_ms_per_step"] for r in out["sink_runs"].get("none", []) if "skipped" not in r]
    for sink, runs in out["sink_runs"].items():
        for i, r in enumerate(runs, 1):
            if "skipped" in r:
                rows.append([sink, i, "-", "-", "-", "-", "-", "-", r["skipped"]])
                continue
            over = (f"{r['aggregator_cpu_ms_per_step'] - base[min(i, len(base)) - 1]:+.2f}"
                    if base and sink != "none" else "")
            rows.append([sink, i, f"{r['achieved_steps_per_s']:.3f}",
                         f"{r['reduce_p99_ms']:.0f} ({p99_label(r.get('reduce_n'))})",
                         f"{r['aggregator_cpu_frac'] * 100:.0f}%", f"{r['aggregator_cpu_ms_per_step']:.2f}", over,
                         f"{r['rank_wait_p99_ms']:.1f}", "; ".join(tracker_failures(r)) or "none"])
        first = next((r for r in runs if "skipped" not in r), None)
        if first is not None:
            said.append(f"With {sink}: {simulated(first)}.")
    r0 = next((r for rs in out["sink_runs"].values() for r in rs if "skipped" not in r), None)
    head = (f"The fan-in at {r0['ranks']:,} ranks and {r0['asked_steps_per_s']:g} steps/s (TensorBoard "
            f"{'on' if r0['tensorboard'] else 'off'}, the Prometheus endpoint scraped every {r0['scrape_every_s']:g} s) "
            "with each tracker sink, the sinks in turn each round, on the same node batches:"
            if r0 else "The fan-in with each tracker sink: no run.")
    return "\n".join([head, C.table(["sink on", "round", "achieved steps/s", "reduce p99 ms",
                                     "aggregator CPU (of a core)", "aggregator CPU ms per reduced step", "over none",
                                     "rank wait p99 ms", "tracker failures"], rows), "", *said])


def render(out: dict) -> str:
    """The Markdown section of docs/benchmarks.md (bench/run_all.py)."""
    if "sink_runs" in out:
        return render_sinks(out)
    rows = []
    for j in out["targets"]:
        t = j["target"]
        for i, r in enumerate(j["runs"], 1):
            rows.append([f"{t['ranks']:,} ranks ({r['nodes']:,} nodes, {r['groups']} groups"
                         + (f", {r['hop_groups']} with member streams" if "hop_groups" in r else "")
                         + f") at {t['rate']:g}/s", i,
                         f"{r['achieved_steps_per_s']:.3f}", f"{r['reduce_p50_ms']:.0f}",
                         f"{r['reduce_p99_ms']:.0f} ({p99_label(r.get('reduce_n'))})",
                         f"{r['aggregator_cpu_frac'] * 100:.0f}%", f"{r['rank_wait_p99_ms']:.1f}",
                         _or(r.get("decision_wait_max_ms"), "{:.0f}") + (f" ({r['decisions']})" if r.get("decisions")
                                                                          else "")
                         + (f"; {max(r['directive_after_lease_ms']):.0f}" if r.get("directive_after_lease_ms") else ""),
                         "/".join(f"{c * 100:.0f}%" for c in r.get("sender_cpu_frac") or []) or "-",
                         _or(r.get("heartbeats_per_s"), "{:,.0f}") + " / " + _or(r.get("telemetry_per_s"), "{:,.0f}"),
                         _or(r.get("console_chars"), "{:,}"), _or(r.get("hang_check_max_ms"), "{:.0f}"),
                         _or(r.get("rejected"), "{}")])
    lines = [
        C.table(["configuration", "repeat", "achieved steps/s", "reduce p50 ms",
                 f"reduce p99 ms (the max where a repeat reduced fewer than {P99_MIN_STEPS} steps)",
                 "aggregator CPU (of a core)", "rank wait p99 ms",
                 "rank 0's directive wait, max ms (candidates); of which after its step's lease",
                 "senders' CPU", "heartbeats / telemetry packets per s", "console chars drained",
                 "hang check max ms", "packets refused"], rows),
        "",
    ]
    for j in out["targets"]:
        r = j["runs"][0]
        if "heartbeat_s" in r:
            lines += [f"At {r['ranks']:,} ranks, {simulated(r)}.", ""]
    for key, what in (("agent_a3", "Atlas A3-shaped node"), ("agent_8", "8 ranks, for context")):
        agent = out.get(key) or []
        if not agent:
            continue
        a = agent[0]
        lines.append(
            f"Node agent process, {what} (`bench/_agent_node.py`: the launcher's `NodeAgents`, {a['ranks']} ranks' "
            f"`RelayChannel`s sending every step's packet within {a['spread_ms']:g} ms and taking the lease at "
            f"{a['rate']:g} steps/s, {a['steps']} steps, heartbeats every {a['heartbeat_s']:g} s, {a['cards']} "
            f"cards' telemetry every {a['telemetry_interval_s']:g} s through the npu-smi sampler on recorded output; "
            "every thread of the process counted): "
            + ", ".join(f"{r['cpu_frac'] * 100:.2f}% of a core ({r['cpu_ms_per_step']:.3f} ms a step)" for r in agent)
            + " over the repeats; the same process with the ranks between steps: "
            + ", ".join(f"{r['idle_cpu_frac'] * 100:.2f}%" for r in agent)
            + "; the fake npu-smi's own processes: "
            + ", ".join(f"{r['npu_smi_children_cpu_frac'] * 100:.2f}%" for r in agent) + ".")
    old = out.get("agent") or []  # results stored before the A3-shaped measurement
    if old:
        lines.append(f"Node agent process, as a launch runs it ({old[0]['ranks']} ranks at {old[0]['rate']:g} steps/s, "
                     f"{old[0]['steps']} steps, card telemetry on): "
                     + ", ".join(f"{r['cpu_ms_per_step']:.3f}" for r in old) + " ms of CPU per step over the repeats "
                     "(the same process idle: " + ", ".join(f"{r['idle_cpu_ms_per_step']:.3f}" for r in old)
                     + " ms per step's worth of time).")
    return "\n".join(lines)


def _or(v, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)
