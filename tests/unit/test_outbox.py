"""The rank's outbox (workers/outbox.py): a relay channel's work runs on a thread of its own,
in order, and a session that ships through it sends what an inline session sends, the
collect steps' statistics (computed there from a copy of the weights) and rank 0's
checkpoint verdicts included."""

from __future__ import annotations

import dataclasses
import threading

import mindspore as ms
import numpy as np
import pytest
from test_rank_session import Later, _bump, settings

from mindpulse.wire.protocol import CheckpointKind, EventKind, EventPacket, StepPacket
from mindpulse.workers.outbox import InlineOutbox, ThreadOutbox, outbox_for

TIMING = {"ts", "monitor_self_s", "monitor_wait_s", "checkpoint_s", "step_time_s", "eval_s"}
"""Fields that differ between two runs of the same steps (clocks), left out of the comparison."""


@pytest.fixture()
def small_cell():
    from mindspore import nn

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    net = nn.Dense(4, 2)
    return net, nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.Adam(net.trainable_params(), 1e-3))


class Threaded(Later):
    """`Later` whose work the session runs on its outbox thread, as it does a relay channel's;
    it notes which thread sent each batch."""

    background = True

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.threads: set[int] = set()

    def _ship(self, batch, step=None):
        self.threads.add(threading.get_ident())
        super()._ship(batch, step)


def _run(tmp_path, channel, net, train_cell, copies: list | None = None) -> list:
    """`copies`: gets (step, arrays copied) for each copy into the pool's blocks."""
    from mindpulse.workers import host_copies
    from mindpulse.workers.session import RankSession

    run = settings(tmp_path, monitor=dataclasses.replace(settings(tmp_path).monitor, weight_stats=True))
    run = dataclasses.replace(run, schedule=dataclasses.replace(run.schedule, collect_freq=2, save_every=0))
    s = RankSession(run, rank=0, channel=channel, network=net, train_cell=train_cell)
    pool = host_copies.SHARED_BLOCKS
    if copies is not None:
        pool.copy = lambda views: copies.append((s.step, len(views))) or host_copies.HostBlocks.copy(pool, views)
    try:
        s._copy_or_wait.waited(1.0)  # a wait dearer than any copy of these weights: every candidate copies
        _bump(net, 0.5)  # both runs start from the same weights
        s.start()
        for step in range(1, 8):
            _bump(net, float(step) + 0.25 * step * step)  # the weights after step `step` (their change grows)
            s.record(1.0 + step)
        s.finish()
    finally:
        vars(pool).pop("copy", None)  # the pool's own method again, whatever happened
    return channel.packets


def test_a_session_through_its_outbox_thread_sends_what_an_inline_one_sends(tmp_path, small_cell):
    net, train_cell = small_cell
    best = {"saves": frozenset({CheckpointKind.BEST}), "metric": 0.5, "metric_name": "loss"}
    inline = _run(tmp_path / "inline", Later(plan={3: best}, delay=0), net, train_cell)
    threaded_channel = Threaded(plan={3: best}, delay=0)
    copies: list = []
    threaded = _run(tmp_path / "threaded", threaded_channel, net, train_cell, copies)

    assert threading.get_ident() not in threaded_channel.threads, "the outbox's thread sent, not the training thread"
    steps = [p for p in threaded if isinstance(p, StepPacket)]
    assert [p.step for p in steps] == list(range(8)), "every step, in order"
    assert isinstance(threaded[-1], EventPacket) and threaded[-1].kind == EventKind.END.value, "END after every step"

    def comparable(packets):
        return [{k: v for k, v in dataclasses.asdict(p).items() if k not in TIMING}
                for p in packets if isinstance(p, StepPacket)]

    got, want = comparable(threaded), comparable(inline)
    assert got == want, next((g, w) for g, w in zip(got, want, strict=True) if g != w)
    collected = [p for p in steps if p.step % 2 == 0 and p.step > 0]
    assert all(p.fingerprint and p.weights.get("update_ratio") for p in collected), collected
    assert all(p.fingerprint is None and not p.weights for p in steps if p.step % 2), "statistics on collect steps only"
    saved = ms.load_checkpoint(str(tmp_path / "threaded" / "checkpoints" / "step_00000003-best.ckpt"))
    assert np.all(saved[net.weight.name].asnumpy() == pytest.approx(3.0 + 0.25 * 9)), "the best holds step 3's weights"
    # step 6 is a collect step and a candidate (best every 3): the weights are copied once, with
    # the optimizer's state, and the statistics (equal to the inline run's, above) read that copy
    weights_alone = len(list(net.get_parameters()))
    candidate = [n for step, n in copies if step == 3 and n != weights_alone]
    assert len(candidate) == 1 and candidate[0] > weights_alone, f"step 3's candidate copy: {copies}"
    assert [n for step, n in copies if step == 6] == candidate, f"step 6 copied its weights twice: {copies}"
    assert all(n == weights_alone for step, n in copies if step % 3), copies


