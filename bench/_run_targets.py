"""The targets table of docs/benchmarks.md (bench/run_all.py): one row a target, from each
piece's stored result, with what was measured, the verdict and by how much."""

from __future__ import annotations

import math

import _common as C
from _run_pieces import PERF_BUDGET_S


def targets_table(res: dict, perf_s: float | None, rules_wall_s: float = 0.0,
                  perf_failed: tuple[str, ...] = ()) -> tuple[str, list[str]]:
    """`perf_failed`: the performance pieces none of whose attempts succeeded in the run `perf_s`
    timed (a piece that failed was not run, whatever the time: the 20-minute row is missed)."""
    rows = []
    ov = res.get("overhead")
    if ov:
        for t in ov["targets"]:
            where = "the rank pinned to its own core" if t.get("pinned") else "unpinned"
            if t.get("kind") == "path":
                rows.append([f"{t['path']} path: default monitoring's mean added time <= MindFormers' MFLossMonitor's "
                             f"on the same cell ({t['model']} model, {t['bare_step_s'] * 1000:.0f} ms bare step, "
                             f"{where})",
                             f"{t['mp_added_ms']:+.2f} ms against {t['mf_added_ms']:+.2f} ms a step (n={t['repeats']}; "
                             f"worst repeat of the difference {t['worst_over_ms']:+.2f} ms)",
                             "met" if t["met"] else "missed",
                             f"{abs(t['mp_added_ms'] - t['mf_added_ms']):.2f} ms " + ("under" if t["met"] else "over")
                             + ("" if t["met"] else "; where the rank's time goes: the per-part table under "
                                "'In-rank overhead'")
                             + (f"; {t['disturbed_kept']} repeats kept from a loaded machine"
                                if t.get("disturbed_kept") else "")])
                continue
            if t.get("kind") == "first_step":
                rows.append([f"the MindFormers path's first step adds <= {t['limit_ms']:.0f} ms to MFLossMonitor's on "
                             f"the same cell ({t['model']} model, {where}; graphs compiled)",
                             f"{t['added_ms']:+.1f} ms (mean of {t['runs']} runs)", "met" if t["met"] else "missed",
                             f"{abs(t['limit_ms'] - t['added_ms']):.1f} ms " + ("under" if t["met"] else "over")])
                continue
            if t.get("kind") == "callback_cpu":
                rows.append([f"the callback's own CPU <= {t['limit_ms']:.1f} ms a step (training thread, every step "
                             f"counted, collect steps included; {t['model']} model, recipe path)",
                             f"{t['cpu_ms']:.3f} ms; rank 0's verdict wait {t['verdict_wait_ms']:.3f} ms a step",
                             "met" if t["met"] else "missed",
                             f"{abs(t['limit_ms'] - t['cpu_ms']):.3f} ms " + ("under" if t["met"] else "over")
                             + ("" if t["met"] else "; by part: the per-part table under 'In-rank overhead'")])
                continue
            if t.get("kind") == "over_mf":
                rows.append([f"default monitoring adds at most MindFormers' MFLossMonitor's added time + "
                             f"{t['limit_ms']:.1f} ms to a step, every repeat ({t['model']} model, "
                             f"{t['none_step_s'] * 1000:.0f} ms step, {where})",
                             f"worst of {t['repeats']}: {t['worst_ms']:+.2f} ms (mean {t['mean_ms']:+.2f} ms)",
                             "met" if t["met"] else "missed",
                             f"{abs(t['limit_ms'] - t['worst_ms']):.2f} ms " + ("under" if t["met"] else "over")
                             + ("" if t["met"] else "; where the rank's time goes: the per-part table under "
                                "'In-rank overhead'")])
                continue
            beside = (f"; unpinned beside it: worst {t['unpinned_worst']:.3f}x (mean {t['unpinned_mean']:.3f}x)"
                      if t.get("unpinned_worst") is not None else "")
            rows.append([f"default monitoring (monitored cell + Monitor + relay + aggregator) <= {t['limit']:.2f}x a bare "
                         f"TrainOneStepCell, mean step over all steps, worst repeat ({t['model']} model, "
                         f"{t['none_step_s'] * 1000:.0f} ms step, {where})",
                         f"worst of {t['repeats']}: {t['worst_ratio']:.3f}x (mean {t['mean_ratio']:.3f}x)"
                         + (f"; noise floor: LossMonitor's worst repeat {t['noise_floor_worst']:.3f}x"
                            if t.get("noise_floor_worst") is not None else "") + beside,
                         "met" if t["met"] else "missed",
                         f"{t['limit'] - t['worst_ratio']:.3f} under the limit" if t["met"] else
                         f"{t['worst_ratio'] - t['limit']:.3f} over the limit; where the rank's time goes: the "
                         "per-part table under 'In-rank overhead'"])
    fi = res.get("fanin")
    if fi:
        from _fanin_report import simulated
        from _fanin_targets import TARGETS, judge, p99_label

        for j in fi["targets"]:
            now = next((t for t in TARGETS if (t["ranks"], t["rate"]) == (j["target"]["ranks"], j["target"]["rate"])),
                       None)
            if now is not None and now != j["target"]:
                j = judge(now, j["runs"])  # the stored runs judged against the target as it stands now
            t, w = j["target"], j["worst"]
            limits = fanin_limits(t)
            r0 = j["runs"][0]
            got = (f"worst of {len(j['runs'])}: {w['achieved_steps_per_s']:.3f} steps/s, reduce "
                   f"{w['reduce_p99_ms']:.0f} ms ({p99_label(w.get('reduce_n'))}), aggregator {w['aggregator_cpu_frac'] * 100:.0f}% of a core, "
                   f"rank wait p99 {w['rank_wait_p99_ms']:.1f} ms")
            if "end_to_end_p99_ms" in r0:  # what the ranks see, the members' hop and the simulation's own work included
                runs = j["runs"]
                e2e = max(r["end_to_end_p99_ms"] or math.inf for r in runs)
                got += (f"; end to end (every node's batch handed over to every node holding the lease) "
                        f"{e2e:.0f} ms ({p99_label(min(r['end_to_end_n'] for r in runs))}); ")
                if any(r.get("decisions") for r in runs):
                    after = max(max(r.get("directive_after_lease_ms") or [0]) for r in runs)
                    got += (f"rank 0's directive wait at {C.plural(sum(r['decisions'] for r in runs), 'candidate')} up to "
                            f"{max(r['decision_wait_max_ms'] or 0 for r in runs):.0f} ms"
                            + (f" ({after:.0f} ms of it after the step's lease reached node 0); " if after else "; "))
                else:
                    got += "no checkpoint candidate reached; "
                got += (f"the sender processes up to {max(max(r['sender_cpu_frac']) for r in runs) * 100:.0f}% "
                        "of a core each")
            missed = [k for k, ok in j["checks"].items() if not ok]
            scraped = (f", Prometheus endpoint scraped every {w['scrape_every_s']:g} s (worst scrape "
                       f"{w['scrape_max_ms']:.0f} ms)" if w.get("scrape_max_ms") is not None else "")
            what = (f"; {simulated(r0)}" if "heartbeat_s" in r0
                    else "; no card telemetry or heartbeats in this simulation")
            rows.append([f"{t['ranks']:,} ranks at {t['rate']:g} steps/s, TensorBoard on{scraped}: "
                         + ", ".join(limits) + what, got,
                         "met" if j["met"] else "missed", "all limits held" if not missed else
                         "missed: " + ", ".join(missed) + ("; where the aggregator's time goes: the investigations below, "
                                                          "'Where the aggregator's time goes at 32,768 ranks'"
                                                          if t["ranks"] >= 32768 else "")])
        if fi.get("agent_a3"):
            rows.append(agent_row(fi))
        elif fi.get("agent"):  # results stored before the A3-shaped target
            agent = max(r["cpu_ms_per_step"] for r in fi["agent"])
            traffic = max(r["cpu_ms_per_step"] - r["idle_cpu_ms_per_step"] for r in fi["agent"])
            rows.append(["node agent <= 1 ms of CPU per step for 8 ranks (the whole process, as launched)",
                         f"worst of {len(fi['agent'])}: {agent:.3f} ms (above the same process idle: at most "
                         f"{traffic:.3f} ms)",
                         "met" if agent <= 1.0 else "missed", f"{abs(1.0 - agent):.3f} ms "
                         + ("under" if agent <= 1.0 else "over")])
    ex = res.get("exporter")
    if ex:
        big = max(ex["scrape"], key=lambda s: s["ranks"])
        rows.append([f"a scrape of the Prometheus endpoint answers in < {ex['target_ms']:.0f} ms at {big['ranks']:,} "
                     f"ranks (every node's card telemetry in, {big['cards']:,} cards; the aggregator's own code, "
                     "scraped over loopback)",
                     f"worst of {big['scrapes']}: {big['scrape_max_ms']:.1f} ms ({big['series']:,} series)",
                     "met" if big["met"] else "missed",
                     f"{abs(ex['target_ms'] - big['scrape_max_ms']):.1f} ms "
                     + ("under the limit" if big["met"] else "over the limit")])
    if res.get("fanin_sinks"):
        rows += sink_rows(res["fanin_sinks"])
    mem = res.get("memory")
    if mem:
        g = mem["growth_second_half_mb"]
        rows.append([f"aggregator memory bounded over {mem['steps']:,} steps ({mem['world']} ranks): growth over "
                     "the second half < 5 MiB", f"{g:+.1f} MiB ({mem['growth_total_mb']:+.1f} MiB in all)",
                     "met" if g < 5 else "missed", f"{5 - g:.1f} MiB under the limit" if g < 5 else
                     f"{g - 5:.1f} MiB over the limit"])
    if res.get("rules"):
        from rules import target_rows

        rows += target_rows(res["rules"])
    rules_s = f"; its last run took {rules_wall_s / 60:.1f} min" if rules_wall_s else ""
    what = ("`make bench` under 20 minutes on this machine, every performance piece run (the rules campaign's "
            f"real launches are `make bench-rules`{rules_s})")
    if perf_s is None:
        rows.append([what, "no run of every performance piece recorded", "missed", "-"])
    elif perf_failed:
        rows.append([what, f"{perf_s / 60:.1f} min, but {', '.join(sorted(perf_failed))} failed in every attempt",
                     "missed", "every piece must run: a failed piece's rows are absent above"])
    else:
        rows.append([what, f"{perf_s / 60:.1f} min", "met" if perf_s < PERF_BUDGET_S else "missed",
                     f"{abs(PERF_BUDGET_S - perf_s) / 60:.1f} min " + ("to spare" if perf_s < PERF_BUDGET_S else "over")])
    return C.table(["target", "measured", "result", "by how much"], rows), [r[2] for r in rows]


