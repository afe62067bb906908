"""The launcher → rank contract: the `RankSettings` a rank receives, once per attempt, in
`RUN_DIR/job.json` (its path in `MINDPULSE_SETTINGS`), with the `Schedule` of its special
steps and its monitor, checkpoint, profile and resume settings.

`launcher/spec.py` builds them from the run's config (`mindpulse.config` derives the
schedule and monitor settings); ranks read them through `workers/settings.py` and nothing
else of mindpulse's. The launcher's contracts with the aggregator and the node agents are
`mindpulse/config/settings.py`'s (that module reads the config, which reads these types: they
stay apart so that neither imports the other).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass
from typing import Any

SETTINGS_ENV = "MINDPULSE_SETTINGS"
"""The one variable a rank reads: the path of the run's `job.json` (a `RankSettings`)."""
NODE_RANK_ENV = "MINDPULSE_NODE_RANK"
"""msrun backend only: which node's msrun started this process (its scheduler runs on node 0)."""


@dataclass(frozen=True)
class Schedule:
    """The run's special steps, computed once by the launcher from the config. The rank
    asks it which steps are decision points; the aggregator which are best candidates."""

    total_steps: int
    """train.steps (0: the recipe's epochs decide)."""
    collect_freq: int
    """Fingerprint and weight statistics every N steps (and step 0)."""
    max_lag_steps: int
    """A rank starts step k once step k-1-max_lag_steps is reduced (the lease)."""
    save_every: int
    """Periodic checkpoint every N steps (0: none)."""
    best_every: int
    """A new best is considered every N steps."""
    save_best: bool
    """Whether a best checkpoint is kept at all (checkpoint.save_best_ckpt)."""
    eval_every: int
    """Evaluation every N steps (0: off)."""
    eval_per_epoch: bool
    """Evaluation at the end of every epoch too."""

    def is_collect(self, step: int) -> bool:
        return step % self.collect_freq == 0

    def eval_due(self, step: int, epoch_steps: int | None = None) -> bool:
        if self.eval_every and step % self.eval_every == 0:
            return True
        return bool(self.eval_per_epoch and epoch_steps and step % epoch_steps == 0)

    def is_candidate(self, step: int, evaluates: bool = False, epoch_steps: int | None = None) -> bool:
        """Whether rank 0 asks for the directive of `step` (it waits for it only where it cannot
        copy the weights and train on: workers/session.py `_decide_later`): a checkpoint
        may be asked for (periodic, best candidate, evaluation, the last step), and it must
        hold exactly that step's weights. No other rank ever waits for a directive."""
        return bool(step > 0 and (
            self.is_save_step(step)
            or (self.save_best and step % self.best_every == 0)
            or (evaluates and self.eval_due(step, epoch_steps))
            or (self.total_steps and step >= self.total_steps)
        ))

    def lease_need(self, step: int) -> int:
        """The step that must be reduced before a rank starts `step` + 1."""
        return step - self.max_lag_steps

    def is_save_step(self, step: int) -> bool:
        return periodic_due(step, self.save_every)


def periodic_due(step: int, every: int) -> bool:
    """Whether `step` is a periodic checkpoint step for `save_checkpoint_steps` = `every`
    (0: none): the one rule for the rank (its `Schedule`: rank 0 waits for the verdict)
    and the aggregator (its config: it asks for the save)."""
    return bool(every and step > 0 and step % every == 0)



@dataclass(frozen=True)
class MonitorSettings:
    decision_timeout_s: float
    """How long a rank waits for a directive before it goes on without one."""
    heartbeat_s: float
    """Interval of the rank's heartbeat thread."""
    weight_stats: bool
    histogram_regex: str
    """Empty: the monitor's default layers."""


@dataclass(frozen=True)
class CheckpointSettings:
    keep_periodic: int
    keep_best: int
    format: str