def test_a_failing_job_is_the_monitors_error_and_the_jobs_after_it_run():
    errors, done = [], []
    box = ThreadOutbox(errors.append)
    box.submit(lambda: done.append(1))
    box.submit(lambda: 1 / 0)
    box.submit(lambda: done.append(3))
    assert box.call(lambda: threading.get_ident()) != threading.get_ident()
    with pytest.raises(KeyError):
        box.call(lambda: {}["missing"])  # a call's error goes back to its caller
    box.submit(lambda: done.append(4))
    box.close()
    assert done == [1, 3, 4] and len(errors) == 1 and isinstance(errors[0], ZeroDivisionError)
    box.submit(lambda: done.append(threading.get_ident()))  # after the end (a Monitor used again): inline
    assert done[-1] == threading.get_ident()


def test_a_call_stuck_behind_a_job_gives_up_in_time():
    """A write stuck on a relay that stopped reading must not hold the training thread past
    the timeout its caller gives."""
    release = threading.Event()
    box = ThreadOutbox(print)
    box.submit(release.wait)
    with pytest.raises(TimeoutError):
        box.call(lambda: 1, timeout=0.2)
    release.set()
    assert box.call(lambda: 2) == 2
    box.close()


def test_a_late_verdict_never_holds_up_rank_0s_next_packets(tmp_path, small_cell):
    """The answer is looked for before each of the outbox's jobs, without waiting: while it has
    not come, the steps after the candidate go out; it is read whole when the next candidate
    needs it, and the best checkpoint is still the candidate's own weights."""
    from mindpulse.workers.session import RankSession

    net, train_cell = small_cell
    best = {"saves": frozenset({CheckpointKind.BEST}), "metric": 0.5, "metric_name": "loss"}
    ch = Threaded(plan={3: best}, delay=10**6)  # never there when looked for without waiting
    run = settings(tmp_path)
    run = dataclasses.replace(run, schedule=dataclasses.replace(run.schedule, save_every=0))  # best every 3 alone
    s = RankSession(run, rank=0, channel=ch, network=net, train_cell=train_cell)
    s._copy_or_wait.waited(1.0)  # every candidate copies
    for step in range(1, 6):
        _bump(net, float(step))
        s.record(1.0)
    s.outbox.call(lambda: None)  # what was queued has run
    sent = [p.step for p in ch.packets if isinstance(p, StepPacket)]
    assert ch.asked == [3] and sent[-2:] == [4, 5], f"steps after the candidate were held up: {sent}"
    assert s._pending is not None and ch.waited == 0, "nothing waited for the verdict yet"
    s.record(1.0)  # step 6, the next candidate: the verdict of step 3 is read first (waiting)
    s.outbox.call(lambda: None)
    assert ch.waited == 1 and ch.asked == [3, 6]
    saved = ms.load_checkpoint(str(tmp_path / "checkpoints" / "step_00000003-best.ckpt"))
    assert np.all(saved[net.weight.name].asnumpy() == 3.0), "the best holds step 3's weights"
    s.finish()


def test_only_a_channel_with_a_socket_of_its_own_gets_a_thread():
    assert isinstance(outbox_for(Later(), print), InlineOutbox)
    assert isinstance(outbox_for(None, print), InlineOutbox)
    box = outbox_for(Threaded(), print)
    assert isinstance(box, ThreadOutbox)
    box.close()


def test_host_blocks_are_reused_whole_and_never_shared():
    """Two copies out at once never share a block; a block handed back is the next copy's,
    its page faults paid once (`reserve` makes and touches blocks ahead)."""
    from mindpulse.workers.host_copies import HostBlocks

    pool = HostBlocks()
    pool.reserve(96, 2)
    a = [np.arange(10, dtype=np.float32), np.arange(3, dtype=np.float64)]
    b = [np.full(10, 7, np.float32), np.full(3, 9, np.float64)]
    first, second = pool.copy(a), pool.copy(b)
    assert not np.shares_memory(first.arrays[0], second.arrays[0]), "two copies out at once share a block"
    assert all(np.array_equal(x, y) for x, y in zip(first.arrays, a, strict=True))
    assert all(np.array_equal(x, y) for x, y in zip(second.arrays, b, strict=True))
    reused = first._held.block
    first.release()
    first.release()  # twice is once
    third = pool.copy(b)
    assert third._held.block is reused and len(pool._free) == 0, "the block handed back is the next copy's"


