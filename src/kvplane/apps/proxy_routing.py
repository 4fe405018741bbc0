"""Which vLLM engine the proxy sends a request to: ``round-robin`` or ``cache-aware``.

Owns :class:`RoutingConfig` (the policy, the engines' KV event addresses, the optional key
scheme overrides and the events' secret rule) and :class:`EnginePicker`. Cache-aware reuses the
router's parts, never re-implements them: one :class:`~kvplane.serving.router.kv_subscriber.
KVEventSubscriber` and :class:`~kvplane.serving.router.prefix_index.PrefixIndex` per engine
(fed by its connector's publisher), the key scheme the engines describe
(:class:`~kvplane.apps.proxy_schemes.EngineSchemes`) and :meth:`CacheRouting.pick` with the
proxy's own in-flight load per engine as the queue: each request's uncached prompt tokens and,
where the engine runs it whole (``direct``), its decode budget (:func:`decode_tokens`). A
prompt given as text is tokenized by an engine's ``/tokenize``. Moves no KV.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvplane.apps.proxy_requests import ClientRequest, tokenize_body
from kvplane.apps.proxy_schemes import FIELDS, EngineSchemes
from kvplane.apps.proxy_upstream import Call, Upstream, UpstreamError
from kvplane.config import secret_or_insecure
from kvplane.errors import ConfigError, InvalidArgumentError
from kvplane.ids import ChunkKey
from kvplane.serving.kv_describe import MAX_KEY_ROOT
from kvplane.serving.router.kv_subscriber import EventSource, KVEventSubscriber
from kvplane.serving.router.prefix_index import PrefixIndex, PrefixMatch
from kvplane.serving.router.route_policy import CacheRouting, RoutePolicy
from kvplane.serving.router.router import PENDING_GRACE_S
from kvplane.serving.worker_config import split_address
from kvplane.validators import is_int, require_bool, require_int

_HEX_RE = re.compile(r"^(?:[0-9a-f]{2})+$")
PENDING_MAX_S = 3600.0
"""How long a picked request's chunks may stay expected while it runs (its end settles them)."""
DEFAULT_MAX_TOKENS = 16
"""The decode budget of a request that names none: vLLM's (and OpenAI's) completions default.
A chat request without one may decode up to the model's context; it counts the same."""


