"""The routed engines' chunk key scheme as the proxy learns it: from their publishers' describe.

:class:`EngineSchemes` asks each engine's KV event publisher who it is and how it keys chunks
(:meth:`~kvplane.serving.router.kv_subscriber.KVEventSubscriber.describe`) when the proxy
starts, all at once; the scheme flags (``--key-root``, ``--hash-seed``, ``--block-size``,
``--blocks-per-chunk``) are optional overrides that must agree with every answer. At start a
disagreement, or two engines announcing different schemes, is a one-line ``ConfigError``;
later (an engine that was down, failed a request or restarted is asked again every ``retry_s``
on a thread of its own) such an engine is left out of cache-aware matching and logged.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvplane.blocks.hashing import BlockHasher
from kvplane.chunks import ChunkSpec
from kvplane.errors import ConfigError, MalformedMessageError, TransferTimeoutError
from kvplane.serving.kv_describe import Description, KeyScheme
from kvplane.serving.router.kv_subscriber import KVEventSubscriber
from kvplane.serving.router.route_policy import ChunkKeyScheme
from kvplane.validators import require_finite_positive

log = logging.getLogger(__name__)
FIELDS = ("key_root", "hash_seed", "block_size", "blocks_per_chunk")
"""The scheme's fields, as :meth:`KeyScheme.fields` and the proxy's flags name them."""


def chunk_keys(scheme: KeyScheme) -> ChunkKeyScheme:
    """The router's key function of ``scheme`` (what the engine itself computes)."""
    hasher = BlockHasher(scheme.hash_seed, scheme.key_root)
    return ChunkKeyScheme(hasher, ChunkSpec(scheme.block_size, scheme.blocks_per_chunk))


def full_scheme(overrides: Mapping[str, int | str]) -> KeyScheme | None:
    """The scheme ``overrides`` name when they give all four fields (key root in hex), else
    None."""
    if any(f not in overrides for f in FIELDS):
        return None
    root = bytes.fromhex(str(overrides["key_root"]))
    seed, size, per = (int(overrides[f]) for f in FIELDS[1:])
    return KeyScheme(seed, root, size, per)


def first_difference(
    a: Mapping[str, int | str], b: Mapping[str, int | str]
) -> tuple[str, int | str, int | str] | None:
    """The first of :data:`FIELDS` that both give and that differ: ``(field, a's, b's)``."""
    for f in FIELDS:
        if f in a and f in b and a[f] != b[f]:
            return f, a[f], b[f]
    return None


