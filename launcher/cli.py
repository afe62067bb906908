"""The `mindpulse` command.

Exit codes: 0 success, 1 job failed, 2 bad config or usage, 3 stopped by an anomaly
rule, 4 refused by the pre-flight card check (a slow or failed card), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from mindpulse.config import ConfigError, RunConfig, load_config

from .spec import ExitCode, RankSpec


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mindpulse", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    lp = sub.add_parser("launch", help="launch a data-parallel run and monitor it")
    lp.add_argument("config", nargs="?", type=Path,
                    help="cluster config YAML (default: cluster_configs/local_cpu.yaml)")
    lp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field, e.g. --set train.steps=20 (repeatable)")
    lp.add_argument("--inject", action="append", default=[], metavar="KIND@RANK:STEP",
                    help="inject a fault in a real rank, e.g. nan_grad@1:5 (repeatable; see docs/faults.md)")
    lp.add_argument("--resume", type=Path, metavar="RUN_DIR",
                    help="continue RUN_DIR's job from its newest valid checkpoint (its config.yaml is used)")
    lp.add_argument("--resume-from", default="latest", metavar="best|latest|PATH",
                    help="which checkpoint --resume starts from (default: latest)")

    pf = sub.add_parser("preflight", help="pre-flight card check: every rank's matmul GFLOP/s and the world's "
                        "all-reduce GB/s, started as launch starts the ranks; exit code 4 on a slow or failed card")
    pf.add_argument("config", nargs="?", type=Path,
                    help="cluster config YAML (default: cluster_configs/local_cpu.yaml)")
    pf.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    pf.add_argument("--inject", action="append", default=[], metavar="slow_card@RANK",
                    help="rehearse a slow card: slow_card@1 (repeatable; see docs/faults.md)")
    pf.add_argument("--json", action="store_true", help="print preflight.json's object (messages go to stderr)")

    dp = sub.add_parser("doctor", help="what the ranks on every node will find (Python, mindpulse, MindSpore, "
                        "MindFormers, CANN, driver, npu-smi, Ray), judged against the supported ranges; exit 2 "
                        "when something does not fit")
    dp.add_argument("config", nargs="?", type=Path,
                    help="cluster config YAML (default: cluster_configs/local_cpu.yaml)")
    dp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    dp.add_argument("--json", action="store_true", help="every node's probe and verdicts as JSON (messages to stderr)")

    cp = sub.add_parser("config", help="print the resolved config (validates it)")
    cp.add_argument("config", nargs="?", type=Path)
    cp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    pl = sub.add_parser("plan", help="print every rank's node, device, environment and command; starts nothing")
    pl.add_argument("config", nargs="?", type=Path)
    pl.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    pl.add_argument("--json", action="store_true", help="a JSON list: node, rank, local_rank, device_id, env, command")

    rp = sub.add_parser("report", help="write RUN_DIR/report/ (plots and report.html) from metrics.msgpack")
    rp.add_argument("run_dir", type=Path)
    rp.add_argument("--out", type=Path, default=None, help="output folder (default RUN_DIR/report)")

    tp = sub.add_parser("top", help="live cluster table of a running (or finished) run; q quits")
    tp.add_argument("run_dir", nargs="?", type=Path, help="run directory (default: the newest under runs/)")
    tp.add_argument("--root", type=Path, default=Path("runs"))
    tp.add_argument("--interval", type=float, default=1.0)
    tp.add_argument("--once", action="store_true", help="print one frame and exit")
    tp.add_argument("--page", type=int, default=None,
                    help="show page N of the ranks (16 a page), not the ranks that matter; n/p page on a terminal")

    from .rules_cmd import add_parser as add_rules_parser

    add_rules_parser(sub)  # mindpulse rules RUN_DIR [set|add|disable ...]: launcher/rules_cmd.py

    tel = sub.add_parser("telemetry", help="card telemetry tools")
    tsub = tel.add_subparsers(dest="telemetry_command", required=True)
    tpp = tsub.add_parser("parse-npu-smi", help="parse a saved npu-smi output (table or key:value)")
    tpp.add_argument("file", type=Path)
    tpp.add_argument("--json", action="store_true")
    tsp = tsub.add_parser("sample", help="one sample of this machine with whatever source is present")
    tsp.add_argument("--device", default="auto", choices=["auto", "ascend", "gpu", "cpu"])
    tsp.add_argument("--json", action="store_true")

    pp = sub.add_parser("pretrain", help="pretrain the recipe's base checkpoint (single process, CPU)")
    pp.add_argument("--out", type=Path, default=None, help="checkpoint to write (default: the recipe's base)")
    pp.add_argument("--steps", type=int, default=400)
    pp.add_argument("--batch-size", type=int, default=16)
    pp.add_argument("--lr", type=float, default=3e-3)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) and int(ExitCode.USAGE)
    try:
        if args.command == "doctor":
            from .doctor import doctor_command

            cfg, path = load_config(args.config, args.overrides)
            return doctor_command(cfg, str(args.config or ""), as_json=args.json)
        if args.command in ("launch", "config", "preflight"):
            resume = None
            config_file = args.config
            if getattr(args, "resume", None):
                from .resume import resolve_resume

                resume, resume_cfg = resolve_resume(args.resume, args.resume_from)
                config_file = config_file or resume_cfg
                for line in resume.pop("refused", []):
                    print(f"mindpulse: {line}", file=sys.stderr)
            cfg, path = load_config(config_file, args.overrides)
            if getattr(args, "inject", None):
                from mindpulse.config import validate

                cfg.faults = list(cfg.faults) + list(args.inject)
                validate(cfg)
            if resume is not None:
                print(f"mindpulse: resuming from {resume['path']} (step {resume['step']})")
            if args.command == "config":
                import yaml

                print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
                return 0
            if args.command == "preflight":
                from .card_check import preflight_command

                return preflight_command(cfg, as_json=args.json)
            from .launch import launch

            return launch(cfg, path, resume=resume, resumed_run=args.resume if resume is not None else None)
        if args.command == "plan":
            from . import mindformers_plan
            from .preflight import LaunchRefused
            from .spec import RUN_DIR, rank_specs

            cfg, path = load_config(args.config, args.overrides)
            mindformers_plan.resolve_paths(cfg, path)
            try:
                mf = mindformers_plan.plan_view(cfg, RUN_DIR)
            except LaunchRefused as exc:
                print(f"mindpulse: {exc}", file=sys.stderr)
                return int(ExitCode.USAGE)
            specs = rank_specs(cfg)
            if args.json:
                print(json.dumps([dict(sp.to_dict(), **({"mindformers": mf} if mf else {})) for sp in specs],
                                 indent=2))
            else:
                _print_plan(cfg, specs)
                if mf is not None:
                    _print_mindformers(mf, cfg.world.world_size)
            return 0
        if args.command == "report":
            from mindpulse.views.report import build_report, final_tables, load_run

            from .progress import printable

            if not (args.run_dir / "metrics.msgpack").exists():
                print(f"mindpulse: {args.run_dir} has no metrics.msgpack; is it a run directory?", file=sys.stderr)
                return int(ExitCode.USAGE)
            data = load_run(args.run_dir)  # read once, for the report and the tables
            rep = build_report(args.run_dir, args.out, data=data)
            print(printable(final_tables(data)))  # ranks' text made printable, as on the live console
            print(f"report: {rep['html']}")
            return 0
        if args.command == "top":
            from mindpulse.views.top import main_top

            return main_top(args.run_dir, root=args.root, interval=args.interval, once=args.once, page=args.page)
        if args.command == "rules":
            from .rules_cmd import run as run_rules

            return run_rules(args)
        if args.command == "telemetry":
            return _telemetry(args)
        if args.command == "pretrain":
            from .doors import pretrain_recipe_base

            res, out = pretrain_recipe_base(args.out, steps=args.steps, batch_size=args.batch_size, lr=args.lr)
            print(json.dumps(dict(res, out=str(out))))
            return 0
    except ConfigError as exc:
        print(f"mindpulse: config error: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    except KeyboardInterrupt:
        return int(ExitCode.INTERRUPTED)
    return int(ExitCode.USAGE)


def _print_mindformers(mf: dict, world_size: int) -> None:
    import yaml

    print(f"\nMindFormers config of every rank (ranks 0-{world_size - 1}: the same; MindFormers adds rank_<r>/ "
          f"under output_dir and under its log folder, and fills in its own defaults), from {mf['yaml']}:")
    print(yaml.safe_dump(mf["values"], sort_keys=False, default_flow_style=None).rstrip())
    if mf.get("source"):
        print(f"MindFormers is imported from the source tree {mf['source']} (job.mindformers.source), ahead of "
              "any installed MindFormers")


def _print_plan(cfg: RunConfig, specs: list[RankSpec]) -> None:
    from tabulate import tabulate

    from mindpulse.config import Backend

    from .spec import RUN_DIR, SCHEDULER_MODULE, scheduler_env, settings_path_of

    print(f"{cfg.name}: backend {cfg.backend.value}, {cfg.world.nodes} node(s) x {cfg.world.ranks_per_node} "
          f"{cfg.world.device.value} rank(s)")
    rows = [[s.node, s.rank, s.local_rank, s.device_id, s.env.get("DEVICE_ID"),
             s.env.get("ASCEND_RT_VISIBLE_DEVICES") or s.env.get("CUDA_VISIBLE_DEVICES") or "-"] for s in specs]
    print(tabulate(rows, headers=["node", "rank", "local", "card", "DEVICE_ID", "visible"], tablefmt="simple"))
    shown = set()
    for s in specs:
        cmd = " ".join(s.command)
        if cmd in shown:
            continue
        shown.add(cmd)
        print(f"\nnode {s.node}: {cmd}")
    common = {k: v for k, v in specs[0].env.items() if all(sp.env.get(k) == v for sp in specs)}
    print("\nenvironment of every rank:")
    for k, v in sorted(common.items()):
        print(f"  {k}={v}")
    print("per rank: " + ", ".join(sorted(k for k in specs[0].env if k not in common)))
    if cfg.backend is Backend.RAY:
        # msrun starts its own scheduler; the ray backend's runs in node 0's agent
        sched = scheduler_env(cfg)
        print(f"\nscheduler (node 0's agent): python -m {SCHEDULER_MODULE}")
        for k, v in sorted(sched.items()):
            print(f"  {k}={v}")
    print(f"\n{RUN_DIR}: the run directory (made at launch); {settings_path_of(RUN_DIR)} holds the "
          "settings every rank reads")


def _telemetry(args) -> int:
    if args.telemetry_command == "parse-npu-smi":
        from mindpulse.reporting.tables import card_table

        from .doors import read_npu_smi_listing

        try:
            data = args.file.read_bytes()
        except OSError as exc:
            print(f"mindpulse: cannot read {args.file}: {exc}", file=sys.stderr)
            return int(ExitCode.USAGE)
        fields, records, warnings = read_npu_smi_listing(data.decode("utf-8", errors="replace"))
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
        if args.json:
            print(json.dumps(fields, indent=2))
        else:
            # what mindpulse reports from this listing, in the card table every view prints
            # (--json: every field the parser read)
            print(card_table([dict(c, node=args.file.name) for c in records]))
        return 0
    from .doors import NoTelemetry, sample_this_machine

    try:
        sample = sample_this_machine(args.device)
    except NoTelemetry as exc:
        print(f"mindpulse: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    if args.json:
        print(json.dumps(sample, indent=2, default=str))
    else:
        from mindpulse.reporting.tables import card_table

        print(f"source: {sample.get('source')}  node: {sample.get('node')}")
        print(card_table(sample.get("cards", [])))
        for w in sample.get("warnings", []):
            print(f"warning: {w}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
