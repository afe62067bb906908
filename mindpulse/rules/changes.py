"""Anomaly rules changed on a running job (`mindpulse rules RUN_DIR set|add|disable`).

Two kinds of file in the run directory carry it:

* `rule_requests/<id>.json`: one change request, written atomically by `mindpulse rules`
  (whoever may write the run directory may ask). `<id>` is the request time in
  nanoseconds, the writer's pid and a random tag, so names sort in the order requests were
  made.
* `rules.json`: written by the aggregator (atomically) when it starts and whenever the set
  of rules changes: the rules in force (`rules`), every change applied (`changes`, the
  records `summary.json` lists as `rule_changes`), the requests behind them (`applied`,
  what a restarted aggregator re-applies) and the requests refused (`rejected`).

This module is the driver's side and the files' format: the checks (`plan`), with the
rules named and chosen from their configs alone (`configs.py`), so `mindpulse rules` and the
summary run none of the aggregator's code. The aggregator (`LiveRules`,
aggregator/live_rules.py) looks for requests at most every `SCAN_EVERY_S` (when it reduces a
step or the launcher polls it; never per packet), claims each by renaming it to `<id>.json.taken`
(so a client that gives up can withdraw a request nobody took, and nothing is applied
twice), checks it exactly as the config's `anomalies` entries are checked
(`mindpulse.config.check_rule`), applies it from the next reduced step, writes
`rules.json` and deletes the request. A changed rule keeps its rolling windows (the
loss_spike and grad_explosion baselines) and starts its counters afresh.

A restarted aggregator (Ray restarts it; it replays metrics.msgpack) re-applies its
attempt's changes at the steps they applied from while it replays, so the rules' state is
what it was; a later attempt (max_restarts, rollbacks) starts with every change made.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
import secrets
import shlex
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mindpulse.config import AnomalyRuleConfig, ConfigError, RunConfig, check_rule, resolve_rule
from mindpulse.rules.configs import BUILT_IN_KINDS, RuleInput, chosen_configs, name_of, plain_rule, rule_config
from mindpulse.rundir.rundir_io import write_atomic

REQUESTS_DIR = "rule_requests"
STATE_FILE = "rules.json"
OPS = ("set", "add", "disable")
SCAN_EVERY_S = 0.5
"""The aggregator lists `rule_requests/` at most this often."""
MAX_REQUEST_BYTES = 64 * 1024
MAX_PER_SCAN = 32
MAX_CHANGES = 1000
"""Requests one run may apply: each is kept (and re-applied by a restarted aggregator)."""
KEEP_REJECTED = 100
REQUEST_NAME = re.compile(r"^(\d{20}-\d{1,10}-[0-9a-f]{6})\.json(\.taken)?$")
_ASSIGNMENT = re.compile(r"^(.+?)\.([A-Za-z_]+)=(.*)$", re.S)
_OP_VALUES = (">", ">=", "<", "<=")

KIND_FIELDS: dict[str, tuple[str, ...]] = {
    "metric": ("threshold", "card_overload"),
    "op": ("threshold",),
    "threshold": ("threshold", "card_overload", "grad_explosion", "straggler"),
    "for_steps": ("threshold", "compute_drop"),
    "factor": ("grad_explosion", "compute_drop"),
    "z": ("loss_spike",),
    "window": ("grad_explosion", "loss_spike"),
    "warmup": ("grad_explosion", "loss_spike"),
    "patience": ("loss_spike", "straggler"),
    "for_s": ("card_overload",),
    "tolerance": ("desync",),
}
"""The fields only some kinds of rule read (the others, `action`, `enabled`, `name` and any
field not listed here, belong to every rule). `set` refuses a field its rule does not read."""
_ALWAYS = ("action", "enabled", "name")


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


FIELD_DEFAULTS: dict[str, Any] = {f.name: _plain(f.default) for f in dataclasses.fields(AnomalyRuleConfig)}


def fields_of(kind: str) -> list[str]:
    """The fields a rule of `kind` reads, in the config's order (every field for a kind
    mindpulse does not know)."""
    known = kind in BUILT_IN_KINDS
    return [f for f in FIELD_DEFAULTS
            if f != "rule" and (not known or f in _ALWAYS or f not in KIND_FIELDS or kind in KIND_FIELDS[f])]


def full_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A rule's config with every field of `AnomalyRuleConfig` (plain values)."""
    out = dict(FIELD_DEFAULTS)
    out.update({k: _plain(v) for k, v in cfg.items()})
    return out