class EngineSchemes:
    """The key scheme of engines ``names`` (one subscriber each, same order), checked against
    ``overrides`` (see the module docstring). :attr:`scheme`: the agreed one (None: no engine
    has told it and the overrides do not give all four fields). Thread-safe."""

    def __init__(
        self,
        names: Sequence[str],
        subscribers: Sequence[KVEventSubscriber],
        overrides: Mapping[str, int | str],
        *,
        timeout_s: float = 2.0,
        retry_s: float = 1.0,
    ) -> None:
        self.names, self.subscribers = tuple(names), tuple(subscribers)
        self.overrides = dict(overrides)
        self.timeout_s = require_finite_positive("timeout_s", timeout_s)
        self.retry_s = require_finite_positive("retry_s", retry_s)
        self.scheme = full_scheme(self.overrides)
        self.keys: ChunkKeyScheme | None = None if self.scheme is None else chunk_keys(self.scheme)
        """The agreed scheme's key function (what cache-aware picks key a prompt by)."""
        self.described: list[Description | None] = [None] * len(self.names)
        self.refused = [False] * len(self.names)
        """Engines whose scheme is not the agreed one (left out of matching)."""
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._ask_again = [True] * len(self.names)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="proxy-schemes", daemon=True)

    def start(self) -> None:
        """Ask every engine at once and adopt the answers: ``ConfigError`` (one line naming
        the engine and the field) for an answer unlike an override or another engine's; then
        keep asking the unanswered ones on the thread."""
        with ThreadPoolExecutor(max(1, len(self.names))) as pool:
            answers = list(pool.map(self._ask, range(len(self.names))))
        for i, answer in enumerate(answers):
            if answer is not None:
                self._adopt(i, answer, strict=True)
        missing = [n for n, a in zip(self.names, answers, strict=True) if a is None]
        if missing:
            log.warning("kvplane proxy: no chunk key scheme yet from %s; asking again every "
                        "%s s", ", ".join(missing), self.retry_s)  # fmt: skip
        self._thread.start()

    def worker(self, i: int) -> str | None:
        """Engine ``i``'s event source id as it described itself (None: not yet)."""
        got = self.described[i]
        return None if got is None else got.origin.worker

    def forget(self, i: int) -> None:
        """Ask engine ``i`` again (it failed a request: it may have restarted otherwise)."""
        with self._lock:
            self._ask_again[i] = True

    def _notice_restart(self, i: int) -> None:
        """Ask engine ``i`` again when its events come from a newer incarnation than the one
        that described itself (it restarted, perhaps as another model)."""
        got = self.described[i]
        heard = None if got is None else self.subscribers[i].position(got.origin.worker)
        if got is not None and heard is not None and heard[0] > got.origin.incarnation:
            with self._lock:
                self._ask_again[i] = True

    def _ask(self, i: int) -> Description | None:
        """Engine ``i``'s answer with a scheme, or None (no answer, or no scheme yet)."""
        try:
            got = self.subscribers[i].describe(timeout_s=self.timeout_s)
        except (TransferTimeoutError, MalformedMessageError) as exc:
            self._count("describe_failures")
            log.debug("kvplane proxy: engine %s: %s", self.names[i], exc)
            return None
        with self._lock:
            if self.described[i] is None:  # its id, for pending holdings
                self.described[i] = Description(got.origin, None)
        return got if got.scheme is not None else None

    def _adopt(self, i: int, answer: Description, *, strict: bool) -> None:
        """Take engine ``i``'s ``answer``: the agreed scheme when none is yet; else checked
        against the overrides and the agreed scheme (``strict``: ``ConfigError``; otherwise
        the engine is refused and logged)."""
        if answer.scheme is None:
            return
        told, name = answer.scheme.fields(), self.names[i]
        wrong = first_difference(self.overrides, told)
        problem = None
        if wrong is not None:
            field, flag, said = wrong
            problem = (f"--{field.replace('_', '-')} {flag} disagrees with engine {name}, whose "
                       f"KV events say {field} {said}")  # fmt: skip
        with self._lock:
            agreed = self.scheme
            other = first_difference(agreed.fields(), told) if agreed is not None else None
            if problem is None and other is not None:
                first = next((self.names[k] for k, d in enumerate(self.described)
                              if d is not None and d.scheme == agreed), "the flags")  # fmt: skip
                problem = (f"engines {first} and {name} announce different chunk key schemes "
                           f"({other[0]} {other[1]} vs {other[2]})")  # fmt: skip
            if problem is not None and strict:
                raise ConfigError(problem)
            self.described[i], self._ask_again[i] = answer, False
            self.refused[i] = problem is not None
            if agreed is None and problem is None:
                self.scheme, self.keys = answer.scheme, chunk_keys(answer.scheme)
        if problem is not None:
            self._count("refused")
            log.warning("kvplane proxy: %s; its cache is not used for routing", problem)

    def _run(self) -> None:
        while not self._stop.wait(self.retry_s):
            for i in range(len(self.names)):
                self._notice_restart(i)
                with self._lock:
                    due = self._ask_again[i]
                answer = self._ask(i) if due else None
                if answer is not None:
                    self._adopt(i, answer, strict=False)

    def _count(self, key: str) -> None:
        with self._lock:
            self.counters[key] += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
