"""The map of one step's path in docs/architecture.md is the path the code runs.

One process runs every hop with its real code: a MindSpore `Model.train` whose `Monitor`
callback (a `RankSession` over a `RelayChannel`) sends each step to a real `NodeAgent`'s
relay and node pre-reducer over loopback, which streams it over its real `Uplink` to an
`AggregatorActor`'s uplink server in an event loop of its own; the actor settles the step
(intake, reduce, decide, the views: TensorBoard and the console) and pushes the lease down
the stream to the relay, which writes it to the node's lease board the rank reads. Then
the driver's poll: the actor's `poll` and the launcher's `Console.say`, as
`Attempt.poll` does them. A `ModuleTrace` (tests/module_trace.py) records, thread by
thread, the project modules each enters for one steady-state step (step 6 of 8: not the
first, not a collect step or a checkpoint candidate, a step the console prints), and the
test compares them with the list under "The path of one step, as the test traces it" in
docs/architecture.md.

Left out, against a launch: Ray (the actor is the `AggregatorActor` class called in this
process's own event loop, as Ray's async actor would call it, and the node agent resolves
the aggregator's uplink address directly instead of through Ray); the rank's heartbeat and
the card telemetry (their packets go their own way, not per step); the rank's
`RankSettings` (the Monitor runs the config's default schedule: `max_lag_steps` 1).
"""

from __future__ import annotations

import asyncio
import difflib
import io
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from module_trace import ModuleTrace

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
HEADING = "The path of one step, as the test traces it"
TRACED_STEP = 6
STEPS = 8
PRINT_EVERY = 3
TOKEN = "step-path-token"
PLACES = {"mindpulse-relay": "node", "aggregator-loop": "aggregator", "mindpulse-outbox": "outbox"}
"""The threads of the traced step and the place each stands for (the rank's is the thread
that trains: its name is taken when the step's callback runs)."""


def documented_path(text: str) -> tuple[dict[str, dict[str, list[str]]], dict[tuple[str, str], int]]:
    """From the fenced `step-path` block under HEADING: {leg: {place: [module, ...]}}, and
    {(place, module): entries per step} for the lines of the step's legs that give a count
    (`xN` after the module; the driver's poll is no part of the step)."""
    at = text.find("\n## " + HEADING)
    assert at >= 0, f"docs/architecture.md has no section `## {HEADING}`"
    block = re.search(r"```step-path\n(.*?)```", text[at:], re.S)
    assert block, f"no ```step-path block under {HEADING!r} in docs/architecture.md"
    legs: dict[str, dict[str, list[str]]] = {}
    counts: dict[tuple[str, str], int] = {}
    leg = None
    for line in block.group(1).splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line.startswith(" "):
            leg = line.strip().rstrip(":")
            legs[leg] = {}
            continue
        assert leg is not None, f"a module before the first leg in the step-path block: {line!r}"
        words = line.split()
        assert len(words) in (2, 3) and (len(words) == 2 or re.fullmatch(r"x\d+", words[2])), (
            f"a step-path line is `place module [xN]`, not {line.strip()!r}")
        place, module = words[:2]
        legs[leg].setdefault(place, []).append(module)
        if len(words) == 3 and leg != "driver":
            counts[(place, module)] = int(words[2][1:])
    return legs, counts


def by_place(legs: dict[str, dict[str, list[str]]]) -> dict[str, list[str]]:
    """Each place's modules over the step's legs, in the block's order; the driver's poll (its
    leg, whatever thread runs it) is the place `driver`."""
    out: dict[str, list[str]] = {}
    for leg, places in legs.items():
        for place, modules in places.items():
            out.setdefault("driver" if leg == "driver" else place, []).extend(modules)
    return out


def test_documented_block_reads_back():
    legs, _ = documented_path(DOC.read_text())
    assert set(legs) >= {"up", "down", "views", "driver"}, f"the step-path block's legs are {sorted(legs)}"
    for leg, places in legs.items():
        for place, modules in places.items():
            for module in modules:
                assert (ROOT / module).is_file(), f"{leg}/{place}: {module} named in the doc is no file"
    # each place lists a module once: the map is in the order first entered
    for place, modules in by_place(legs).items():
        repeated = sorted({m for m in modules if modules.count(m) > 1})
        assert not repeated, f"{place} lists {repeated} more than once in the step-path block"


def _diff(expected: list[str], traced: list[str]) -> str:
    return "\n".join(difflib.unified_diff(expected, traced, "docs/architecture.md", "traced", lineterm=""))


