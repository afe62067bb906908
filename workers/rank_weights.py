"""What a rank's step packets carry about its weights: their fingerprint (at the start and every
collect step) and rank 0's per-layer statistics, and where each is computed.

On a device the reductions run there and only their small result comes to the host, in the
step. On a CPU target whose rank has an outbox thread (workers/outbox.py) a collect step copies
the weights once on the training thread (the next step changes them in place) and the outbox
computes the fingerprint and statistics from the copy (workers/collect_later.py); a step that is
also rank 0's checkpoint candidate reads the weights' part of the candidate's copy instead of a
copy of its own (docs/architecture.md, "The rank's two threads").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .collect_later import Completion
from .fingerprint import HostViews, fingerprint_of, param_sums, weights_on_host
from .host_copies import MAX_COPY_BYTES, SHARED_BLOCKS, HostCopy, copy_bytes
from .model_params import model_parameters
from .outbox import InlineOutbox, ThreadOutbox
from .weight_stats import DEFAULT_HIST_REGEX, WeightStats, structure_text
from .weights_copy import WeightsCopy

log = logging.getLogger(__name__)

MAX_COPIES_OUT = 2
"""Collect-step copies of the weights waiting for the outbox at most; past it (the outbox is
behind: a relay that stopped reading) a collect step is measured in place on the training
thread, as before the outbox, instead of holding one more copy of the weights."""


class RankWeights:
    """One rank's reads of its network's weights. The network is passed to each call (a
    Monitor may be given it after the session started); its parameters are listed once per
    network."""

    def __init__(self, rank: int, outbox: ThreadOutbox | InlineOutbox):
        self.rank = rank
        self.outbox = outbox
        self.stats: WeightStats | None = None
        """Rank 0's per-layer statistics (None: another rank, or turned off)."""
        self._last_sums: Any = None
        self._params: tuple[Any, list, HostViews, bool] | None = None
        """(network, its parameters, their host views, whether they are read on the host) as
        last listed (`listed`)."""
        self._copies_out: list[HostCopy] = []
        """Collect-step copies handed to the outbox (released once measured): at most
        `MAX_COPIES_OUT` unreleased. A list pruned here, not a counter both threads change."""
        self.reserved = False
        """The host blocks were asked for (`reserve`: once, after the first step)."""

    def listed(self, network: Any) -> tuple[list, HostViews]:
        """The network's parameters (the same tensors every step) and one set of host views
        of them, shared by the fingerprint and the weight statistics; listed again for a new
        network."""
        if self._params is None or self._params[0] is not network:
            params = model_parameters(network)
            self._params = (network, params, HostViews(params), weights_on_host(params))
        return self._params[1], self._params[2]

    def host_arrays(self, network: Any) -> list | None:
        """The network's weights as host arrays (views of their storage), for a copy; None where
        they are not read on the host (a device) or no copy is taken (no outbox thread)."""
        if not self.outbox.background or network is None:
            return None
        params, views = self.listed(network)
        assert self._params is not None
        return [views[i] for i in range(len(params))] if self._params[3] else None

    def watch_layers(self, network: Any, train_cell: Any, enabled: bool, histogram_regex: str) -> str | None:
        """Rank 0's per-layer statistics every collect_freq steps (data-parallel weights are
        identical: one rank ships them); returns the model's structure, to be sent once."""
        self.stats = None
        if self.rank != 0 or network is None or not enabled:
            return None
        try:
            params, views = self.listed(network)
            self.stats = WeightStats(params, histogram_regex or DEFAULT_HIST_REGEX, train_cell, views=views)
            return structure_text(params)
        except Exception as exc:  # weight statistics are optional: off for the run, training goes on
            log.warning("[rank %d] weight statistics are off: %s", self.rank, exc)
            self.stats = None
            return None

    def fingerprint(self, network: Any) -> tuple[str | None, float | None]:
        if network is None:
            return None, None
        try:
            params, views = self.listed(network)
            self._last_sums = param_sums(params, views=views)
            return fingerprint_of(self._last_sums)
        except Exception as exc:  # no fingerprint for this step: its packet goes out without one
            log.warning("[rank %d] fingerprint failed: %s", self.rank, exc)
            self._last_sums = None
            return None, None

    def measure_now(self, network: Any, step: int) -> tuple[str | None, float | None, dict[str, Any]]:
        """A collect step measured in the step: (fingerprint, parameter norm, statistics)."""
        fp, norm = self.fingerprint(network)
        weights: dict[str, Any] = {}
        if self.stats is not None:
            try:
                weights = self.stats.collect(self._last_sums)
            except Exception as exc:  # statistics are optional: the step's packet goes out without them
                log.warning("[rank %d] weight statistics failed at step %d: %s", self.rank, step, exc)
        return fp, norm, weights

    def collect_later(self, network: Any, step: int,
                      candidate: WeightsCopy | None = None) -> Completion | None:
        """At a collect step whose weights are on the host (a CPU target) and a channel with an
        outbox thread: copy the weights now (one pass; the next step changes them in place) and
        return what completes the step's packet from the copy on the outbox thread (the
        fingerprint, and rank 0's weight statistics), so the training thread goes on at once.
        `candidate`: rank 0's copy of this very step, taken for a checkpoint candidate: its
        weights' part is read instead of a copy of their own. None where they are measured now
        instead (`measure_now`)."""
        self._copies_out = [c for c in self._copies_out if not c.released]
        if len(self._copies_out) >= MAX_COPIES_OUT:  # the outbox is behind (a relay that stopped reading)
            return None
        copy: HostCopy | None = None
        try:
            arrays = self.host_arrays(network)
            if arrays is None or copy_bytes(arrays) > MAX_COPY_BYTES:  # large weights on a CPU: in place
                return None
            shared = candidate.part_for(self.listed(network)[0]) if candidate is not None else None
            copy = shared if shared is not None else SHARED_BLOCKS.copy(arrays)
            ws = self.stats
            grads = ws.take_grads() if ws is not None else None
            prev = ws.take_previous() if ws is not None else None
        except Exception as exc:  # measured now instead, on the training thread
            if copy is not None:  # a block held by nobody would never go back to the pool
                copy.release()
            log.warning("[rank %d] no copy of the weights at step %d (%s): statistics measured in the step",
                        self.rank, step, exc)
            return None
        self._copies_out.append(copy)
        return Completion(copy, ws, prev, grads, self.rank, step)

    def keep_previous(self) -> None:
        """Before a collect step: keep this step's weights for its update ratio (rank 0)."""
        if self.stats is not None:
            try:
                self.stats.keep_previous()
            except Exception as exc:  # the next update ratio is then missing, nothing else
                log.warning("[rank %d] cannot keep the weights for the update ratio: %s", self.rank, exc)

    def reserve(self, network: Any, candidate_bytes: Callable[[], int | None]) -> None:
        """Have the outbox thread make (and touch) the host blocks this rank's copies will take
        (workers/host_copies.py), so that no step pays their page faults: a collect step's
        copy, and on rank 0 the copy of the step before it and of a checkpoint candidate
        (`candidate_bytes()`: its size, None without one). Asked once the first step is recorded, not at the start:
        on a host whose rank shares its core, the blocks' page faults (~50 ms for a 2.75 M-
        parameter model with Adam here) would lengthen the first step, which already pays the
        start; the first copy comes at the step before the first collect step."""
        self.reserved = True
        try:
            arrays = self.host_arrays(network)
            if arrays is None:
                return
            need = copy_bytes(arrays)
            blocks = [need] * (2 if self.stats is not None else 1)
            candidate = candidate_bytes()  # only here: it lists the train cell's parameters
            if candidate is not None:
                blocks.append(candidate)
        except Exception as exc:  # the first copies then pay their page faults: nothing else
            log.info("[rank %d] host blocks not reserved: %s", self.rank, exc)
            return
        for n in sorted(b for b in blocks if b <= MAX_COPY_BYTES):
            self.outbox.submit(lambda n=n: SHARED_BLOCKS.reserve(n, blocks.count(n)))
