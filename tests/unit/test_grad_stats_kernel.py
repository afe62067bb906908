"""The fused grad-statistics kernel: its answers against numpy on every dtype it reads
(NaN/Inf anywhere, empty and scalar tensors, squares that overflow float32), and its build:
cached, one build for ranks that start together, and a clear reason (and the graph path in
the cell) where it cannot be built."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

from mindpulse.workers import grad_stats_kernel as K

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def op():
    ms.set_context(device_target="CPU")
    op = K.fused_grad_stats_op()
    if op is None:
        pytest.fail(f"the fused kernel must build and run on this CPU machine: {K.fused_op_unavailable_reason()}")
    return op


def _expected(arrays):
    """[norm, NaN count, Inf count] in float64 from numpy."""
    flat = [np.asarray(a, np.float64).reshape(-1) for a in arrays]
    nan = sum(int(np.isnan(f).sum()) for f in flat)
    inf = sum(int(np.isinf(f).sum()) for f in flat)
    sq = sum(float((f[np.isfinite(f)] ** 2).sum()) for f in flat)
    norm = math.nan if nan else (math.inf if inf else math.sqrt(sq))
    return norm, nan, inf


def _run(op, arrays, dtype=ms.float32):
    return op(*[ms.Tensor(np.asarray(a, np.float32), dtype) for a in arrays]).asnumpy().tolist()


@pytest.mark.parametrize("dtype", [ms.float32, ms.float16, ms.bfloat16, ms.float64])
def test_matches_numpy_on_every_dtype(op, dtype):
    rng = np.random.RandomState(7)
    shapes = [(3, 4), (1000,), (), (2, 3, 5), (0, 4), (513,), (7, 129)]
    arrays = [rng.randn(*s).astype(np.float32) if s else np.float32(rng.randn()) for s in shapes]
    # what the kernel sees are the values after the cast to `dtype`
    seen = [ms.Tensor(a, dtype).astype(ms.float32).asnumpy() for a in arrays]
    norm, nan, inf = _run(op, arrays, dtype)
    want = _expected(seen)
    assert norm == pytest.approx(want[0], rel=1e-6)
    assert (nan, inf) == (0, 0)


@pytest.mark.parametrize("dtype", [ms.float32, ms.float16, ms.bfloat16, ms.float64])
def test_counts_nan_and_inf_wherever_they_are(op, dtype):
    rng = np.random.RandomState(3)
    arrays = [rng.randn(600).astype(np.float32), rng.randn(8, 9).astype(np.float32), rng.randn(5).astype(np.float32)]
    arrays[0][[0, 511, 512, 599]] = [np.nan, np.inf, -np.inf, np.nan]  # block edges and the tail
    arrays[1][3, 4] = -np.inf
    norm, nan, inf = _run(op, arrays, dtype)
    assert math.isnan(norm) and (nan, inf) == (2, 3)
    arrays[0][[0, 599]] = 1.0  # no NaN left: an Inf norm
    norm, nan, inf = _run(op, arrays, dtype)
    assert norm == math.inf and (nan, inf) == (0, 3)


def test_squares_that_overflow_float32_give_the_exact_norm(op):
    a = np.array([3e19, 4e19, 1.0], np.float32)
    norm, nan, inf = _run(op, [a, np.ones(10, np.float32)])
    assert norm == pytest.approx(5e19, rel=1e-6) and (nan, inf) == (0, 0)


def test_large_tensors_sum_like_float64(op):
    rng = np.random.RandomState(11)
    arrays = [rng.randn(1_000_003).astype(np.float32) * 1e-3, rng.randn(300, 257).astype(np.float32) * 50]
    norm, _, _ = _run(op, arrays)
    assert norm == pytest.approx(_expected(arrays)[0], rel=1e-6)


def test_build_is_cached_and_shared_by_concurrent_builders(tmp_path):
    with ThreadPoolExecutor(4) as pool:
        builds = list(pool.map(lambda _: K.build(directory=tmp_path), range(4)))
    paths = {b.path for b in builds}
    assert len(paths) == 1 and None not in paths, [b.reason for b in builds]
    (path,) = paths
    assert sorted(p.name for p in tmp_path.glob("*.so")) == [path.name], "one library, no half-written temp files"
    mtime = path.stat().st_mtime_ns
    assert K.build(directory=tmp_path).path == path and path.stat().st_mtime_ns == mtime, "built again"


def test_a_changed_source_builds_anew(tmp_path):
    src = tmp_path / "k.cc"
    src.write_text(K.SOURCE.read_text())
    first = K.build(src, tmp_path / "cache").path
    src.write_text(K.SOURCE.read_text() + "\n// changed\n")
    second = K.build(src, tmp_path / "cache").path
    assert first and second and first != second


def test_build_failures_say_why(tmp_path, monkeypatch):
    bad = tmp_path / "bad.cc"
    bad.write_text("this is not C++\n")
    b = K.build(bad, tmp_path / "cache")
    assert b.path is None and "failed on bad.cc" in b.reason, b.reason
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CXX", raising=False)
    b = K.build(K.SOURCE, tmp_path / "cache2")
    assert b.path is None and "no C++ compiler" in b.reason, b.reason


@pytest.mark.slow
def test_without_a_compiler_the_cell_uses_its_graph_path_and_says_why(tmp_path):
    """A rank on a machine without a C++ compiler: the cell warns once, with the reason, and
    returns the same statistics from graph ops; asking for the kernel explicitly is an error
    that names the reason."""
    script = textwrap.dedent("""
        import math, numpy as np, mindspore as ms
        from mindspore import nn
        from mindpulse.workers.train_cell import MonitoredTrainOneStepCell, split_outputs
        ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
        ms.set_seed(1)
        net = nn.Dense(6, 2)
        cell = MonitoredTrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.SGD(net.trainable_params(), 0.0),
                                         fault_armed=False)
        assert not cell.fused_stats
        x, y = ms.Tensor(np.ones((4, 6), np.float32)), ms.Tensor(np.zeros((4, 2), np.float32))
        _, stats = split_outputs(cell(x, y))
        assert math.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0, stats
        try:
            MonitoredTrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.SGD(net.trainable_params(), 0.0),
                                      fault_armed=False, stats_kernel="fused")
        except RuntimeError as e:
            print("FUSED-ERROR:", e)
    """)
    env = dict(os.environ, PATH=str(Path(sys.executable).parent), MINDPULSE_KERNEL_DIR=str(tmp_path / "k"),
               PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="python", PYTHONPATH=str(REPO))
    env.pop("CXX", None)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fused grad-statistics kernel is not used (no C++ compiler found" in out.stderr, out.stderr[-3000:]
    assert "FUSED-ERROR: stats_kernel='fused': the fused kernel cannot run here (no C++ compiler" in out.stdout


def test_stats_kernel_is_checked():
    from mindspore import nn

    from mindpulse.workers.train_cell import MonitoredTrainOneStepCell

    net = nn.Dense(2, 1)
    with pytest.raises(ValueError, match="stats_kernel must be 'auto', 'fused' or 'graph'"):
        MonitoredTrainOneStepCell(net, nn.SGD(net.trainable_params(), 0.1), fault_armed=False, stats_kernel="fast")
