"""The in-rank benchmark's figures (bench/overhead.py): each model's results from its kept
repeats, the targets judged on them, and the text bench/run_all.py puts in
docs/benchmarks.md (`render`)."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import _common as C
from _overhead_config import (
    CPU_LIMIT_MS,
    CPU_OF,
    FIRST_STEP_LIMIT_MS,
    LABELS,
    OVER_MF_LIMIT_MS,
    PATHS,
    STEP_TARGET_MS,
    TARGETS,
)
from _overhead_parts import CALLBACKS_ALONE, OUTBOX

if TYPE_CHECKING:  # the rig imports numpy: rendering a stored result needs none of it
    from _overhead_rig import Rig


def summarize(runs: list[list[float]]) -> dict:
    """Per-repeat means and medians of one configuration's timed steps."""
    means = [statistics.fmean(r) for r in runs]
    pooled = [x for r in runs for x in r]
    return {"mean": statistics.fmean(pooled), "median": statistics.median(pooled), "mean_min": min(means),
            "mean_max": max(means), "max": max(pooled), "rep_means": means,
            "rep_medians": [statistics.median(r) for r in runs]}


def model_result(mname: str, spec: dict, rig: Rig, calibration: dict, cfgs: list[str], g: dict, repeats: int,
                 layout: str, pinned: bool) -> dict:
    """One model's figures in one layout, from its kept repeats."""
    rows = {}
    kept = g["kept"]
    base = [statistics.fmean(r["none"][0]) for r in kept]
    for c in cfgs:
        s = summarize([r[c][0] for r in kept])
        ratios = [m / b for m, b in zip(s["rep_means"], base)]
        med_ratios = [m / statistics.median(r["none"][0]) for m, r in zip(s["rep_medians"], kept)]
        cpu = {k: statistics.fmean(r[c][1][k] for r in kept) for k in kept[0][c][1]}
        rows[c] = {"label": LABELS[c], "step_s": s, "cpu_s_per_step": cpu,
                   "ratio": {"mean": statistics.fmean(ratios), "min": min(ratios), "max": max(ratios),
                             "worst": max(ratios), "per_repeat": ratios},
                   "median_ratio": {"mean": statistics.fmean(med_ratios), "min": min(med_ratios),
                                    "max": max(med_ratios)}}
    over_mf = None
    if "mp_default" in rows and "mf_loss" in rows:
        # per repeat: what mindpulse adds to the bare step, less what MFLossMonitor adds to it
        over_mf = [(m - f) * 1000 for m, f in zip(rows["mp_default"]["step_s"]["rep_means"],
                                                  rows["mf_loss"]["step_s"]["rep_means"])]
    return {
        "shape": {k: v for k, v in spec.items() if k not in ("timed", "repeats", "rounds")}, "params": rig.params,
        "step_target_ms": STEP_TARGET_MS.get(mname), "batch_calibration": calibration,
        "timed_steps": spec["timed"], "rounds": spec["rounds"], "repeats": len(kept), "repeats_asked": repeats,
        "discarded": g["discarded"], "disturbed_kept": g["disturbed_kept"], "foreign_cores": g["foreign"],
        "waited_s": g["waited_s"], "configs": rows, "layout": layout, "pinned": pinned, "over_mf_ms": over_mf,
        "mindpulse": None,
    }


