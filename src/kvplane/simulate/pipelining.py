"""``--pipelining auto``: a prefill worker's per-request choice, asked of the simulator's model.

:class:`AutoPipelining` learns the worker's own prefill cost per token twice -- steps computed
while slices were being sent (pipelined requests) and steps with nothing sent beside them (on a
2-core host the shm copy and the KV writes share memory bandwidth, so the first are slower) --
and answers each request with :func:`~kvplane.simulate.timing.choose_pipelining` on its link's
op cost (:data:`~kvplane.simulate.calibrate.PD_LINKS`). Until both costs are known it explores:
pipelined first, then one request not. Plain state, no I/O, no clock; the worker feeds it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.simulate.spec import PrefillSpec, TransportSpec
from kvplane.simulate.timing import choose_pipelining
from kvplane.validators import require_int

SMOOTHING = 0.3
"""Weight of a new request's per-token cost in the running average."""


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
        self.token_s: dict[bool, float] = {}
        """Seconds per computed token, by whether slices were sent beside the steps."""

    def observe(self, pipelined: bool, tokens: int, seconds: float) -> None:
        """A request that computed ``tokens`` in ``seconds`` of steps (more than one step, so
        a pipelined one had slices in flight) in the given mode."""
        if tokens <= 0 or seconds <= 0:
            return
        got = seconds / tokens
        old = self.token_s.get(pipelined)
        self.token_s[pipelined] = got if old is None else old + SMOOTHING * (got - old)

    def choose(self, tokens: int, loaded: int, step: int) -> Choice:
        """The mode for a request of ``tokens`` prompt tokens, ``loaded`` of them already in
        KV, computed ``step`` tokens a step."""
        if self.link is None or tokens - loaded <= step:
            return Choice(True)
        for mode in (True, False):
            if mode not in self.token_s:
                return Choice(mode)
        busy = PrefillSpec(token_s=self.token_s[True], slice_tokens=step)
        quiet = PrefillSpec(token_s=self.token_s[False], slice_tokens=step)
        best = choose_pipelining(busy, self.link, self.bytes_per_token, tokens, loaded, quiet=quiet)
        return Choice(best.pipelined, best.slice_tokens // step if best.pipelined else 1)