def rule_name(cfg: dict[str, Any], kinds: Mapping[str, Any] | None = None) -> str:
    """The name a rule built from `cfg` goes by (a threshold rule without one: `loss>5`);
    `kinds`: the classes of the aggregator's extra kinds of rule, which name their own rules."""
    kind = cfg.get("rule")
    try:
        if kind in BUILT_IN_KINDS:
            return name_of(rule_config(cfg, kind), kind)
        cls = (kinds or {}).get(kind)
        if cls is not None:
            return str(cls(cfg).name)
    except Exception:  # a config the rule refuses still has a name: the config's own
        pass
    return str(cfg.get("name") or cfg.get("rule"))


@dataclass
class Entry:
    """One rule of the job: its resolved config, its name, and (in the aggregator) the live rule."""

    cfg: dict[str, Any]
    name: str
    rule: Any = None
    """The aggregator's live rule (None while disabled, until it is built, and in the driver)."""
    prev: Any = None
    """The rule it replaces: its rolling windows carry over."""

    @property
    def enabled(self) -> bool:
        return self.cfg.get("enabled", True) is not False

    @property
    def kind(self) -> str:
        return str(self.cfg.get("rule"))

    def shown(self) -> dict[str, Any]:
        """The fields worth showing: the ones its kind reads (a field every rule has only
        when it differs from the default)."""
        out: dict[str, Any] = {}
        for f in fields_of(self.kind):
            if f in ("enabled", "name", "action"):
                continue
            if f in KIND_FIELDS or self.cfg.get(f) != FIELD_DEFAULTS.get(f):
                out[f] = self.cfg.get(f)
        return out


def entries_of(rules: Sequence[Any], anomalies: Sequence[RuleInput] | None = None,
               straggler_threshold: float | None = None,
               kinds: Mapping[str, Any] | None = None) -> list[Entry]:
    """The job's rules as entries: the built ones in their order (each has its plain `cfg`
    and its `name`: the aggregator's live rules, or `Configured`), then the config's entries
    that are turned off (`set NAME.enabled=true` turns them on)."""
    out = [Entry(full_config(r.cfg), r.name, None if isinstance(r, Configured) else r) for r in rules]
    for c in anomalies or []:
        plain = plain_rule(c)
        if plain.get("enabled", True) is False:
            cfg = full_config(resolve_rule(plain, straggler_threshold))
            out.append(Entry(cfg, rule_name(cfg, kinds)))
    return out


@dataclass(frozen=True)
class Configured:
    """A rule of the job as its config gives it (what the aggregator builds from it, without
    building it): its plain config, its kind in `rule`, and its name."""

    cfg: dict[str, Any]
    name: str


def configured_rules(anomalies: Sequence[RuleInput], straggler_threshold: float | None = None) -> list[Configured]:
    """The built-in rules the aggregator starts with for these `anomalies` entries, in its
    order (`chosen_configs`, as `aggregator/policies.py`'s `build_rules` builds them)."""
    out = []
    for c in chosen_configs(anomalies):
        typed = rule_config(c, c["rule"], straggler_threshold)
        out.append(Configured(dict(plain_rule(typed), rule=c["rule"]), name_of(typed, c["rule"])))
    return out


def entries_from_config(cfg: RunConfig) -> list[Entry]:
    """What the aggregator starts with for this config (before any change)."""
    st = cfg.monitor.straggler_threshold
    return entries_of(configured_rules(cfg.anomalies, st), cfg.anomalies, st)


def refs_of(entries: list[Entry]) -> list[str]:
    """How each rule is named on the command line: its name, or `NAME#K` (the K-th of that
    name, from 1) where several share it."""
    counts: dict[str, int] = {}
    for e in entries:
        counts[e.name] = counts.get(e.name, 0) + 1
    seen: dict[str, int] = {}
    out = []
    for e in entries:
        seen[e.name] = seen.get(e.name, 0) + 1
        out.append(e.name if counts[e.name] == 1 else f"{e.name}#{seen[e.name]}")
    return out


def find(entries: list[Entry], ref: Any) -> int:
    if not isinstance(ref, str) or not ref:
        raise ConfigError(f"{ref!r}: name a rule (as `mindpulse rules RUN_DIR` lists them)")
    refs = refs_of(entries)
    if ref in refs:
        return refs.index(ref)
    same = [r for r, e in zip(refs, entries) if e.name == ref]
    if same:
        raise ConfigError(f"{ref}: {len(same)} rules have that name; use one of " + ", ".join(same))
    raise ConfigError(f"{ref}: no rule of that name; the rules: " + (", ".join(refs) or "none"))