def fanin_limits(t: dict) -> list[str]:
    """A fan-in target's limits in words."""
    limits = [f"achieved >= {t['achieved']}", f"reduce p99 < {t['p99_ms']:.0f} ms"]
    if t["cpu"] is not None:
        limits.append(f"aggregator <= {t['cpu'] * 100:.0f}% of a core")
    if t["wait_ms"] is not None:
        limits.append(f"rank wait p99 {t['wait_ms']:.0f} ms")
    return limits


def sink_rows(fs: dict) -> list[list[str]]:
    """The fan-in with each tracker sink (`fanin.py --sink none,mlflow,swanlab`): one row a sink,
    the aggregator's CPU per reduced step; the row without a tracker is judged against the fan-in
    target of its ranks and rate, the trackers' rows are costs set beside its limits,
    saying what was simulated and what the simulation leaves out."""
    from _fanin_report import simulated, tracker_failures
    from _fanin_targets import p99_label

    t = fs.get("target")
    ok = {s: [r for r in runs if "skipped" not in r] for s, runs in fs["sink_runs"].items()}
    base = max((r["aggregator_cpu_ms_per_step"] for r in ok.get("none", [])), default=None)
    rows = []
    for sink, runs in fs["sink_runs"].items():
        if not ok[sink]:
            rows.append([f"fan-in with tracker sink {sink}", runs[0].get("skipped", "no run"), "not measured", "-"])
            continue
        r0, n = ok[sink][0], len(ok[sink])
        cpu_ms = max(r["aggregator_cpu_ms_per_step"] for r in ok[sink])
        what = (f"{r0['ranks']:,} ranks at {r0['asked_steps_per_s']:g} steps/s, TensorBoard "
                f"{'on' if r0['tensorboard'] else 'off'}, Prometheus endpoint scraped every {r0['scrape_every_s']:g} s, "
                f"tracker sink {sink}: the aggregator's CPU per reduced step (its whole process)"
                + (f", within the {t['ranks']:,}-rank fan-in target's limits: " + ", ".join(fanin_limits(t)) if t
                   else "") + f"; {simulated(r0)}")
        got = (f"worst of {n}: {cpu_ms:.2f} ms of CPU per reduced step"
               + (f" ({cpu_ms - base:+.2f} ms over none)" if base is not None and sink != "none" else "")
               + f", {max(r['aggregator_cpu_frac'] for r in ok[sink]) * 100:.0f}% of a core; "
               f"{min(r['achieved_steps_per_s'] for r in ok[sink]):.3f} steps/s, reduce "
               f"{max(r['reduce_p99_ms'] or math.inf for r in ok[sink]):.0f} ms "
               f"({p99_label(min(r.get('reduce_n') or 0 for r in ok[sink]))}), rank wait p99 "
               f"{max(r['rank_wait_p99_ms'] or 0.0 for r in ok[sink]):.1f} ms")
        failed = [x for r in ok[sink] for x in tracker_failures(r)]
        if failed:
            got += f"; the tracker failed: {failed[0]}"
        j = (fs.get("judged") or {}).get(sink)
        if j is None:
            rows.append([what, got, "measured", "no target of this size and rate"])
            continue
        missed = [k for k, v in j["checks"].items() if not v]
        if sink != "none":  # a cost row: the 4,096-rank target is judged with TensorBoard and the endpoint
            rows.append([what, got, "missed" if failed else "measured", "no target for a tracker; " + (
                "within the fan-in target's limits" if not missed and not failed else
                "beyond the fan-in target's limits: " + ", ".join(missed + (["the tracker failed"] if failed else [])))
                + " (the tracker's own writes run in the aggregator's process: MLflow's file store writes a file "
                "a series, SwanLab offline its own log)"])
            continue
        rows.append([what, got, "met" if j["met"] and not failed else "missed",
                     "all limits held" if not missed and not failed else
                     "missed: " + ", ".join(missed + (["the tracker failed"] if failed else []))])
    return rows