def targets_of(results: dict, profiles: dict[str, dict[str, float]]) -> list[dict]:
    """Every target judged: the default path against the bare cell and against MFLossMonitor,
    each path's added time, the MindFormers path's first step, and the callback's own CPU."""
    targets = []
    for mname, r in results.items():
        if mname not in TARGETS or "mp_default" not in r["configs"]:
            continue
        ra = r["configs"]["mp_default"]["ratio"]
        floor = r["configs"].get("loss_monitor", {}).get("ratio")
        beside = results.get(f"{mname} (unpinned)", {}).get("configs", {}).get("mp_default", {}).get("ratio")
        targets.append({"model": mname, "none_step_s": r["configs"]["none"]["step_s"]["mean"], "pinned": r["pinned"],
                        "limit": TARGETS[mname], "mean_ratio": ra["mean"], "worst_ratio": ra["worst"],
                        "met": ra["worst"] <= TARGETS[mname], "repeats": r["repeats"],
                        "noise_floor_worst": floor["worst"] if floor else None,
                        "unpinned_worst": beside["worst"] if beside else None,
                        "unpinned_mean": beside["mean"] if beside else None})
        over = r.get("over_mf_ms")
        if over:
            targets.append({"model": mname, "kind": "over_mf", "pinned": r["pinned"], "limit_ms": OVER_MF_LIMIT_MS,
                            "worst_ms": max(over), "mean_ms": statistics.fmean(over), "repeats": len(over),
                            "met": max(over) <= OVER_MF_LIMIT_MS,
                            "none_step_s": r["configs"]["none"]["step_s"]["mean"]})
        for path, (mp, mf, bare) in PATHS.items():
            if not all(c in r["configs"] for c in (mp, mf, bare)):
                continue
            reps = r["configs"]
            base = reps[bare]["step_s"]["rep_means"]
            mp_added = [(m - b) * 1000 for m, b in zip(reps[mp]["step_s"]["rep_means"], base)]
            mf_added = [(m - b) * 1000 for m, b in zip(reps[mf]["step_s"]["rep_means"], base)]
            over = [a - f for a, f in zip(mp_added, mf_added)]
            targets.append({"model": mname, "kind": "path", "path": path, "pinned": r["pinned"],
                            "mp_added_ms": statistics.fmean(mp_added), "mf_added_ms": statistics.fmean(mf_added),
                            "worst_over_ms": max(over), "repeats": len(over),
                            "met": statistics.fmean(mp_added) <= statistics.fmean(mf_added),
                            "worst_met": max(over) <= 0.0,
                            "bare_step_s": reps[bare]["step_s"]["mean"], "disturbed_kept": r.get("disturbed_kept")})
        first = r.get("first_step_ms") or {}
        if "MindFormers" in first:
            targets.append({"model": mname, "kind": "first_step", "path": "MindFormers", "pinned": r["pinned"],
                            "added_ms": first["MindFormers"], "limit_ms": FIRST_STEP_LIMIT_MS,
                            "met": first["MindFormers"] <= FIRST_STEP_LIMIT_MS, "runs": first.get("runs")})
    for mname, parts in profiles.items():
        cpu = parts.get(CALLBACKS_ALONE, parts.get("callback total"))
        if cpu is not None and mname in CPU_LIMIT_MS:
            targets.append({"model": mname, "kind": "callback_cpu", "cpu_ms": cpu * 1000, "limit_ms": CPU_LIMIT_MS[mname],
                            "met": cpu * 1000 <= CPU_LIMIT_MS[mname],
                            "verdict_wait_ms": parts.get("wait: the verdict (wall, less its CPU)", 0.0) * 1000})
    return targets