# ---- requests ------------------------------------------------------------------------------


def parse_value(text: str) -> Any:
    """A value as `--set` reads it (YAML), the comparison operators as they are."""
    if text.strip() in _OP_VALUES:
        return text.strip()
    if not text.strip():
        return ""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_assignment(text: str) -> list[Any]:
    """`NAME.FIELD=VALUE` → [NAME, FIELD, value] (NAME may hold dots: `loss>5.5.threshold=3`)."""
    m = _ASSIGNMENT.match(text)
    if not m:
        raise ConfigError(f"set {text!r}: use NAME.FIELD=VALUE, e.g. loss_high.threshold=2.5")
    return [m.group(1), m.group(2), parse_value(m.group(3))]


def request_of(op: str, args: list[str]) -> dict[str, Any]:
    """A request from the command line's words after RUN_DIR."""
    if op not in OPS:
        raise ConfigError(f"{op!r}: use one of " + ", ".join(OPS))
    req: dict[str, Any] = {"v": 1, "op": op, "command": shlex.join([op, *args])}
    if op == "set":
        if not args:
            raise ConfigError("set: give one or more NAME.FIELD=VALUE, e.g. set loss_high.threshold=2.5")
        req["set"] = [parse_assignment(a) for a in args]
    elif op == "add":
        if len(args) != 1:
            raise ConfigError("add: give one rule as YAML, e.g. add '{rule: threshold, name: loss_high, metric: loss, "
                              "threshold: 3.0, action: stop}'")
        try:
            entry = yaml.safe_load(args[0])
        except yaml.YAMLError as exc:
            raise ConfigError(f"add: not valid YAML ({exc})") from None
        if not isinstance(entry, dict):
            raise ConfigError(f"add: {args[0]!r} is not a rule; give a mapping such as "
                              "'{rule: threshold, metric: loss, threshold: 3.0}'")
        req["entry"] = entry
    else:
        if len(args) != 1:
            raise ConfigError("disable: give one rule's name, e.g. disable loss_spike")
        req["rule"] = args[0]
    return req


def plan(entries: list[Entry], req: dict[str, Any], run_cfg: RunConfig | None,
         straggler_threshold: float | None = None,
         kinds: Mapping[str, Any] | None = None) -> tuple[list[Entry], list[dict[str, Any]]]:
    """The rules after `req`, and one record per field it changes (`op`, `rule`, `field`,
    `old`, `new`); raises ConfigError naming `RULE.FIELD` and leaves `entries` as they were.
    Values are checked as a config's are (`check_rule`, with the run's metrics)."""
    allowed = list(BUILT_IN_KINDS) + [k for k in kinds or {} if k not in BUILT_IN_KINDS]
    out = [Entry(dict(e.cfg), e.name, e.rule) for e in entries]
    refs = refs_of(entries)
    op = req.get("op")
    records: list[dict[str, Any]] = []

    def check(cfg: dict[str, Any], path: str) -> dict[str, Any]:
        if cfg.get("rule") not in allowed:
            raise ConfigError(f"{path}.rule: {cfg.get('rule')!r} is not allowed; use one of " + ", ".join(allowed))
        if cfg.get("rule") in BUILT_IN_KINDS:
            cfg = {k: _plain(v) for k, v in dataclasses.asdict(check_rule(cfg, run_cfg, path)).items()}
        return full_config(resolve_rule(cfg, straggler_threshold))

    def name_free(name: str, but: int | None) -> None:
        if any(e.name == name for i, e in enumerate(out) if i != but):
            raise ConfigError(f"{name}: a rule of that name exists already; change it with `set {name}.FIELD=VALUE`, "
                              "or give the new rule another `name`")

    if op == "set":
        items = req.get("set")
        if not isinstance(items, list) or not items:
            raise ConfigError("set: give one or more NAME.FIELD=VALUE")
        touched: list[int] = []
        for item in items:
            if not (isinstance(item, (list, tuple)) and len(item) == 3):
                raise ConfigError(f"set: {item!r} is not NAME.FIELD=VALUE")
            ref, fld, value = item
            i = find(entries, ref)
            kind = entries[i].kind
            if fld == "rule":
                raise ConfigError(f"{ref}.rule: a rule's kind cannot change; disable it and add another")
            if fld not in FIELD_DEFAULTS:
                raise ConfigError(f"{ref}.{fld}: unknown field; a {kind} rule has " + ", ".join(fields_of(kind)))
            if fld not in fields_of(kind):
                raise ConfigError(f"{ref}.{fld}: a {kind} rule does not use {fld}; its fields: "
                                  + ", ".join(fields_of(kind)))
            out[i].cfg[fld] = value
            if i not in touched:
                touched.append(i)
            records.append({"op": "set", "rule": entries[i].name, "field": fld, "old": entries[i].cfg.get(fld),
                            "index": i})
        for i in touched:
            e = out[i]
            e.cfg = check(e.cfg, refs[i])
            e.name = rule_name(e.cfg, kinds)
            if e.name != entries[i].name:
                name_free(e.name, i)
            e.rule, e.prev = None, entries[i].rule
        for rec in records:
            i = rec.pop("index")
            rec["new"] = out[i].cfg.get(rec["field"])
            if out[i].name != entries[i].name:
                rec["renamed"] = out[i].name
    elif op == "add":
        raw = req.get("entry")
        if not isinstance(raw, dict):
            raise ConfigError("add: the rule must be a mapping such as {rule: threshold, metric: loss, threshold: 3}")
        path = str(raw.get("name") or "add")
        cfg = check(dict(raw, rule=raw.get("rule", FIELD_DEFAULTS["rule"])), path)
        e = Entry(cfg, rule_name(cfg, kinds))
        name_free(e.name, None)
        out.append(e)
        records.append({"op": "add", "rule": e.name, "field": None, "old": None,
                        "new": {"rule": e.kind, "action": cfg.get("action"), **e.shown(),
                                **({} if e.enabled else {"enabled": False})}})
    elif op == "disable":
        ref = req.get("rule")
        i = find(entries, ref)
        if not entries[i].enabled:
            raise ConfigError(f"{ref}: already disabled (`set {ref}.enabled=true` turns it on)")
        out[i].cfg["enabled"] = False
        out[i].rule = None
        records.append({"op": "disable", "rule": entries[i].name, "field": "enabled", "old": True, "new": False})
    else:
        raise ConfigError(f"{op!r}: not a rule change; use one of " + ", ".join(OPS))
    return out, records


