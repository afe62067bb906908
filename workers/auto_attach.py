"""Watch a user's script without an edit (`job.auto_monitor`, on by default).

Installed by the rank's entry point (rank_main.py) before it runs `job.script`, removed
when the script ends. What it patches, all in MindSpore's own classes, in this process only:

- `mindspore.train.Model.train` and `Model.fit`: when the call's callbacks hold no mindpulse
  `Monitor`, one is added (with the launch's settings) and the rank's log says so once. A
  Monitor the script added itself is never doubled. The callbacks are also looked at for
  MindSpore's `ModelCheckpoint` and `SummaryCollector`: their directories are reported, so
  the aggregator can warn when two ranks write the same one (it never changes them).
- `Model._build_train_network` (where `Model` builds or takes the train cell): the cell's
  gradient reducer is wrapped for the gradient statistics (workers/grad_probe.py), so a
  `Model(network, loss_fn, optimizer, ...)`, with or without `amp_level` or a loss-scale
  manager, or a script's own `nn.TrainOneStepCell` / `TrainOneStepWithLossScaleCell`
  handed to `Model`, reports the global and local grad norms and the NaN/Inf counts.
- On CPU, `nn.TrainOneStepWithLossScaleCell`'s overflow check and MindSpore's `barrier`
  (workers/cpu_fallbacks.py): they would call Ascend-only kernels there (a script of its own
  running MindFormers' Trainer meets both).
- `nn.TrainOneStepCell.__call__` and `nn.Optimizer.__call__`, until their first call: a
  script that trains (a hand loop, or `Model.train` with auto-attach off) while no Monitor
  exists in the process is named to the aggregator at once (`EventKind.NO_MONITOR`), not
  after a hang timeout. In GRAPH mode a compiled train step calls neither from Python; the
  script's end without a Monitor is then what names it.

With `job.auto_monitor: false` only the naming stays: the script runs untouched.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from mindpulse.config.rank_settings import RankSettings
from mindpulse.wire.protocol import EventKind, EventPacket

from .channel import connect
from .errors import StopTraining
from .session import sessions_created

log = logging.getLogger(__name__)

ADD_MONITOR = ("add `callbacks=[Monitor()]` to Model.train (from mindpulse.workers import Monitor), "
               "or set job.auto_monitor: true")
HAND_LOOP = ("a hand-written loop needs one line: `monitor = Monitor()` before it and "
             "`monitor.step(outputs, optimizer=opt)` after each step (README: Use your own script)")


@dataclass
class AutoAttach:
    """What is installed in this process, and what was told already."""

    settings: RankSettings | None
    rank: int
    enabled: bool
    """job.auto_monitor: add the Monitor and the statistics; False: only name a missing Monitor."""
    told_added: bool = False
    named: bool = False
    """A NO_MONITOR event went out (once per process)."""
    reported_dirs: set[tuple[str, ...]] = field(default_factory=set)
    cpu_checked: bool = False
    monitor: Any = None
    """The Monitor auto-attach added (one per process: a script that calls `Model.train` again
    gets the same one, its steps numbered on); finished at the script's end."""
    seen_cells: set[int] = field(default_factory=set)
    """Train cells the first-call hook has looked at (their statistics attached once)."""
    _restore: list[tuple[Any, str, Any]] = field(default_factory=list)
    _timer: threading.Timer | None = None

    # ---- installing ------------------------------------------------------------------------
    def install(self) -> AutoAttach:
        from mindspore import nn
        from mindspore.train import Model

        _cpu_loss_scale(barrier=True)
        for name in ("train", "fit"):
            self._patch(Model, name, self._wrap_train(getattr(Model, name), name))
        if self.enabled:
            self._patch(Model, "_build_train_network", self._wrap_build(Model._build_train_network))
        for cls in (nn.TrainOneStepCell, nn.Optimizer):
            self._patch(cls, "__call__", self._first_call_sentinel(cls))
        # a compiled hand loop calls neither hook from Python: without a Monitor by then, the rank
        # is named before its start-up clock could call it hung
        self._timer = threading.Timer(_quiet_limit_s(self.settings), self._no_monitor_yet)
        self._timer.daemon = True
        self._timer.start()
        return self

    def _no_monitor_yet(self) -> None:
        self.name_if_unwatched(f"no mindpulse Monitor {_quiet_limit_s(self.settings):.0f} s after the script "
                               "started (a compiled hand loop, or a long set-up: named again if its Monitor starts)")

    def finish(self) -> None:
        """The script ended (or failed): the Monitor auto-attach added says so to the aggregator."""
        mon, self.monitor = self.monitor, None
        if mon is not None and not mon.session.finished:
            try:
                mon.session.finish("stopped: " + mon.stopped.reason if mon.stopped else "")
            except Exception as exc:  # the monitor never breaks the training it watches
                log.warning("[rank %d] the Monitor could not say its end: %s", self.rank, exc)

    def uninstall(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for owner, name, old in reversed(self._restore):
            if old is _ABSENT:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, old)
        self._restore.clear()

    def _patch(self, owner: Any, name: str, new: Any) -> None:
        self._restore.append((owner, name, owner.__dict__.get(name, _ABSENT)))
        setattr(owner, name, new)

    # ---- Model.train / Model.fit -----------------------------------------------------------
    def _wrap_train(self, original: Any, api: str) -> Any:
        state = self

        @functools.wraps(original)
        def train(model: Any, *args: Any, **kwargs: Any) -> Any:
            callbacks, put_back = _callbacks_arg(original, args, kwargs)
            cbs = _as_list(callbacks)
            state._report_directories(cbs)
            added = None
            if not any(_is_monitor(cb) for cb in cbs):
                if state.enabled:
                    # first: at the step a stop directive ends, it must see the directive
                    # before the script's own callbacks react to that step (e.g. LossMonitor
                    # raising on the NaN loss that made the rules stop every rank)
                    added = state._monitor()
                    put_back([added] + cbs)
                    if not state.told_added:
                        state.told_added = True
                        log.info("[rank %d] mindpulse added its Monitor to Model.%s's callbacks (job.auto_monitor; "
                                 "set it to false to turn this off)", state.rank, api)
                else:
                    state.name_missing(f"Model.{api} runs without mindpulse's Monitor (job.auto_monitor is false)",
                                       ADD_MONITOR)
            try:
                return original(model, *put_back.args, **put_back.kwargs)
            except StopTraining:
                raise
            except Exception as exc:
                stopped = added.stopped if added is not None else None
                if stopped is None:
                    raise
                # every rank stops after this step: an error the script's own callbacks
                # raise at it (the anomaly that stopped the run) is that stop, not a crash
                log.warning("[rank %d] Model.%s raised %s: %s at the step mindpulse stops every rank after "
                            "(%s): taken as that stop", state.rank, api, type(exc).__name__, exc, stopped.reason)
                state.finish()
                raise StopTraining(stopped.reason) from exc

        return train

    def _monitor(self) -> Any:
        if self.monitor is None:
            from .monitor import Monitor

            self.monitor = Monitor(settings=self.settings)
            self.monitor.finish_at_train_end = False  # finished at the script's end (`finish`)
        return self.monitor

    # ---- the train cell's statistics ---------------------------------------------------------
    def _wrap_build(self, original: Any) -> Any:
        state = self

        @functools.wraps(original)
        def build(model: Any) -> Any:
            _cpu_loss_scale()  # the script has set its device target by now
            network = original(model)
            state._attach(network)
            return network

        return build

    def _attach(self, network: Any) -> None:
        """The gradient statistics around `network`'s train cell, said once in the rank's log."""
        try:
            from .grad_probe import attach_grad_stats

            done = attach_grad_stats(network, self.rank)
            if done == "attached":
                log.info("[rank %d] mindpulse takes the gradient statistics around %s's gradient reducer",
                         self.rank, type(network).__name__)
            elif done != "already":
                log.info("[rank %d] no gradient statistics for this network: %s", self.rank, done)
        except Exception as exc:  # the monitor never breaks the training it watches
            log.warning("[rank %d] could not attach the gradient statistics (training goes on without them): "
                        "%s: %s", self.rank, type(exc).__name__, exc)

    # ---- a script that trains without a Monitor ----------------------------------------------
    def _first_call_sentinel(self, cls: Any) -> Any:
        state = self
        original = cls.__call__  # inherited (Cell.__call__) or the class's own

        attaches = state.enabled and cls is nn_train_cell()

        def call(cell: Any, *args: Any, **kwargs: Any) -> Any:
            if not state.cpu_checked:  # before the first train step compiles (a script's own cell)
                state.cpu_checked = True
                _cpu_loss_scale()
            if attaches and id(cell) not in state.seen_cells:  # a hand loop's own train cell
                state.seen_cells.add(id(cell))
                state._attach(cell)
            if not state.named:
                state.name_if_unwatched(f"it trains ({type(cell).__name__} called) without mindpulse's Monitor")
            return original(cell, *args, **kwargs)

        return call

    def at_script_end(self) -> None:
        """The script ended: one that never created a Monitor is named now."""
        self.name_if_unwatched("the script ended without creating mindpulse's Monitor")

    def name_if_unwatched(self, why: str) -> None:
        """No Monitor was created in this process: name the rank (once), with what to add."""
        if not self.named and sessions_created() == 0:
            self.name_missing(why, ADD_MONITOR + "; " + HAND_LOOP)

    def name_missing(self, why: str, fix: str) -> None:
        """Tell the aggregator (once) that this rank's steps will not be reported, and why."""
        if self.named:
            return
        self.named = True
        log.warning("[rank %d] mindpulse sees no steps from this rank: %s. To fix: %s", self.rank, why, fix)
        self._send(EventKind.NO_MONITOR, json.dumps({"why": why, "fix": fix}))

    # ---- callbacks that clash across ranks ---------------------------------------------------
    def _report_directories(self, callbacks: list[Any]) -> None:
        for cb in callbacks:
            where = _callback_directory(cb)
            if where is None:
                continue
            key = (type(cb).__name__, *where)
            if key in self.reported_dirs:
                continue
            self.reported_dirs.add(key)
            msg = {"kind": "shared_directory", "callback": key[0], "directory": where[0]}
            if where[1]:
                msg["prefix"] = where[1]
            self._send(EventKind.ADVICE, json.dumps(msg))

    def _send(self, kind: EventKind, message: str) -> None:
        if self.settings is None:
            return
        try:
            channel = connect(self.settings, self.rank)
            pkt = EventPacket(rank=self.rank, kind=kind.value, ts=time.time(), pid=os.getpid(),
                              host=socket.gethostname(), message=message)
            channel.send(pkt.encode())
            channel.flush()
            channel.close()
        except Exception as exc:  # the monitor never breaks the training it watches
            log.warning("[rank %d] could not tell the aggregator (%s): %s", self.rank, kind.value, exc)