def render(out: dict) -> str:
    lines = []
    for mname, r in out["results"].items():
        sh = r["shape"]
        quiet = (f"; {C.plural(r['discarded'], 'repeat')} beside other processes' load discarded and run again"
                 if r.get("discarded") else "")
        if r.get("disturbed_kept"):
            quiet += f"; {C.plural(r['disturbed_kept'], 'repeat')} kept although other processes were busy (no time left)"
        lines.append(f"\n{mname} model ({r.get('layout', 'unpinned')}): {sh['num_layers']} layers, hidden {sh['hidden_size']}, seq {sh['seq_length']}, "
                     f"batch {sh['batch_size']}, {r['params'] / 1e6:.2f} M parameters; {r['repeats']} repeats x "
                     f"{r['timed_steps']} timed steps per configuration, in {r.get('rounds', 1)} interleaved runs of "
                     f"{r['timed_steps'] // r.get('rounds', 1)}{quiet}\n")
        if r.get("batch_calibration"):
            cal = r["batch_calibration"]
            lines.append(f"batch {sh['batch_size']} chosen so the bare step is closest to the ~{r['step_target_ms']:.0f} "
                         "ms its target names (bare TrainOneStepCell, median step by batch size: "
                         + ", ".join(f"{b}: {t:.1f} ms" for b, t in cal.items()) + ")\n")
        rows = []
        base = r["configs"]["none"]["step_s"]["mean"]
        for v in r["configs"].values():
            st, ra = v["step_s"], v["ratio"]
            cpu = v.get("cpu_s_per_step") or {}
            rows.append([v["label"], C.fmt_ms(st["mean"]), f"{C.fmt_ms(st['mean_min'])}-{C.fmt_ms(st['mean_max'])}",
                         C.fmt_ms(st["median"]), C.fmt_ms(st["max"]), f"{(st['mean'] - base) * 1000:+.2f}",
                         f"{ra['mean']:.3f}", f"{ra['min']:.3f}-{ra['max']:.3f}", f"{ra['worst']:.3f}",
                         f"{v['median_ratio']['mean']:.3f}",
                         " / ".join(f"{cpu[k] * 1000:.1f}" if k in cpu else "-" for k in CPU_OF)])
        lines.append(C.table(["configuration", "mean step ms", "mean: range over repeats", "median step ms",
                              "slowest step ms", "mean over baseline ms", "ratio (of means)", "ratio range",
                              "worst repeat", "ratio of medians", "CPU ms per step: " + " / ".join(CPU_OF)], rows))
        mp = r.get("mindpulse")
        if mp:
            pk = mp.get("packets") or {}
            lines.append(f"\nmindpulse path: the rank blocked on the aggregator {mp.get('monitor_wait_s') or 0:.3f} s "
                         f"in all over {mp.get('steps_reduced')} reduced steps (`monitor_wait_s`, warm-up and "
                         f"decision steps included); {mp.get('saves_asked')} checkpoint saves asked for (not "
                         f"written); packets accepted {pk.get('accepted')}, rejected {pk.get('rejected')}; monitor "
                         f"errors and channel failures {mp.get('monitor_errors')}")
    lines.append("")
    for t in out["targets"]:
        where = "rank pinned to its own core" if t.get("pinned") else "unpinned"
        if t.get("kind") in ("path", "first_step", "callback_cpu"):
            continue  # below
        if t.get("kind") == "over_mf":
            lines.append(
                f"- target ({t['model']} model, {t['none_step_s'] * 1000:.0f} ms step, {where}): default mindpulse path "
                f"adds <= MFLossMonitor's added time + {t['limit_ms']:.1f} ms, worst repeat: {t['worst_ms']:+.2f} ms "
                f"(mean {t['mean_ms']:+.2f} ms, n={t['repeats']}): {'met' if t['met'] else 'MISSED'}")
            continue
        lines.append(
            f"- target ({t['model']} model, {t['none_step_s'] * 1000:.0f} ms step, {where}): default mindpulse path "
            f"<= {t['limit']:.2f}x a bare TrainOneStepCell, mean step over all steps, worst repeat: "
            f"{t['worst_ratio']:.3f} (mean over repeats {t['mean_ratio']:.3f}, n={t['repeats']}): "
            f"{'met' if t['met'] else 'MISSED'}"
            + (f"; unpinned beside it: worst {t['unpinned_worst']:.3f} (mean {t['unpinned_mean']:.3f})"
               if t.get("unpinned_worst") is not None else ""))
        if t.get("noise_floor_worst") is not None:
            lines.append(
                f"  - noise floor in the same run: MindSpore's LossMonitor (one scalar read a step) has a worst repeat of "
                f"{t['noise_floor_worst']:.3f}x" + (" — above the limit itself: on this machine a repeat's ratio moves "
                                                    "by more than the target for reasons other than monitoring"
                                                    if t["noise_floor_worst"] > t["limit"] else ""))
    for t in out["targets"]:
        where = "rank pinned to its own core" if t.get("pinned") else "unpinned"
        if t.get("kind") == "path":
            lines.append(
                f"- target ({t['model']} model, {where}), {t['path']} path: mindpulse's mean added time "
                f"{t['mp_added_ms']:+.2f} ms a step <= MFLossMonitor's on the same cell {t['mf_added_ms']:+.2f} ms "
                f"(bare step {t['bare_step_s'] * 1000:.0f} ms; worst repeat of the difference {t['worst_over_ms']:+.2f} "
                f"ms, n={t['repeats']}): {'met' if t['met'] else 'MISSED'}"
                + ("" if t["worst_met"] or not t["met"] else " (not in every repeat)"))
        elif t.get("kind") == "first_step":
            lines.append(
                f"- target ({t['model']} model, {where}): the MindFormers path's first step (its Monitor's start "
                f"included) adds {t['added_ms']:+.1f} ms to MFLossMonitor's on the same cell (mean over "
                f"{t['runs']} runs, graphs compiled) <= {t['limit_ms']:.0f} ms: {'met' if t['met'] else 'MISSED'}")
        elif t.get("kind") == "callback_cpu":
            lines.append(
                f"- target ({t['model']} model): the callback's own CPU {t['cpu_ms']:.3f} ms a step (training "
                f"thread, every step counted) <= {t['limit_ms']:.1f} ms: {'met' if t['met'] else 'MISSED'}; "
                f"rank 0's wait for the checkpoint verdict: {t['verdict_wait_ms']:.3f} ms a step")
    for mname, parts in (out.get("profile") or {}).items():
        n = (out.get("profile_steps") or {}).get(mname)
        lines.append(f"\nThe rank's CPU per step by part ({mname} model, pinned; one more run of the default path over "
                     f"{n} steps with each part's functions wrapped to add up each thread's CPU clock: the training "
                     "thread's, and the rank's outbox thread's (workers/outbox.py: the packet's encoding and sending, "
                     "the verdict's question and answer) beside it; the waits are the training thread's wall-clock "
                     "time blocked on the relay; the last row is the whole rank process's CPU, every thread, training "
                     "included):\n")
        total = parts.get("callback total") or 0.0
        not_cpu = ("the rank process, every thread", "callback wall total", CALLBACKS_ALONE)
        rows = [[k, f"{v * 1000:.3f}", f"{parts[OUTBOX + k] * 1000:.3f}" if OUTBOX + k in parts else "-",
                 f"{v / total * 100:.0f}%" if total and k not in not_cpu and not k.startswith("wait:") else "-"]
                for k, v in parts.items() if not k.startswith(OUTBOX)]
        lines.append(C.table(["part", "training thread ms per step", "outbox thread ms per step",
                              "of the callback's CPU (training thread)"], rows))
    return "\n".join(lines)