def describe(rec: dict[str, Any]) -> str:
    """One change as a line: `set loss_high.threshold: 100 -> 0.01`."""
    if rec.get("op") == "add":
        fields = " ".join(f"{k}={v}" for k, v in (rec.get("new") or {}).items())
        return f"add {rec.get('rule')} ({fields})"
    text = f"{rec.get('op')} {rec.get('rule')}.{rec.get('field')}: {rec.get('old')} -> {rec.get('new')}"
    if rec.get("renamed"):
        text += f" (now named {rec['renamed']})"
    return text


# ---- the run directory's files -------------------------------------------------------------


def read_state(run_dir: Path) -> dict[str, Any] | None:
    """rules.json, or None (not written yet, or unreadable)."""
    try:
        data = json.loads((Path(run_dir) / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def changes_in(run_dir: Path) -> list[dict[str, Any]]:
    """The changes applied to a run (rules.json `changes`; [] when there is none)."""
    state = read_state(run_dir) or {}
    changes = state.get("changes")
    return [c for c in changes if isinstance(c, dict)] if isinstance(changes, list) else []


def entries_from_state(state: dict[str, Any]) -> list[Entry]:
    out = []
    for r in state.get("rules") or []:
        if isinstance(r, dict) and isinstance(r.get("config"), dict):
            out.append(Entry(full_config(r["config"]), str(r.get("name") or r["config"].get("rule"))))
    return out


def new_request_id() -> str:
    return f"{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(3)}"


def write_request(run_dir: Path, req: dict[str, Any]) -> Path:
    """Put a request where the aggregator looks (atomically; the folder takes the run
    directory's mode). Returns its path."""
    run_dir = Path(run_dir)
    folder = run_dir / REQUESTS_DIR
    if not folder.is_dir():
        folder.mkdir(exist_ok=True)
        os.chmod(folder, stat.S_IMODE(os.stat(run_dir).st_mode))
    rid = req.setdefault("id", new_request_id())
    req.setdefault("time", time.time())
    req.setdefault("pid", os.getpid())
    path = folder / f"{rid}.json"
    write_atomic(path, (json.dumps(req, allow_nan=False) + "\n").encode())
    return path


def read_request(path: Path) -> dict[str, Any]:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a plain file")
        data = os.read(fd, MAX_REQUEST_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_REQUEST_BYTES:
        raise ValueError(f"larger than {MAX_REQUEST_BYTES} bytes")
    req = json.loads(data)
    if not isinstance(req, dict):
        raise ValueError("not a JSON object")
    return req