@dataclass(frozen=True)
class ProfileSettings:
    steps: tuple[int, ...]
    """(START, END) or empty (off)."""
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class ResumePoint:
    path: str
    """The checkpoint to load ("" after a rollback to the start: fresh weights)."""
    step: int
    epoch: int = 0
    kind: str = ""
    skip_batches: int = 0
    """Batches the data stream skips past (rollbacks with `skip_batches`): step k trains on
    the batch of step k + skip_batches."""
    lr_factor: float = 1.0
    """The learning rate is multiplied by this for steps step+1 .. lr_until_step (a rollback)."""
    lr_until_step: int = 0

    def scaled_lrs(self, lrs: list[float]) -> list[float]:
        """A per-step learning-rate list (entry i for step i+1) with the rollback's factor
        applied to steps step+1 .. lr_until_step. The recipe builds its optimizer from it; a
        script with its own schedule can do the same (`load_settings().resume`)."""
        out = list(lrs)
        for i in range(max(0, self.step), min(len(out), self.lr_until_step)):
            out[i] *= self.lr_factor
        return out


@dataclass(frozen=True)
class RankSettings:
    """Everything a rank needs from the launcher, written once per attempt into
    `RUN_DIR/job.json` and handed over by one path (`MINDPULSE_SETTINGS`); ranks read
    nothing else of mindpulse's (MindSpore's own cluster variables aside)."""

    run_id: str
    run_dir: str
    attempt: int
    namespace: str
    aggregator: str
    """The aggregator actor's name (ranks talk to it through their node's relay)."""
    ray_address: str
    world_size: int
    ranks_per_node: int
    device_target: str
    """MindSpore's device_target: CPU, Ascend or GPU."""
    relays: dict[int, str]
    """Node → host:port of its agent's packet relay (empty: ranks call the aggregator)."""
    batch_size: int
    schedule: Schedule
    monitor: MonitorSettings
    checkpoint: CheckpointSettings
    profile: ProfileSettings
    faults: tuple[str, ...]
    """KIND@RANK:STEP specs armed in this attempt."""
    resume: ResumePoint | None
    config: dict[str, Any]
    """The resolved run config (plain data: the recipe reads it with `mindpulse.config`)."""
    relay_token: str = ""
    """This attempt's secret: a rank's first frame to its relay carries it, and the relay
    drops connections without it (job.json is private to the run's user)."""
    task: str = "train"
    """What the ranks run: `train` (the recipe or the job's script) or `card_check` (the
    pre-flight card check only, then exit)."""

    def node_of(self, rank: int) -> int:
        return rank // max(1, self.ranks_per_node)

    def relay_of(self, rank: int) -> str:
        return self.relays.get(self.node_of(rank), "")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["relays"] = {str(k): v for k, v in self.relays.items()}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=_json_enum) + "\n"

    @staticmethod
    def from_dict(d: dict[str, Any]) -> RankSettings:
        try:
            return RankSettings(
                **{k: v for k, v in d.items() if k not in _NESTED},
                relays={int(k): str(v) for k, v in (d.get("relays") or {}).items()},
                schedule=Schedule(**d["schedule"]),
                monitor=MonitorSettings(**d["monitor"]),
                checkpoint=CheckpointSettings(**d["checkpoint"]),
                profile=ProfileSettings(steps=tuple(d["profile"]["steps"]), ranks=tuple(d["profile"]["ranks"])),
                faults=tuple(d.get("faults") or ()),
                resume=ResumePoint(**d["resume"]) if d.get("resume") else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a mindpulse job.json of this version ({type(exc).__name__}: {exc})") from None

    @staticmethod
    def from_json(text: str) -> RankSettings:
        return RankSettings.from_dict(json.loads(text))


_NESTED = frozenset({"relays", "schedule", "monitor", "checkpoint", "profile", "faults", "resume"})


def _json_enum(x: Any) -> Any:
    if isinstance(x, enum.Enum):
        return x.value
    raise TypeError(f"{type(x).__name__} is not JSON")
