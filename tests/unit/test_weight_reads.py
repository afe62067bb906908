"""What the rank reads of the weights and the optimizer: the fingerprint's sums, the weight
statistics' update ratios (read on the host for a CPU target, reduced on the device
otherwise: both must agree), and the learning rate of a step."""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from mindpulse.workers import fingerprint as fingerprint_mod
from mindpulse.workers.fingerprint import HostViews, fingerprint_of, param_sums, weights_on_host
from mindpulse.workers.model_params import model_parameters
from mindpulse.workers.monitor import lr_of_step
from mindpulse.workers.weight_stats import WeightStats


@pytest.fixture(params=["pynative", "graph"])
def mode(request):
    ms.set_context(mode=ms.PYNATIVE_MODE if request.param == "pynative" else ms.GRAPH_MODE, device_target="CPU")
    yield request.param
    ms.set_context(mode=ms.PYNATIVE_MODE)


def trained(seed: int = 3):
    ms.set_seed(seed)
    net = nn.SequentialCell([nn.Dense(6, 5), nn.ReLU(), nn.Dense(5, 2)])
    cell = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.Momentum(net.trainable_params(), 0.1, 0.9))
    cell.set_train()
    rng = np.random.RandomState(seed)
    x, y = ms.Tensor(rng.randn(4, 6).astype(np.float32)), ms.Tensor(rng.randn(4, 2).astype(np.float32))
    cell(x, y)
    return net, lambda: cell(x, y)


def test_sums_on_the_host_and_on_the_device_agree(mode):
    net, step = trained()
    step()
    params = model_parameters(net)
    assert weights_on_host(params), "a CPU target's float weights are read where they live"
    host, device = param_sums(params, on_host=True), param_sums(params, on_host=False)
    assert host.dtype == device.dtype == np.float32 and host.shape == (2 * len(params),)
    np.testing.assert_allclose(host, device, rtol=1e-5, atol=1e-6)
    exact = np.array([f(p.asnumpy().astype(np.float64)) for p in params for f in (np.sum, lambda a: np.sum(a * a))])
    np.testing.assert_allclose(host, exact, rtol=1e-5, atol=1e-6)


def test_the_fingerprint_follows_the_weights_after_every_step(mode):
    net, step = trained()
    params = model_parameters(net)
    before = fingerprint_of(param_sums(params))
    assert fingerprint_of(param_sums(params)) == before, "the same weights, the same fingerprint"
    step()
    after = fingerprint_of(param_sums(params))
    assert after[0] != before[0], "the step's update is seen (the host reads the weights' own storage)"
    # equal weights in another network (other memory): the same fingerprint to the last bit
    twin, _ = trained(seed=9)
    ms.load_param_into_net(twin, {p.name: ms.Parameter(ms.Tensor(p.asnumpy().copy()), name=p.name)
                                  for p in params})
    assert fingerprint_of(param_sums(model_parameters(twin))) == after
    # one value a little off (as the desync fault does it): another fingerprint
    p = params[0]
    a = p.asnumpy().copy()
    a.reshape(-1)[0] += np.float32(1e-4)
    p.set_data(ms.Tensor(a))
    assert fingerprint_of(param_sums(params))[0] != after[0]


def test_kept_host_views_follow_every_step_and_new_storage(mode, monkeypatch):
    """The views a rank keeps of its weights (read once per parameter, not every collect
    step) show each step's update, as a fresh `asnumpy()` does, and a parameter given new
    storage (a checkpoint loaded, the desync fault) is read anew."""
    net, step = trained()
    params = model_parameters(net)
    reads = []
    real = fingerprint_mod.host_array
    monkeypatch.setattr(fingerprint_mod, "host_array", lambda p: reads.append(p.name) or real(p))
    views = HostViews(params)
    first = param_sums(params, on_host=True, views=views)
    np.testing.assert_array_equal(first, param_sums(params, on_host=True))
    for _ in range(3):
        step()
        np.testing.assert_array_equal(param_sums(params, on_host=True, views=views), param_sums(params, on_host=True))
    # one read per parameter for the kept views (the rest are the fresh reads compared against)
    assert reads.count(params[0].name) == 1 + 4
    p = params[0]
    a = p.asnumpy().copy()
    a.reshape(-1)[0] += np.float32(1e-3)
    p.set_data(ms.Tensor(a))
    np.testing.assert_array_equal(views[0], a.reshape(-1))
    assert fingerprint_of(param_sums(params, on_host=True, views=views)) == fingerprint_of(param_sums(params))


def test_update_ratios_on_the_host_and_on_the_device_agree(mode):
    net, step = trained()
    params = model_parameters(net)
    stats = {on_host: WeightStats(params, on_host=on_host) for on_host in (True, False)}
    w0 = [p.asnumpy().astype(np.float64).copy() for p in params]
    for s in stats.values():
        s.keep_previous()
    step()
    w1 = [p.asnumpy().astype(np.float64) for p in params]
    sums = param_sums(params)
    got = {on_host: s.collect(sums) for on_host, s in stats.items()}
    expected = {p.name: math.sqrt(((b - a) ** 2).sum()) / math.sqrt((b * b).sum()) for p, a, b in zip(params, w0, w1)}
    for out in got.values():
        assert set(out["update_ratio"]) == set(expected)
        for name, v in expected.items():
            assert out["update_ratio"][name] == pytest.approx(v, rel=1e-4), name
        assert out["norms"] == got[True]["norms"]
    assert all(s.prev is None for s in stats.values()), "the kept weights live for one step only"


def test_the_kept_weights_are_a_copy_not_the_live_storage(mode):
    net, step = trained()
    params = model_parameters(net)
    s = WeightStats(params, on_host=True)
    s.keep_previous()
    kept = [a.copy() for a in s.prev.arrays]
    step()
    assert all(np.array_equal(a, b) for a, b in zip(s.prev.arrays, kept, strict=True))
    assert s.collect(param_sums(params))["update_ratio"][params[0].name] > 0


def test_the_learning_rate_of_a_step_from_a_tensor_of_rates():
    net = nn.Dense(3, 1)
    rates = np.array([0.1, 0.2, 0.3], np.float32)
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=ms.Tensor(rates))
    assert [lr_of_step(opt, i) for i in range(3)] == pytest.approx(rates.tolist())
    assert lr_of_step(opt, 3) is None and lr_of_step(opt, -1) is None, "no rate outside the table"
    sched = opt.learning_rate  # what the schedule's own graph gives for the same step
    assert lr_of_step(opt, 1) == pytest.approx(float(sched(ms.Tensor(1, ms.int32)).asnumpy()))
    # a rate changed by the script is read as it is now
    sched.learning_rate.set_data(ms.Tensor(rates * 10))
    assert lr_of_step(opt, 2) == pytest.approx(3.0)
    # ... and one written in place into the table's storage (the host view is kept)
    ms.ops.assign(sched.learning_rate, ms.Tensor(rates * 100))
    assert lr_of_step(opt, 2) == pytest.approx(30.0)
    assert lr_of_step(opt, 0) == pytest.approx(10.0)
    # the other kinds, as before: a constant, and a schedule cell
    assert lr_of_step(nn.SGD(net.trainable_params(), 0.05), 7) == pytest.approx(0.05)
    cos = nn.CosineDecayLR(0.01, 0.1, 10)
    assert lr_of_step(nn.SGD(net.trainable_params(), cos), 10) == pytest.approx(0.01, rel=1e-5)
