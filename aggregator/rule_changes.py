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

The aggregator looks for requests at most every `SCAN_EVERY_S` (when it reduces a step or
the launcher polls it; never per packet), claims each by renaming it to `<id>.json.taken`
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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mindpulse.baselines import Baseline
from mindpulse.config import AnomalyRuleConfig, ConfigError, RunConfig, check_rule, resolve_rule
from mindpulse.rundir_io import write_atomic, write_json_atomic
from mindpulse.settings import AggregatorSettings

from .policies import RULES, Rule, RuleInput, build_rules, plain_rule

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
_REQUEST_NAME = re.compile(r"^(\d{20}-\d{1,10}-[0-9a-f]{6})\.json(\.taken)?$")
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
    known = kind in RULES
    return [f for f in FIELD_DEFAULTS
            if f != "rule" and (not known or f in _ALWAYS or f not in KIND_FIELDS or kind in KIND_FIELDS[f])]


def full_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A rule's config with every field of `AnomalyRuleConfig` (plain values)."""
    out = dict(FIELD_DEFAULTS)
    out.update({k: _plain(v) for k, v in cfg.items()})
    return out


def rule_name(cfg: dict[str, Any], kinds: dict[str, type[Rule]] | None = None) -> str:
    """The name a rule built from `cfg` goes by (a threshold rule without one: `loss>5`)."""
    cls = (kinds or RULES).get(cfg.get("rule"))
    if cls is not None:
        try:
            return cls(cfg).name
        except Exception:  # a config the rule refuses still has a name: the config's own
            pass
    return str(cfg.get("name") or cfg.get("rule"))


@dataclass
class Entry:
    """One rule of the job: its resolved config, its name, and (in the aggregator) the live rule."""

    cfg: dict[str, Any]
    name: str
    rule: Any = None
    """The live `Rule` (None while disabled, or until it is built)."""
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


def entries_of(rules: list[Rule], anomalies: Sequence[RuleInput] | None = None,
               straggler_threshold: float | None = None,
               kinds: dict[str, type[Rule]] | None = None) -> list[Entry]:
    """The job's rules as entries: the built ones in their order, then the config's entries
    that are turned off (`set NAME.enabled=true` turns them on)."""
    out = [Entry(full_config(r.cfg), r.name, r) for r in rules]
    for c in anomalies or []:
        plain = plain_rule(c)
        if plain.get("enabled", True) is False:
            cfg = full_config(resolve_rule(plain, straggler_threshold))
            out.append(Entry(cfg, rule_name(cfg, kinds)))
    return out


def entries_from_config(cfg: RunConfig) -> list[Entry]:
    """What the aggregator starts with for this config (before any change)."""
    st = cfg.monitor.straggler_threshold
    return entries_of(build_rules(cfg.anomalies, straggler_threshold=st), cfg.anomalies, st)


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
         kinds: dict[str, type[Rule]] | None = None) -> tuple[list[Entry], list[dict[str, Any]]]:
    """The rules after `req`, and one record per field it changes (`op`, `rule`, `field`,
    `old`, `new`); raises ConfigError naming `RULE.FIELD` and leaves `entries` as they were.
    Values are checked as a config's are (`check_rule`, with the run's metrics)."""
    kinds = kinds or RULES
    out = [Entry(dict(e.cfg), e.name, e.rule) for e in entries]
    refs = refs_of(entries)
    op = req.get("op")
    records: list[dict[str, Any]] = []

    def check(cfg: dict[str, Any], path: str) -> dict[str, Any]:
        if cfg.get("rule") not in kinds:
            raise ConfigError(f"{path}.rule: {cfg.get('rule')!r} is not allowed; use one of " + ", ".join(kinds))
        if cfg.get("rule") in RULES:
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


def _read_request(path: Path) -> dict[str, Any]:
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


# ---- the aggregator's side -----------------------------------------------------------------