def split_list(text: str | None) -> tuple[str, ...]:
    """``text``'s comma-separated items, stripped (empty for None or "")."""
    return tuple(item.strip() for item in (text or "").split(",")) if text else ()


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How the proxy picks among the engines a request may run on (the prefill servers in the
    PD modes, the engines in ``direct``). Cache-aware needs each engine's connector KV events
    (``kv_events``: ``tcp://HOST:PORT`` of its ``kv_events_port``, comma-separated in the
    engines' order; replays on PORT+1), whose publishers describe their key scheme; the four
    scheme fields (``key_root`` hex, ``hash_seed``, vLLM's ``block_size``,
    ``blocks_per_chunk``) are optional overrides that must agree with them. The events are
    read with the cluster secret (``kv_events_secret_file`` or ``KVPLANE_SECRET``) unless
    ``kv_events_insecure``."""

    policy: str = RoutePolicy.ROUND_ROBIN.value
    kv_events: str | None = None
    kv_events_secret_file: str | None = None
    kv_events_insecure: bool = False
    key_root: str | None = None
    hash_seed: int | None = None
    block_size: int | None = None
    blocks_per_chunk: int | None = None

    def __post_init__(self) -> None:
        try:
            policy = RoutePolicy.parse(self.policy)
        except InvalidArgumentError as exc:
            raise ConfigError(f"--policy: {exc}") from None
        require_bool("--kv-events-insecure", self.kv_events_insecure, error=ConfigError)
        if policy is RoutePolicy.ROUND_ROBIN:
            given = [f for f in ("kv_events", *FIELDS) if getattr(self, f) is not None]
            if given:
                flags = " and ".join("--" + f.replace("_", "-") for f in given)
                raise ConfigError(f"{flags}: read only with --policy cache-aware")
            return
        if not self.kv_events:
            raise ConfigError("--policy cache-aware needs --kv-events tcp://HOST:PORT[,...]")
        for address in split_list(self.kv_events):
            host_port = split_address("--kv-events", address)
            if host_port is None or host_port[1] in (0, 65535):
                raise ConfigError(f"--kv-events must be tcp://HOST:PORT (PORT < 65535), got "
                                  f"{address!r:.80}")  # fmt: skip
        if self.key_root is not None and (
            not isinstance(self.key_root, str) or not _HEX_RE.match(self.key_root)
        ):
            raise ConfigError(f"--key-root must be lowercase hex, got {self.key_root!r:.80}")
        if self.key_root is not None and len(self.key_root) > 2 * MAX_KEY_ROOT:
            raise ConfigError(f"--key-root is over {MAX_KEY_ROOT} bytes")
        for name, least in (("hash_seed", 0), ("block_size", 1), ("blocks_per_chunk", 1)):
            if getattr(self, name) is not None:
                flag = "--" + name.replace("_", "-")
                require_int(flag, getattr(self, name), min=least, error=ConfigError)

    def overrides(self) -> dict[str, int | str]:
        """The key scheme fields given (by :data:`~kvplane.apps.proxy_schemes.FIELDS` name)."""
        return {f: getattr(self, f) for f in FIELDS if getattr(self, f) is not None}

    @property
    def cache_aware(self) -> bool:
        return RoutePolicy.parse(self.policy) is RoutePolicy.CACHE_AWARE

    def sources(self) -> tuple[EventSource, ...]:
        """Each engine's event publisher: PUB on its address, replays on the next port."""
        out = []
        for address in split_list(self.kv_events):
            host, _, port = address.rpartition(":")
            out.append(EventSource(address, f"{host}:{int(port) + 1}"))
        return tuple(out)

    def check_engines(self, n: int, what: str) -> None:
        """``ConfigError`` unless ``kv_events`` (when given) names one publisher for each of
        the ``n`` routed servers (``what``: their kind, for the message)."""
        events = split_list(self.kv_events)
        if events and len(events) != n:
            raise ConfigError(
                f"--kv-events names {len(events)} publisher(s) for {n} {what}(s): one each, "
                "in order"
            )

    def secret(self, env: Mapping[str, str]) -> bytes | None:
        """The events' secret (None: ``kv_events_insecure``); ``ConfigError`` for neither or
        both, as the connector's publisher is configured (:func:`secret_or_insecure`)."""
        return secret_or_insecure(
            self.kv_events_secret_file, env, prefix="kv_events", insecure=self.kv_events_insecure,
            needs="--policy cache-aware reads the engines' KV events and needs",
            so_that="only the cluster's engines are believed", otherwise="to read them plainly",
        )  # fmt: skip


def prompt_token_ids(req: ClientRequest, chat: bool, engines: Sequence[Upstream]) -> list[int]:
    """The prompt's token ids: the client's own, else (text, chat messages) the first engine's
    ``/tokenize`` answer, trying the next on a failure to reach one. ``UpstreamError``, one line
    naming ``/tokenize``: the engine's own 4xx status for a refusal (vLLM started with
    ``--skip-tokenizer-init`` answers 400: it could not run a text prompt either), 502 when
    none answered with token ids."""
    if req.token_ids is not None:
        return list(req.token_ids)
    body, failure = tokenize_body(req, chat), None
    for engine in engines:
        try:
            with Call(engine, "/tokenize", body, {}) as call:
                call.send()
                tokens = call.answer().get("tokens")
        except UpstreamError as exc:
            if 400 <= exc.status < 500:
                raise UpstreamError(exc.status, f"cache-aware routing: /tokenize: {exc}") from None
            failure = exc
            continue
        if isinstance(tokens, list) and all(is_int(t) for t in tokens):
            return [int(t) for t in tokens]
        failure = engine.fail("/tokenize answered no 'tokens' list")
    raise UpstreamError(502, f"cache-aware routing cannot tokenize the prompt: {failure}")


def decode_tokens(body: Mapping[str, Any]) -> int:
    """The tokens a request body may decode: ``max_completion_tokens`` (a chat's), else
    ``max_tokens``, else :data:`DEFAULT_MAX_TOKENS` (also for a value that is not an int >= 0,
    which the engine refuses anyway)."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if is_int(value) and value >= 0:
            return int(value)
    return DEFAULT_MAX_TOKENS


class Lease:
    """One request's engine (:attr:`index` into the picker's engines), holding its load
    (:attr:`queued` tokens) in that engine's queue until closed (``with``: a failure drops the
    chunks it was expected to store)."""

    def __init__(self, picker: EnginePicker, index: int, token: str, queued: int) -> None:
        self.picker, self.index, self.token, self.queued = picker, index, token, queued

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.picker.release(self, ok=exc_type is None)


class EnginePicker:
    """Picks one of ``engines`` per request by ``config``'s policy (see the module docstring).
    ``secret``: the events' (None: plain). Cache-aware, it asks the engines' key scheme before
    it returns (``ConfigError`` as :meth:`EngineSchemes.start` says; ``describe_s``: how long
    each engine is waited for). Thread-safe; :meth:`close` stops the subscribers."""

    def __init__(
        self,
        engines: Sequence[Upstream],
        config: RoutingConfig,
        secret: bytes | None,
        *,
        describe_s: float = 2.0,
    ) -> None:
        if not engines:
            raise InvalidArgumentError("an engine picker needs at least one engine")
        self.engines = tuple(engines)
        self.names = tuple(e.url for e in self.engines)
        self.cache = CacheRouting() if config.cache_aware else None
        self.schemes: EngineSchemes | None = None
        self._lock = threading.Lock()
        self._turn = 0
        self._serial = itertools.count()
        self._queued: Counter[str] = Counter()
        self.picked: Counter[str] = Counter()
        """Requests picked per engine URL, ever (see :meth:`snapshot`)."""
        self.indexes: tuple[PrefixIndex, ...] = ()
        self.subscribers: list[KVEventSubscriber] = []
        if self.cache is None:
            return
        sources = config.sources()
        config.check_engines(len(self.engines), "engine")
        self.indexes = tuple(PrefixIndex() for _ in sources)
        try:
            for src, index in zip(sources, self.indexes, strict=True):
                self.subscribers.append(KVEventSubscriber([src], secret=secret, index=index))
            schemes = EngineSchemes(self.names, self.subscribers, config.overrides(),
                                    timeout_s=describe_s)  # fmt: skip
            self.schemes = schemes
            schemes.start()
        except BaseException:
            self.close()
            raise
        for sub in self.subscribers:
            sub.start()

    def _routing(self) -> CacheRouting | None:
        """Cache-aware routing with the engines' agreed key scheme as it stands now."""
        cache, schemes = self.cache, self.schemes
        if cache is not None and schemes is not None and cache.scheme is not schemes.keys:
            cache = self.cache = dataclasses.replace(cache, scheme=schemes.keys)
        return cache

    def matches(
        self, token_ids: Sequence[int], *, now: float | None = None
    ) -> dict[str, PrefixMatch]:
        """Each engine's cached prefix of ``token_ids`` as its events tell (by engine URL;
        none: no chunk of it held), pending holdings live at ``now`` included."""
        cache = self._routing()
        return self._matches(cache.keys(token_ids) if cache else [], now)

    def _matches(self, keys: Sequence[ChunkKey], now: float | None) -> dict[str, PrefixMatch]:
        out = {}
        refused = self.schemes.refused if self.schemes is not None else []
        for i, (name, index) in enumerate(zip(self.names, self.indexes, strict=True)):
            got = index.longest_prefix(keys, now=now) if keys and not refused[i] else {}
            if got:  # one publisher per index; a renamed one's stale rows: the longest
                out[name] = max(got.values(), key=lambda m: (m.any_tier, m.worker))
        return out

    def pick(self, token_ids: Sequence[int] | None, body: Mapping[str, Any] | None = None) -> Lease:
        """The engine for a request of ``token_ids`` (needed by cache-aware; None otherwise):
        round-robin's next, or :meth:`CacheRouting.pick` over the engines with their queues
        and cached prefixes (ties: the prompt's first chunk key's rendezvous winner); the
        chunks it will store are then expected there (:meth:`PrefixIndex.expect`) until its
        events confirm them or the lease ends. The request's load, queued on the engine until
        the lease ends, is the one rule: its uncached prompt tokens plus, when ``body`` is
        given (the engine runs the request whole, decode included), :func:`decode_tokens`."""
        cache = self._routing()
        if cache is None or self.schemes is None:
            with self._lock:
                k, self._turn = self._turn % len(self.engines), self._turn + 1
                self.picked[self.names[k]] += 1
            return Lease(self, k, "", 0)
        if token_ids is None:
            raise InvalidArgumentError("a cache-aware pick needs the prompt's token ids")
        keys: list[ChunkKey] = cache.keys(token_ids)
        now, tokens = time.monotonic(), max(1, len(token_ids))
        matches = self._matches(keys, now)
        with self._lock:
            k = cache.pick(
                self.names, self._turn, queued=self._queued, matches=matches,
                prompt_tokens=tokens, first_key=keys[0] if keys else None,
            )  # fmt: skip
            name = self.names[k]
            queued = cache.uncached_tokens(matches.get(name), tokens)
            queued += decode_tokens(body) if body is not None else 0
            self._turn += 1
            self._queued[name] += queued
            self.picked[name] += 1
            token = f"proxy.{next(self._serial)}"
        workers = self.indexes[k].workers()  # before its describe answer: its first chunk's
        worker = self.schemes.worker(k) or (workers[0] if len(workers) == 1 else None)
        if keys and worker is not None:
            self.indexes[k].expect(token, worker, keys, until=now + PENDING_MAX_S)
        return Lease(self, k, token, queued)

    def release(self, lease: Lease, *, ok: bool) -> None:
        """End ``lease``: its tokens leave the queue; its expected chunks stay at most
        :data:`PENDING_GRACE_S` more when ``ok`` (for the engine's events), else go now."""
        if self.cache is None:
            return
        with self._lock:
            name = self.names[lease.index]
            self._queued[name] -= lease.queued
            if self._queued[name] <= 0:
                del self._queued[name]
        if not ok and self.schemes is not None:
            self.schemes.forget(lease.index)  # it may have restarted as something else
        index = self.indexes[lease.index]
        index.settle(lease.token, ok=ok, until=time.monotonic() + PENDING_GRACE_S)

    def queued(self) -> dict[str, int]:
        """The load in flight per engine URL (:meth:`pick`; engines with none left out)."""
        with self._lock:
            return dict(self._queued)

    def snapshot(self) -> dict[str, Any]:
        """Requests picked per engine and, cache-aware, each subscriber's counters."""
        subs = {n: s.snapshot() for n, s in zip(self.names, self.subscribers, strict=False)}
        with self._lock:
            picked = dict(self.picked)
        return {"picked": picked, "kv_events": subs}

    def close(self) -> None:
        if self.schemes is not None:
            self.schemes.close()
        for sub in self.subscribers:
            sub.close()
