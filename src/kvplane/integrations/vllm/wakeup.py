"""The worker's one idle-step wait: every source of progress wakes it, the step waits once.

Owns :class:`Wakeup` (one event that offload jobs and PD sessions both signal),
:data:`IDLE_WAIT_S` and :func:`end_step` (what vLLM's ``get_finished`` returns, gathered from
every :class:`StepSource`, waiting up to :data:`IDLE_WAIT_S` on an idle step with nothing to
report). No vLLM import, no tier I/O. Why idle steps wait: ``docs/vllm.md`` ("The worker side").
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

IDLE_WAIT_S = 0.02
"""How long the worker side of an idle step (vLLM stepping only to hear of transfers and loads)
waits for one to progress when it has nothing to report: vLLM's loop otherwise spins a core and
starves the threads it waits for; a request arriving meanwhile is scheduled at most this much
later."""


class Wakeup:
    """One wake-up shared by every source of worker progress. A source changes its state first
    and then calls :meth:`notify`; a step calls :meth:`arm` before it looks at the sources, so a
    notification between the look and the :meth:`wait` is never lost. Thread-safe."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def notify(self) -> None:
        """Something progressed (any thread)."""
        self._event.set()

    def arm(self) -> None:
        """Forget earlier notifications: the caller is about to look at every source."""
        self._event.clear()

    def wait(self, timeout: float) -> bool:
        """Block until a notification since :meth:`arm` (True) or ``timeout`` seconds (False)."""
        return self._event.wait(timeout)


class StepSource(Protocol):
    """One half of the worker that vLLM's ``get_finished`` hears from (offload, PD)."""

    @property
    def busy(self) -> bool:
        """Work in flight that will progress without vLLM scheduling anything."""
        ...

    @property
    def has_news(self) -> bool:
        """Something harvested that this step hands vLLM anyway (reports, load errors)."""
        ...

    def finished(self, finished_req_ids: Sequence[str]) -> tuple[set[str], set[str]]:
        """(requests whose blocks vLLM may free now, requests whose KV arrived), each once."""
        ...


def end_step(
    sources: Sequence[StepSource],
    finished_req_ids: Sequence[str],
    idle: bool,
    wake: Wakeup,
    timeout: float = IDLE_WAIT_S,
) -> tuple[set[str], set[str]]:
    """vLLM's ``get_finished`` over every source: (finished sending, finished receiving).

    ``idle`` (vLLM scheduled no token: it steps only to hear of kvplane's work): when no source
    has anything to report and one is busy, wait up to ``timeout`` for any of them to progress,
    once, then look again. A step with work, or with news, never waits."""
    wake.arm()
    sent, got = _collect(sources, finished_req_ids)
    quiet = not (sent or got or any(s.has_news for s in sources))
    if idle and quiet and any(s.busy for s in sources):
        wake.wait(timeout)
        more_sent, more_got = _collect(sources, ())
        sent |= more_sent
        got |= more_got
    return sent, got


def _collect(
    sources: Sequence[StepSource], finished_req_ids: Sequence[str]
) -> tuple[set[str], set[str]]:
    sent: set[str] = set()
    got: set[str] = set()
    for source in sources:
        s, g = source.finished(finished_req_ids)
        sent |= s
        got |= g
    return sent, got