@pytest.mark.slow
def test_one_step_enters_the_documented_modules(tmp_path, monkeypatch):
    import mindspore as ms
    import ray._private.auto_init_hook
    from mindspore import nn
    from mindspore.dataset import NumpySlicesDataset
    from mindspore.train import Model
    from mindspore.train.callback import Callback

    from mindpulse.aggregator.core import AggregatorActor
    from mindpulse.config.settings import AggregatorSettings, NodeSettings
    from mindpulse.launcher.progress import Console
    from mindpulse.node.agent import NodeAgent
    from mindpulse.workers.channel import RelayChannel
    from mindpulse.workers.monitor import Monitor

    # the actor asks Ray whether it was restarted; outside Ray that question must not start one
    monkeypatch.setattr(ray._private.auto_init_hook, "enable_auto_connect", False)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    names = dict(PLACES)
    trace = ModuleTrace(ROOT)
    trace.install()
    loop = asyncio.new_event_loop()
    agg_thread = threading.Thread(target=loop.run_forever, name="aggregator-loop", daemon=True)
    agent = channel = actor = None
    try:
        agg_thread.start()

        def in_loop(coro: Any, timeout: float = 30.0) -> Any:
            return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

        settings = AggregatorSettings.of({"world": {"ranks_per_node": 1}})
        actor = AggregatorActor(str(tmp_path / "run"), 1, PRINT_EVERY, STEPS, settings)
        address = in_loop(actor.uplink_address())

        class Agent(NodeAgent):
            def _resolve_up(self):  # Ray would ask the actor for this
                return address

        agent = Agent(None, NodeSettings(node=0, device="cpu", rank_devices={0: 0}, world_size=1,
                                         relay_token=TOKEN))
        channel = RelayChannel("127.0.0.1", agent.relay_port, token=TOKEN)
        relay = agent.relay

        async def barrier() -> None:
            return None

        def settled(step: int) -> None:
            """Wait until the aggregator drew step's views and the relay holds its lease."""
            deadline = time.monotonic() + 30
            while actor.core.reducer.reduced_through < step or relay._lease.reduced_through < step:
                assert time.monotonic() < deadline, f"step {step} was not reduced and its lease not relayed in 30 s"
                time.sleep(0.005)
            for _ in range(3):  # what the loops queued behind it (the views, the writes) ran
                in_loop(barrier())
                asyncio.run_coroutine_threadsafe(barrier(), relay.loop).result(10)

        class Open(Callback):
            def on_train_step_end(self, run_context):
                if run_context.original_args().cur_step_num == TRACED_STEP:
                    names[threading.current_thread().name] = "rank"
                    trace.active = True

        recorded: dict[str, dict[str, list[str]]] = {}
        out = io.StringIO()

        class Settle(Callback):
            def on_train_step_end(self, run_context):
                step = run_context.original_args().cur_step_num
                if step == TRACED_STEP:
                    trace.closed.add(threading.current_thread().name)  # the rank's part is done
                settled(step)
                if step != TRACED_STEP:
                    return
                trace.active = False
                recorded["step"] = trace.take()
                # the driver's poll (launcher/attempt.py `Attempt.poll`, without Ray), while
                # nothing else is on its way
                trace.active = True
                info = in_loop(actor.poll())
                console = Console(out)
                for text in info["console"]:
                    console.say(text)
                trace.active = False
                recorded["driver"] = trace.take()

        net = nn.Dense(4, 1)
        model = Model(net, nn.MSELoss(), nn.Momentum(net.trainable_params(), 0.01, 0.9))
        rng = np.random.default_rng(0)
        data = NumpySlicesDataset({"x": rng.normal(size=(STEPS * 2, 4)).astype(np.float32),
                                   "y": rng.normal(size=(STEPS * 2, 1)).astype(np.float32)}, shuffle=False).batch(2)
        monitor = Monitor(client=channel, rank=0, total_steps=STEPS)
        model.train(1, data, callbacks=[Open(), monitor, Settle()], dataset_sink_mode=False)
        assert set(recorded) == {"step", "driver"}, f"step {TRACED_STEP} was not traced (the run ended early?)"
        step_entries, driver_entries = recorded["step"], recorded["driver"]
    finally:
        trace.uninstall()
        if channel is not None:
            channel.close()
        if agent is not None:
            agent.stop()  # the relay's queue up, the uplink closed, the relay's loop ended
            agent._spawner.shutdown()
        if actor is not None:
            asyncio.run_coroutine_threadsafe(actor.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        agg_thread.join(10)
        loop.close()
    assert not agg_thread.is_alive(), "the aggregator's loop did not end"

    assert f"step {TRACED_STEP}/{STEPS}" in out.getvalue(), (
        f"the driver printed no table of step {TRACED_STEP}:\n{out.getvalue()}")
    traced = {names.get(t, t): list(dict.fromkeys(m)) for t, m in step_entries.items()}
    # the driver's poll runs in the aggregator's loop and the driver's thread (the rank's here)
    places = [t for t, p in names.items() if p in ("aggregator", "rank")]
    traced["driver"] = list(dict.fromkeys(m for t in sorted(places, key=lambda t: names[t] != "aggregator")
                                          for m in driver_entries.get(t, [])))
    for t, m in driver_entries.items():
        if t not in places:  # nothing else may run while the driver polls
            traced[f"driver/{names.get(t, t)}"] = list(dict.fromkeys(m))
    legs, documented_counts = documented_path(DOC.read_text())
    expected = by_place(legs)
    counted = {names.get(t, t): Counter(m) for t, m in step_entries.items()}
    miscounted = [f"{place} enters {module} {counted.get(place, Counter())[module]} time(s), the doc says {n}"
                  for (place, module), n in documented_counts.items() if counted.get(place, Counter())[module] != n]
    wrong = {p for p in set(expected) | set(traced) if expected.get(p, []) != traced.get(p, [])}
    problems = [f"{p}: the modules the step enters differ from docs/architecture.md ({HEADING})\n"
                f"documented: {expected.get(p, [])}\ntraced:     {traced.get(p, [])}\n"
                f"{_diff(expected.get(p, []), traced.get(p, []))}" for p in sorted(wrong)]
    if miscounted:
        problems.append("entries per step differ from docs/architecture.md:\n" + "\n".join(miscounted))
    assert not problems, "\n\n".join(problems)