_ABSENT = object()


def nn_train_cell() -> Any:
    from mindspore import nn

    return nn.TrainOneStepCell


def _quiet_limit_s(settings: RankSettings | None) -> float:
    """How long a script may run without a Monitor before its rank is named: half its start-up
    limit (monitor.startup_timeout_s, else msrun.cluster_time_out), at least 30 s."""
    cfg = settings.config if settings is not None else {}
    limit = (cfg.get("monitor") or {}).get("startup_timeout_s") or (cfg.get("msrun") or {}).get("cluster_time_out")
    return max(30.0, float(limit or 600) / 2)


def _cpu_loss_scale(barrier: bool = False) -> None:
    """On CPU, MindSpore's loss-scale cell would call an Ascend-only overflow check, and
    MindFormers' barrier an Ascend-only op: give them the CPU ones (workers/cpu_fallbacks.py;
    nothing happens on Ascend or GPU). The barrier at install, before the script imports
    MindFormers (whose modules take `barrier` by name)."""
    try:
        from .cpu_fallbacks import enable_cpu_fallbacks

        enable_cpu_fallbacks(barrier=barrier)
    except Exception as exc:  # the monitor never breaks the training it watches
        log.warning("the CPU fallbacks (loss-scale overflow check, barrier) are not in place: %s: %s",
                    type(exc).__name__, exc)


