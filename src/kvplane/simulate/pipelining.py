"""``--pipelining auto``: a prefill worker's per-request choice, asked of the simulator's model.

:class:`AutoPipelining` learns the worker's own prefill cost per token twice -- steps computed
while slices were being sent (pipelined requests) and steps with nothing sent beside them (on a
2-core host the shm copy and the KV writes share memory bandwidth, so the first are slower) --
and answers each request with :func:`~kvplane.simulate.timing.choose_pipelining` (the quiet
cost, and the ``contention`` the busy one implies) on its link's op cost (a
:data:`~kvplane.simulate.calibrate.PD_LINKS` prior, bandwidth learned from the worker's own
slices: :data:`LINK_WINDOW`). It explores first (:data:`EXPLORE`), takes each mode's cost as
the least of its recent requests' (:data:`WINDOW`) and tries a mode unused for
:data:`REFRESH` requests again. Plain state, no I/O, no clock; the worker feeds it.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvplane.simulate.spec import PrefillSpec, TransportSpec
from kvplane.simulate.timing import alone_ttft_s, choose_pipelining, contention_of
from kvplane.validators import require_int

EXPLORE = 1
"""Requests each mode is tried (alternately, pipelined first) before the model decides. One: an
exploring request of the worse mode costs up to 1.5x on tcp, and with two each ``bench pd
--quick``'s 4 requests were all exploration; later samples still lower a mode's least cost."""
WINDOW = 8
"""A mode's cost is the least per-token cost of its last ``WINDOW`` requests: a load spike only
slows a request, so the least is the host's own cost (on this shared host a single slow
non-pipelined sample once kept shm pipelined at 1.53x the better TTFT)."""
MARGIN = 0.05
"""The predicted TTFT gain another choice needs over a slice per step (``--pipelining on``): a
smaller one is within the model's error here and should not move the worker off the plain
mode (tcp once chose 2-step slices predicted a few % faster; they ran 1.14x slower). 10% was
too wide: it kept shm pipelined when non-pipelined was predicted 6% and measured 9% faster."""
REFRESH = 8
"""After this many requests observed in one mode, the next tries the other once, so that its
cost is measured again (once, shm auto stayed pipelined at 1.23x the non-pipelined TTFT)."""
LINK_WINDOW = 24
"""The link's learned bandwidth is the inverse of the median seconds per byte of its last
``LINK_WINDOW`` ops (about three 8-slice requests), each op's time less the calibrated
``op_overhead_s``, which is kept: ops of one size cannot separate the two, and scaling both
keeps the prior's split (a dearer link looks cheaper in longer slices). The median, not the least
as for the compute: a slice's cost drifts with this host's load for whole runs (tcp's 10.5 ms
prior slice took 14.5-21.8 ms) and the next request pays the typical cost; one spike moves a
median of 24 by at most one rank."""


@dataclass(frozen=True, slots=True)
class Choice:
    """One request's answer: pipelined or not, and a slice every ``every`` prefill steps."""

    pipelined: bool
    every: int = 1


class AutoPipelining:
    """See the module docstring. ``link`` None (a data plane with no measured cost): always
    pipelined. ``bytes_per_token``: the KV one token sends."""

    def __init__(self, link: TransportSpec | None, bytes_per_token: int) -> None:
        self.link = link
        self.bytes_per_token = require_int("bytes_per_token", bytes_per_token, min=1)
        self.samples: dict[bool, deque[float]] = {m: deque(maxlen=WINDOW) for m in (True, False)}
        """Seconds per computed token of recent requests, by whether slices were sent beside
        the steps."""
        self.unseen = {True: 0, False: 0}
        """Requests observed in the other mode since this one's last observation."""
        self.link_s_per_byte: deque[float] = deque(maxlen=LINK_WINDOW)
        """Seconds per byte of the recent ops the worker sent, the op overhead taken off."""

    def observe_link(self, busy_s: Sequence[float], nbytes: Sequence[int]) -> None:
        """A request's sent ops: each one's own link seconds (``RequestTimes.slice_busy_s``,
        waiting behind earlier ops excluded) and bytes, in the same order. Lengths that differ
        (a slice not done) or ops with no bytes or no time are ignored; an op faster than the
        overhead counts as free bytes."""
        if self.link is None or len(busy_s) != len(nbytes):
            return
        for seconds, n in zip(busy_s, nbytes, strict=True):
            if n > 0 and seconds > 0:
                self.link_s_per_byte.append(max(seconds - self.link.op_overhead_s, 0.0) / n)

    def learned_link(self, prior: TransportSpec) -> TransportSpec:
        """The link the model is asked with: ``prior`` with the bandwidth of the median recent
        seconds per byte (``prior`` itself before any op is observed, or if that median is 0)."""
        s_per_byte = statistics.median(self.link_s_per_byte) if self.link_s_per_byte else 0.0
        if s_per_byte <= 0.0:
            return prior
        return dataclasses.replace(prior, bandwidth_bytes_s=1.0 / s_per_byte)

    def observe(self, pipelined: bool, tokens: int, seconds: float) -> None:
        """A request that computed ``tokens`` in ``seconds`` of steps (more than one step, so
        a pipelined one had slices in flight) in the given mode."""
        if tokens <= 0 or seconds <= 0:
            return
        self.samples[pipelined].append(seconds / tokens)
        self.unseen[pipelined] = 0
        self.unseen[not pipelined] += 1

    def token_s(self, pipelined: bool) -> float:
        """The mode's cost per computed token: the least of its recent requests' (at least
        one observed)."""
        return min(self.samples[pipelined])

    def choose(self, tokens: int, loaded: int, step: int) -> Choice:
        """The mode for a request of ``tokens`` prompt tokens, ``loaded`` of them already in
        KV, computed ``step`` tokens a step: the model's best unless it is predicted less
        than :data:`MARGIN` faster than a slice per step."""
        if self.link is None or tokens - loaded <= step:
            return Choice(True)
        seen = {m: len(self.samples[m]) for m in (True, False)}
        if min(seen.values()) < EXPLORE:
            return Choice(seen[True] <= seen[False])
        for mode in (True, False):
            if self.unseen[mode] >= REFRESH:
                return Choice(mode)
        link = self.learned_link(self.link)
        quiet = self.token_s(False)
        steps = -(-(tokens - loaded) // step)
        contention = contention_of(self.token_s(True), quiet, steps)
        spec = PrefillSpec(token_s=quiet, slice_tokens=step, contention=contention)
        best = choose_pipelining(spec, link, self.bytes_per_token, tokens, loaded)
        ttft = {
            c: alone_ttft_s(c, link, self.bytes_per_token, tokens, loaded) for c in (best, spec)
        }
        if ttft[best] > (1.0 - MARGIN) * ttft[spec]:
            return Choice(True)
        return Choice(best.pipelined, best.slice_tokens // step if best.pipelined else 1)
