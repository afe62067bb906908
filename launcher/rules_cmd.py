"""`mindpulse rules RUN_DIR [set NAME.FIELD=VALUE ... | add RULE-YAML | disable NAME]`.

Without a change it lists the job's rules (from `RUN_DIR/rules.json`, which the aggregator
keeps current; before it wrote one, from the config). A change is checked here exactly as
the config's rules are (a bad value: exit 2, nothing written), then written to
`RUN_DIR/rule_requests/` for the aggregator, which applies it from the next reduced step;
the command waits for its verdict (`--wait`). Exit codes: 0 applied (or queued with
`--wait 0`), 2 a bad change, refused by the aggregator, or a finished run, 1 no running
aggregator took it in time (withdrawn: nothing changed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from mindpulse.config import ConfigError, RunConfig, from_dict, read_yaml
from mindpulse.rules import changes as rc

from .spec import ExitCode

POLL_S = 0.2
TAKEN_GRACE_S = 10.0
"""How long to wait for the verdict on a request the aggregator took when `--wait` ran out."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("rules", help="list the anomaly rules of a run, or change them on the running job",
                       description="List the anomaly rules of a run, or change them while it runs: "
                                   "set NAME.FIELD=VALUE [...], add RULE-YAML, disable NAME.")
    p.add_argument("run_dir", type=Path, help="the run directory")
    p.add_argument("op", nargs="?", choices=rc.OPS, help="the change (none: list the rules)")
    p.add_argument("args", nargs="*", help="set: NAME.FIELD=VALUE ...; add: the rule as YAML; disable: NAME")
    p.add_argument("--json", action="store_true", help="list the rules (and changes) as JSON")
    p.add_argument("--wait", type=float, default=30.0, metavar="SECONDS",
                   help="how long to wait for the aggregator to apply the change (default 30; 0: queue it "
                        "and return)")


def _err(text: str) -> None:
    print(f"mindpulse rules: {text}", file=sys.stderr)


def _finished(run_dir: Path) -> str | None:
    """The final status of a finished run (it has summary.json), else None."""
    path = run_dir / "summary.json"
    if not path.exists():
        return None
    try:
        return str(json.loads(path.read_text()).get("status") or "finished")
    except (OSError, ValueError, AttributeError):
        return "finished"


def _run_config(run_dir: Path) -> RunConfig:
    try:
        return from_dict(read_yaml(run_dir / "config.yaml"), str(run_dir / "config.yaml"))
    except ConfigError as exc:
        raise ConfigError(f"cannot read the run's config: {exc}") from None


def _entries(run_dir: Path, cfg: RunConfig) -> tuple[list[rc.Entry], dict[str, Any] | None]:
    state = rc.read_state(run_dir)
    if state is not None:
        entries = rc.entries_from_state(state)
        if entries:
            return entries, state
    return rc.entries_from_config(cfg), state


def run(args: argparse.Namespace) -> int:
    run_dir: Path = args.run_dir
    if not (run_dir / "config.yaml").is_file():
        _err(f"{run_dir} is not a run directory (no config.yaml)")
        return int(ExitCode.USAGE)
    try:
        cfg = _run_config(run_dir)
        if args.op is None:
            if args.args:
                raise ConfigError(f"{args.args[0]!r}: use set, add or disable (or nothing, to list the rules)")
            return _list(run_dir, cfg, args.json)
        status = _finished(run_dir)
        if status is not None:
            _err(f"{run_dir} has finished ({status}): the rules of a finished run cannot change (nothing changed); "
                 "a run resumed from it (`mindpulse launch --resume`) takes its rules from the config")
            return int(ExitCode.USAGE)
        entries, _ = _entries(run_dir, cfg)
        req = rc.request_of(args.op, list(args.args))
        _, records = rc.plan(entries, req, cfg, cfg.monitor.straggler_threshold)
    except ConfigError as exc:
        _err(f"{exc} (nothing changed)")
        return int(ExitCode.USAGE)
    path = rc.write_request(run_dir, req)
    if args.wait <= 0:
        for rec in records:
            print(f"mindpulse rules: queued {rc.describe(rec)} (applied from the next reduced step; "
                  f"request {req['id']})")
        return 0
    return _await(run_dir, req["id"], path, args.wait)