class LiveRules:
    """The aggregator's rules as changed while the job runs: the policy engine's list is
    replaced in place, between steps."""

    def __init__(self, run_dir: Path, engine: Any, settings: AggregatorSettings, *,
                 next_step: Callable[[], int], say: Callable[[str], None],
                 milestone: Callable[[str, int], None] | None = None, replay: bool = False):
        self.run_dir = Path(run_dir)
        self.engine = engine
        self.settings = settings
        self.st = settings.config.monitor.straggler_threshold
        self.next_step = next_step
        self.say = say
        self.milestone = milestone
        self.attempt = settings.attempt
        self.kinds: dict[str, type[Rule]] = dict(RULES, **settings.extra_rules)
        self.entries = entries_of(list(engine.rules), settings.config.anomalies, self.st, self.kinds)
        self._run_cfg: RunConfig | None = None
        self._last_scan = 0.0
        state = read_state(self.run_dir) or {}
        self.changes: list[dict[str, Any]] = [c for c in state.get("changes") or [] if isinstance(c, dict)]
        self.applied: list[dict[str, Any]] = [a for a in state.get("applied") or [] if isinstance(a, dict)]
        self.rejected: list[dict[str, Any]] = [r for r in state.get("rejected") or [] if isinstance(r, dict)]
        self._replay_queue: deque[dict[str, Any]] = deque()
        self._unwritten = replay
        for req in self.applied:
            if replay and req.get("attempt") == self.attempt:
                self._replay_queue.append(req)  # at the step it applied from, as metrics.msgpack replays
            else:
                self._apply_again(req)
        if self.applied and not replay:
            self.say(f"rules: the {len(self.applied)} change(s) made while the job ran still apply "
                     f"(mindpulse rules {self.run_dir})")
        if not replay:
            self.write()

    # -- run config (the metrics a threshold rule may name) --
    def run_cfg(self) -> RunConfig | None:
        if self._run_cfg is None:
            from mindpulse.config import from_dict

            try:
                self._run_cfg = from_dict(yaml.safe_load(self.settings.config_yaml))
            except Exception:  # an unreadable stored YAML: fall back to the launcher's parsed config
                self._run_cfg = self.settings.config
        return self._run_cfg

    # -- applying --
    def _build(self, entries: list[Entry]) -> None:
        """Build the changed rules (a rule that cannot be built refuses the request)."""
        for e in entries:
            if e.enabled and e.rule is None:
                cls = self.kinds[e.kind]
                rule = cls(dict(e.cfg))
                if e.prev is not None:  # the rolling windows (baselines) carry over
                    for attr, val in vars(e.prev).items():
                        mine = getattr(rule, attr, None)
                        if isinstance(val, deque) and isinstance(mine, deque):
                            mine.extend(val)
                        elif isinstance(val, Baseline) and isinstance(mine, Baseline):
                            mine.carry(val)
                e.rule = rule
            e.prev = None

    def _commit(self, entries: list[Entry]) -> None:
        self.entries = entries
        self.engine.rules[:] = [e.rule for e in entries if e.enabled and e.rule is not None]

    def _plan(self, req: dict[str, Any]) -> tuple[list[Entry], list[dict[str, Any]]]:
        new, records = plan(self.entries, req, self.run_cfg(), self.st, self.kinds)
        self._build(new)
        return new, records

    def _apply_again(self, req: dict[str, Any]) -> None:
        """A change applied before (an earlier attempt, or before a restart), re-applied silently."""
        try:
            new, _ = self._plan(req)
        except Exception as exc:  # a change that no longer applies is said, the rules stand as they are
            self.say(f"rules: WARNING the change {req.get('command')!r} could not be applied again: {exc}")
            return
        self._commit(new)

    def before_step(self, step: int, replaying: bool = False) -> None:
        """Called before the rules judge reduced step `step`."""
        if replaying:
            while self._replay_queue and int(self._replay_queue[0].get("step") or 0) <= step:
                self._apply_again(self._replay_queue.popleft())
            return
        self.tick(step)

    def tick(self, step: int | None = None) -> None:
        """Pick up requests (at most every SCAN_EVERY_S); they apply from `step` (default:
        the next step to be reduced)."""
        if self._unwritten:  # a restarted aggregator's replay is over
            while self._replay_queue:
                self._apply_again(self._replay_queue.popleft())
            self._unwritten = False
            self.write()
        now = time.monotonic()
        if now - self._last_scan < SCAN_EVERY_S:
            return
        self._last_scan = now
        try:
            names = sorted(os.listdir(self.run_dir / REQUESTS_DIR))
        except OSError:
            return
        if not names:
            return
        self._scan(names, self.next_step() if step is None else step)

    def _scan(self, names: list[str], step: int) -> None:
        folder = self.run_dir / REQUESTS_DIR
        done = {str(a.get("id")) for a in self.applied} | {str(r.get("id")) for r in self.rejected}
        taken: list[tuple[str, Path]] = []
        for name in names:
            m = _REQUEST_NAME.match(name)
            if not m:
                continue
            rid, path = m.group(1), folder / name
            if not m.group(2):
                claimed = folder / (name + ".taken")
                try:
                    os.rename(path, claimed)  # the client withdrew it, or it is ours now
                except OSError:
                    continue
                path = claimed
            if rid in done:  # applied before a crash could delete it
                _unlink(path)
                continue
            if any(t[0] == rid for t in taken):
                continue
            taken.append((rid, path))
            if len(taken) >= MAX_PER_SCAN:
                break
        if not taken:
            return
        for rid, path in taken:
            self._handle(rid, path, step)
        self.write()
        for _, path in taken:
            _unlink(path)

    def _handle(self, rid: str, path: Path, step: int) -> None:
        now = time.time()
        command = "?"
        try:
            req = _read_request(path)
            command = str(req.get("command") or req.get("op"))[:500]
            if len(self.applied) >= MAX_CHANGES:
                raise ConfigError(f"this run has applied {MAX_CHANGES} rule changes, the most one run takes")
            new, records = self._plan(req)
        except Exception as exc:  # any refused change is recorded and answered, the running rules stay
            why = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
            self.rejected.append({"id": rid, "time": now, "step": step, "command": command, "error": why[:1000]})
            del self.rejected[:-KEEP_REJECTED]
            self.say(f"RULE CHANGE refused at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))} "
                     f"(`mindpulse rules ... {command}`): {why}")
            return
        self._commit(new)
        req = {k: req[k] for k in ("op", "set", "entry", "rule", "command") if k in req}
        self.applied.append(dict(req, id=rid, step=step, attempt=self.attempt, time=now))
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        for rec in records:
            full = {"time": now, "step": step, "attempt": self.attempt, "op": rec["op"], "command": command,
                    "rule": rec["rule"], "field": rec["field"], "old": rec["old"], "new": rec["new"],
                    "request": rid}
            if rec.get("renamed"):
                full["renamed"] = rec["renamed"]
            self.changes.append(full)
            text = f"RULE CHANGE at {when}, from step {step} on: {describe(rec)}"
            self.say(text)
            if self.milestone is not None:
                self.milestone(text, step)

    # -- rules.json --
    def listing(self) -> list[dict[str, Any]]:
        return [{"ref": ref, "name": e.name, "rule": e.kind, "enabled": e.enabled, "action": e.cfg.get("action"),
                 "fields": e.shown(), "config": e.cfg} for ref, e in zip(refs_of(self.entries), self.entries)]

    def write(self) -> None:
        state = {"version": 1, "updated": time.time(), "attempt": self.attempt,
                 "reduced_through": self.next_step() - 1, "rules": self.listing(), "changes": self.changes,
                 "applied": self.applied, "rejected": self.rejected}
        try:
            write_json_atomic(self.run_dir / STATE_FILE, state)
        except OSError as exc:
            self.say(f"rules: WARNING could not write {STATE_FILE}: {exc}")


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