def _is_monitor(cb: Any) -> bool:
    from .monitor import Monitor

    return isinstance(cb, Monitor)


def _as_list(callbacks: Any) -> list[Any]:
    if callbacks is None:
        return []
    if isinstance(callbacks, (list, tuple)):
        return list(callbacks)
    return [callbacks]


class _PutBack:
    """Puts the callbacks back where the call had them (keyword or position)."""

    def __init__(self, args: tuple, kwargs: dict, index: int | None):
        self.args, self.kwargs, self.index = args, kwargs, index

    def __call__(self, callbacks: Any) -> None:
        if self.index is not None and self.index < len(self.args):
            args = list(self.args)
            args[self.index] = callbacks
            self.args = tuple(args)
        else:
            self.kwargs = dict(self.kwargs, callbacks=callbacks)


def _callbacks_arg(original: Any, args: tuple, kwargs: dict) -> tuple[Any, _PutBack]:
    """The call's `callbacks` argument (by keyword or position, after `self`)."""
    import inspect

    names = [p for p in inspect.signature(original).parameters][1:]  # without self
    index = names.index("callbacks") if "callbacks" in names else None
    if "callbacks" in kwargs:
        return kwargs["callbacks"], _PutBack(args, kwargs, None)
    if index is not None and index < len(args):
        return args[index], _PutBack(args, kwargs, index)
    return None, _PutBack(args, kwargs, None)


def _callback_directory(cb: Any) -> tuple[str, str] | None:
    """(directory, file prefix) where MindSpore's ModelCheckpoint or SummaryCollector writes
    (absolute; SummaryCollector names its files itself: no prefix), else None. Two ranks'
    ModelCheckpoints with their own prefixes in one directory do not clash."""
    name = type(cb).__name__
    if name == "ModelCheckpoint":
        d, prefix = getattr(cb, "_directory", None), str(getattr(cb, "_prefix", "") or "")
    elif name == "SummaryCollector":
        d, prefix = getattr(cb, "_summary_dir", None), ""
    else:
        return None
    return (os.path.abspath(str(d)), prefix) if d else None


def install(settings: RankSettings | None, rank: int, enabled: bool) -> AutoAttach:
    """Patch this process's MindSpore for `job.script` (see the module docstring)."""
    return AutoAttach(settings, rank, enabled).install()