def _verdict(run_dir: Path, rid: str) -> tuple[str, Any] | None:
    state = rc.read_state(run_dir)
    if state is None:
        return None
    for a in state.get("applied") or []:
        if isinstance(a, dict) and a.get("id") == rid:
            return "applied", [c for c in state.get("changes") or [] if isinstance(c, dict) and c.get("request") == rid]
    for r in state.get("rejected") or []:
        if isinstance(r, dict) and r.get("id") == rid:
            return "rejected", r
    return None


def _await(run_dir: Path, rid: str, path: Path, wait_s: float) -> int:
    deadline = time.monotonic() + wait_s
    withdrawn = False
    ended = None
    while True:
        verdict = _verdict(run_dir, rid)
        if verdict is not None:
            break
        ended = _finished(run_dir)
        if ended is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
            continue
        try:  # nobody took it: withdraw it (the aggregator claims a request by renaming it first)
            os.unlink(path)
            withdrawn = True
            break
        except FileNotFoundError:  # taken: its verdict is on the way
            if time.monotonic() > deadline + TAKEN_GRACE_S:
                break
            time.sleep(POLL_S)
    if verdict is None:
        if withdrawn and ended is not None:
            _err(f"the run finished ({ended}) before it applied the change; withdrawn, nothing changed")
            return int(ExitCode.USAGE)
        if withdrawn:
            _err(f"no running aggregator took the change within {wait_s:g}s (is the job running?); withdrawn, "
                 "nothing changed")
        else:
            _err(f"the aggregator took the change but gave no verdict yet; see `mindpulse rules {run_dir}`")
        return int(ExitCode.FAILED)
    kind, detail = verdict
    if kind == "rejected":
        _err(f"the aggregator refused the change: {detail.get('error')} (nothing changed)")
        return int(ExitCode.USAGE)
    for c in detail:
        print(f"mindpulse rules: {rc.describe(c)}, from step {c.get('step')} on "
              f"(applied {_when(c.get('time'))})")
    return 0


def _when(ts: Any) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(ts)))
    except (TypeError, ValueError):
        return "?"


def _list(run_dir: Path, cfg: RunConfig, as_json: bool) -> int:
    entries, state = _entries(run_dir, cfg)
    status = _finished(run_dir)
    pending = sorted(p.name for p in (run_dir / rc.REQUESTS_DIR).glob("*.json")) \
        if (run_dir / rc.REQUESTS_DIR).is_dir() else []
    if state is not None and rc.entries_from_state(state):
        source = f"rules.json, {_when(state.get('updated'))}, through step {state.get('reduced_through')}"
    else:
        source = "config.yaml: the aggregator has not written rules.json"
    changes = (state or {}).get("changes") or []
    if as_json:
        rules = [{"ref": ref, "name": e.name, "rule": e.kind, "enabled": e.enabled, "action": e.cfg.get("action"),
                  "fields": e.shown()} for ref, e in zip(rc.refs_of(entries), entries)]
        print(json.dumps({"run_dir": str(run_dir), "status": status or "running", "source": source,
                          "rules": rules, "changes": changes, "rejected": (state or {}).get("rejected") or [],
                          "pending": len(pending)}, indent=2, default=str))
        return 0
    from tabulate import tabulate

    print(f"rules of {run_dir} ({'finished: ' + status if status else 'running'}; from {source})")
    rows = []
    for ref, e in zip(rc.refs_of(entries), entries):
        fields = " ".join(f"{k}={'-' if v is None else v}" for k, v in e.shown().items())
        rows.append([ref, e.kind, e.cfg.get("action"), "yes" if e.enabled else "no", fields])
    print(tabulate(rows, headers=["name", "rule", "action", "enabled", "fields"], tablefmt="simple"))
    if changes:
        print(f"\nchanges ({len(changes)}):")
        for c in changes:
            print(f"  {_when(c.get('time'))}  from step {c.get('step')}  {rc.describe(c)}")
    rejected = (state or {}).get("rejected") or []
    if rejected:
        print(f"\nrefused ({len(rejected)}):")
        for r in rejected[-5:]:
            print(f"  {_when(r.get('time'))}  {r.get('command')}: {r.get('error')}")
    if pending:
        print(f"\n{len(pending)} change request(s) not yet taken by the aggregator")
    return 0