def test_a_part_of_a_copy_keeps_its_block_until_both_holders_let_go():
    """A step both a collect step and a checkpoint candidate copies once: the statistics read a
    part of the candidate's copy. The block goes back to the pool only when the candidate's
    holder and the part's are both released, in either order."""
    from mindpulse.workers.host_copies import HostBlocks

    pool = HostBlocks()
    views = [np.arange(4, dtype=np.float32), np.arange(6, dtype=np.float64), np.arange(2, dtype=np.int32)]
    for first_out in ("whole", "part"):
        whole = pool.copy(views)
        part = whole.part([2, 0])
        assert [a.tolist() for a in part.arrays] == [[0, 1], [0, 1, 2, 3]], "the part's arrays, in its order"
        assert np.shares_memory(part.arrays[1], whole.arrays[0]), "a part is no second copy"
        (whole if first_out == "whole" else part).release()
        still = part if first_out == "whole" else whole
        assert pool._free == [], f"the block went back while the {first_out}'s other holder still reads it"
        other = pool.copy(views)
        assert not np.shares_memory(other.arrays[0], still.arrays[0]), "a new copy took a block still read"
        other.release()
        still.release()
        assert len(pool._free) == 2, "both blocks back once every holder let go"
        pool._free.clear()
    with pytest.raises(ValueError):
        whole.part([0])


def test_a_verdict_that_came_while_the_outbox_was_idle_is_taken_at_the_next_step(tmp_path, small_cell):
    """Nothing else to send after the question: the idle outbox still looks for the answer, so
    the training thread follows it at the very next step's end (its save's time goes in that
    step's next packet, not lost after the run's last one)."""
    import time

    from mindpulse.workers.session import RankSession

    net, train_cell = small_cell
    best = {"saves": frozenset({CheckpointKind.BEST}), "metric": 0.5, "metric_name": "loss"}
    ch = Threaded(plan={3: best}, delay=1)  # not there at the first look
    run = settings(tmp_path)
    run = dataclasses.replace(run, schedule=dataclasses.replace(run.schedule, save_every=0))
    s = RankSession(run, rank=0, channel=ch, network=net, train_cell=train_cell)
    s._copy_or_wait.waited(1.0)
    for step in range(1, 4):
        _bump(net, float(step))
        s.record(1.0)
    deadline = time.monotonic() + 5
    while s._pending is not None and not s._pending.take(wait=False) and time.monotonic() < deadline:
        time.sleep(0.005)  # the step's compute: the outbox has nothing to send meanwhile
    s.record(1.0)  # step 4
    assert s._pending is None and ch.waited == 0, "the verdict of step 3 was not followed at step 4"
    assert (tmp_path / "checkpoints" / "step_00000003-best.ckpt").exists()
    s.finish()


def test_a_record_that_fails_after_the_collect_copy_hands_the_copy_back(tmp_path, small_cell):
    """The collect step's copy is taken before the packet's fields are read: a value the monitor
    cannot read (a monitor error) must not keep the copy's block out of the pool for good (two
    such steps would leave every later collect step measured on the training thread)."""
    from mindpulse.workers.session import RankSession

    net, train_cell = small_cell
    run = settings(tmp_path)
    run = dataclasses.replace(run, schedule=dataclasses.replace(run.schedule, collect_freq=2, save_every=0,
                                                                best_every=0, save_best=False))
    s = RankSession(run, rank=1, channel=Threaded(), network=net, train_cell=train_cell)
    s.record(1.0)
    s.record(object())  # step 2, a collect step: copied, then its loss cannot be read
    assert s.errors == 1
    assert s.weights._copies_out and all(c.released for c in s.weights._copies_out), "the copy was never released"
    s.finish()


def test_a_candidate_whose_copy_failed_is_not_copied_twice(tmp_path, small_cell):
    """A step both collect and candidate tries the candidate's copy first; when it fails (weights
    numpy cannot hold) the candidate waits for its verdict: no second copy at the same step."""
    from mindpulse.workers.session import RankSession

    net, train_cell = small_cell
    run = settings(tmp_path)
    run = dataclasses.replace(run, schedule=dataclasses.replace(run.schedule, collect_freq=3, save_every=0))
    ch = Later(delay=0)
    s = RankSession(run, rank=0, channel=ch, network=net, train_cell=train_cell)
    s._copy_or_wait.waited(1.0)  # every candidate would copy
    tried: list[int] = []

    def fail(cell, step):
        tried.append(step)
        raise TypeError("a dtype numpy lacks")

    s._weights_copy.take = fail
    for _ in range(3):
        s.record(1.0)
    assert tried == [3], f"the copy of step 3 was tried {len(tried)} times"
    assert ch.asked == [] and [p.step for p in ch.packets if isinstance(p, StepPacket) and p.decision] == [3], \
        "the candidate waited for its verdict instead"
    s.finish()