def agent_row(fi: dict) -> list[str]:
    """The node agent's target row: an Atlas A3-shaped node, with the 8-rank figure as context."""
    t = fi["agent_target"]
    runs = fi["agent_a3"]
    a = runs[0]
    worst = max(r["cpu_frac"] for r in runs)
    ok = worst <= t["cpu_frac"]
    eight = fi.get("agent_8") or []
    context = (f"; 8 ranks at {eight[0]['rate']:g} steps/s (the earlier target, 1 ms a step): "
               f"{max(r['cpu_ms_per_step'] for r in eight):.3f} ms a step, {max(r['cpu_frac'] for r in eight) * 100:.2f}% "
               "of a core" if eight else "")
    return [f"node agent <= {t['cpu_frac'] * 100:.0f}% of one core for {t['ranks']} ranks on one node (an Atlas A3 "
            f"node has 16 chips) at {t['rate']:g} steps/s, whole process, with telemetry on ({a['cards']} cards every "
            f"{a['telemetry_interval_s']:g} s through the npu-smi sampler on recorded output; heartbeats every "
            f"{a['heartbeat_s']:g} s; rank 0 decides at checkpoint candidates; the ranks' frames of a step within "
            f"{a['spread_ms']:g} ms)",
            f"worst of {len(runs)}: {worst * 100:.2f}% of a core ({max(r['cpu_ms_per_step'] for r in runs):.3f} ms "
            f"a step; ranks between steps: {max(r['idle_cpu_frac'] for r in runs) * 100:.2f}%; the fake npu-smi's "
            f"own processes {max(r['npu_smi_children_cpu_frac'] for r in runs) * 100:.2f}%, not counted){context}",
            "met" if ok else "missed",
            f"{abs(t['cpu_frac'] - worst) * 100:.2f} points " + ("under" if ok else "over")]
