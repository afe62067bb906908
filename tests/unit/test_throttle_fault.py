"""`throttle@R:S`: from step S on, the rank's own computation is slower (a delay inside its
forward pass, once a step), not its data path; in GRAPH mode it says it cannot act."""

from __future__ import annotations

import types

import mindspore as ms
import numpy as np
from mindspore import nn

from mindpulse.config.fault_specs import FaultKind, parse_fault
from mindpulse.workers import faults
from mindpulse.workers.faults import FaultInjector


def _cell():
    net = nn.Dense(6, 2)
    loss_net = nn.WithLossCell(net, nn.MSELoss())
    return nn.TrainOneStepCell(loss_net, nn.SGD(net.trainable_params(), 0.01)), loss_net


def test_throttle_delays_each_step_from_its_step_once_inside_the_forward_pass(monkeypatch):
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    where = {"in_step": None}
    slept: list[tuple[int | None, float]] = []
    monkeypatch.setattr(faults, "time", types.SimpleNamespace(sleep=lambda s: slept.append((where["in_step"], s))))
    f = parse_fault("throttle@0:2")
    assert f.kind is FaultKind.THROTTLE and str(f) == "throttle@0:2"
    cell, loss_net = _cell()
    inj = FaultInjector(0, [f])
    inj.bind(cell, loss_net)
    x = ms.Tensor(np.ones((4, 6), np.float32))
    y = ms.Tensor(np.zeros((4, 2), np.float32))
    for step in (1, 2, 3):
        inj.before_step(step)
        assert slept == [] or slept[-1][0] is not None, "the delay is not in the data path (before the step)"
        where["in_step"] = step  # the step's computation
        cell(x, y)
        where["in_step"] = None
        inj.after_step(step)
    # once a step from step 2 on, inside the step, though the gradient pass runs the forward again
    assert slept == [(2, faults.THROTTLE_S), (3, faults.THROTTLE_S)], slept
    assert inj.fired == ["throttle@0:2"]


def test_throttle_in_graph_mode_says_it_cannot_act(caplog):
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    try:
        cell, loss_net = _cell()
        inj = FaultInjector(0, [parse_fault("throttle@0:2")])
        with caplog.at_level("WARNING"):
            inj.bind(cell, loss_net)
        assert "cannot inject throttle" in caplog.text and "train.mode: pynative" in caplog.text
        assert not inj._throttle_hooked
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
