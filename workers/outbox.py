"""The rank's outbox: the channel's work (encoding packets, writing them to the node's relay,
asking for a checkpoint verdict and reading it) taken off the training thread.

Why: every step the training thread used to encode its packet and write it to the relay's
socket itself (~0.2 ms of its CPU a step here: the encoding, and the kernel's loopback work
done inside `sendall`), and rank 0 at each checkpoint candidate wrote the question and later
polled the socket for the answer. On an accelerator host the training thread is the one
that feeds the device, while the host has cores to spare; on any host, the socket's kernel
work and the relay's wake-up need not sit between two steps.

`ThreadOutbox` runs jobs in the order given, on one thread of its own that alone uses the
channel's packet connection (never two threads on one socket). `submit` queues a job and
returns at once; `call` queues one and waits for its result (what the training thread must
have before it goes on: a decision it waits for, the last flush of a run). A job's error is
the monitor's, handed to `on_error` (logged and counted), never raised into the training
loop; `call` re-raises it to its caller, who already handles the channel's errors.

`InlineOutbox` runs each job at once on the caller's thread: the channels that have no
socket of their own to write (the aggregator actor's Ray calls, a test's recording channel)
keep their synchronous behaviour.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.002
"""How often an idle outbox looks for a verdict that is due (a `select` with no wait)."""
CALL_TIMEOUT_S = 120.0
"""The longest `call` waits by default: past a dead relay's write and reconnection timeouts
(`channel.WRITE_TIMEOUT_S`, `CONNECT_TIMEOUT_S`) with room for the jobs queued before it."""
CLOSE_TIMEOUT_S = 60.0
"""How long closing waits for the queued jobs (a last flush, the end event) before it gives up
on them: a dead relay's writes time out well before (`channel.WRITE_TIMEOUT_S`)."""


class InlineOutbox:
    """Runs every job now, on the caller's thread."""

    background = False

    def __init__(self, on_error: Callable[[BaseException], None]):
        self._on_error = on_error

    def submit(self, job: Callable[[], Any]) -> None:
        try:
            job()
        except Exception as exc:  # the monitor's error, never the training loop's
            self._on_error(exc)

    def call(self, job: Callable[[], Any], timeout: float | None = None) -> Any:
        return job()

    def close(self) -> None:
        return None


class _Result:
    __slots__ = ("done", "value", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class ThreadOutbox:
    """Runs jobs in order on a thread of its own (see the module's docstring)."""

    background = True

    def __init__(self, on_error: Callable[[BaseException], None], name: str = "mindpulse-outbox"):
        self._on_error = on_error
        self.before_job: Callable[[], None] | None = None
        """Run on the thread before each job (the session looks whether a verdict came), and
        every `IDLE_POLL_S` while the queue is empty and `awaiting()` says an answer is due."""
        self.awaiting: Callable[[], bool] | None = None
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any] | None, _Result | None]] = queue.SimpleQueue()
        self._closed = False
        # a daemon: a script that never finishes its Monitor must still be able to exit
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> None:
        if self._closed:  # after the end (a Monitor used again after `finish`): inline, as before the thread
            try:
                job()
            except Exception as exc:  # the monitor's error, never the training loop's
                self._on_error(exc)
            return
        self._jobs.put((job, None))

    def call(self, job: Callable[[], Any], timeout: float | None = CALL_TIMEOUT_S) -> Any:
        """Run `job` after the queued ones and return its result; TimeoutError when it has not
        run within `timeout` seconds (the job still runs later: a write stuck on a relay that
        stopped reading must not hold the training thread past the channel's own timeouts)."""
        if self._closed or threading.current_thread() is self._thread:
            return job()  # from a job itself (or after the end): queued work would wait on this one
        result = _Result()
        self._jobs.put((job, result))
        if not result.done.wait(timeout):
            raise TimeoutError(f"the rank's outbox did not run the job within {timeout:.0f}s")
        if result.error is not None:
            raise result.error
        return result.value

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put((None, None))
        if threading.current_thread() is not self._thread:
            self._thread.join(CLOSE_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning("the rank's outbox did not empty in %.0fs: its last packets are lost", CLOSE_TIMEOUT_S)

    def _hook(self) -> None:
        if self.before_job is not None:
            try:
                self.before_job()
            except Exception as exc:  # the monitor's error; the job runs regardless
                self._on_error(exc)

    def _run(self) -> None:
        while True:
            # while an answer is due, look for it every few ms even with nothing to send: the
            # training thread takes it at its next step's end, not one step later
            due = self.awaiting is not None and self.awaiting()
            try:
                job, result = self._jobs.get(timeout=IDLE_POLL_S) if due else self._jobs.get()
            except queue.Empty:
                self._hook()
                continue
            if job is None:
                return
            self._hook()
            try:
                value = job()
                if result is not None:
                    result.value = value
            except BaseException as exc:  # a job's error is the monitor's, never the end of this thread
                if result is not None:
                    result.error = exc
                else:
                    try:
                        self._on_error(exc)
                    except Exception:  # reporting it failed too: logged here, the thread goes on
                        log.exception("the rank's outbox could not report an error")
            finally:
                if result is not None:
                    result.done.set()


def outbox_for(channel: Any, on_error: Callable[[BaseException], None]) -> InlineOutbox | ThreadOutbox:
    """A thread of its own for a channel that writes to a socket (`background`), else inline."""
    if channel is not None and getattr(channel, "background", False):
        return ThreadOutbox(on_error)
    return InlineOutbox(on_error)
