"""The driver's doors to code that runs elsewhere: the one module of the driver that imports
aggregator, node agent or rank code (the import contracts in pyproject.toml allow it this
module and no other). Two kinds of door, each named for what passes through it:

- Ray needs an actor's class (or the function that creates it) to start it; the actor's code
  then runs in its own process: the aggregator (`start_aggregator`), the node agents
  (`node_agent_class`), the ranks (`rank_actor_class`).
- two commands run another place's code on this machine, on purpose: `mindpulse telemetry`
  reads this machine's cards (or a saved npu-smi listing) as a node agent does
  (`sample_this_machine`, `read_npu_smi_listing`), and `mindpulse pretrain` builds the
  recipe's base weights with MindSpore, as a rank would (`pretrain_recipe_base`).

Every import is inside its function: importing the driver loads none of that code, and no
MindSpore (tests/unit/test_imports.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mindpulse.common.errors import MindpulseError


class NoTelemetry(MindpulseError, RuntimeError):
    """This machine has no telemetry source for the device asked for; the message says why
    (the node's `TelemetryUnavailable`, as the driver sees it)."""


# ---- the actors Ray starts ----------------------------------------------------------------


def start_aggregator(*args: Any, **kwargs: Any) -> Any:
    """Start the run's aggregator actor (`aggregator/core.py`'s `start_aggregator`: the same
    arguments); returns its handle."""
    from mindpulse.aggregator import core

    return core.start_aggregator(*args, **kwargs)


def aggregator_actor_name(run_id: str) -> str:
    """The name the run's aggregator actor is registered under (ranks and tools find it by it)."""
    from mindpulse.aggregator import core

    return core.actor_name(run_id)


def node_agent_class() -> type:
    """The node agent's actor class (`node/agent.py`), for `ray.remote`."""
    from mindpulse.node.agent import NodeAgent

    return NodeAgent


def rank_actor_class() -> type:
    """The rank's actor class (`workers/rank_actor.py`), for `ray.remote`."""
    from mindpulse.workers.rank_actor import RankActor

    return RankActor


# ---- another place's code, run here by a command --------------------------------------------


def sample_this_machine(device: str) -> dict[str, Any]:
    """One telemetry sample of this machine's cards, as a node agent takes it; raises
    `NoTelemetry` saying what is missing."""
    from mindpulse.node.telemetry import TelemetryUnavailable
    from mindpulse.node.telemetry import sample_this_machine as sample

    try:
        return sample(device)
    except TelemetryUnavailable as exc:
        raise NoTelemetry(str(exc)) from None


def read_npu_smi_listing(text: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """A saved `npu-smi info` listing read as a node agent reads it: every field the parser
    read per card, the card records mindpulse reports from it, and the parser's warnings."""
    from mindpulse.node.npu_smi import parse_npu_smi
    from mindpulse.node.samplers.npu_smi import records_of_listing

    res = parse_npu_smi(text)
    return [c.to_dict() for c in res.cards], records_of_listing(res.cards), list(res.warnings)


def pretrain_recipe_base(out: Path | None, **kwargs: Any) -> tuple[dict[str, Any], Path]:
    """Build the recipe's base checkpoint with MindSpore in this process (`mindpulse pretrain`),
    at `out` (default: where the recipe looks for it); returns its numbers and its path."""
    from mindpulse.workers.recipes import llama_finetune

    path = Path(out) if out else llama_finetune.BASE_CKPT
    return dict(llama_finetune.pretrain(path, **kwargs)), path
