"""Exact offline models of the prefill workers' prefix caches, for ``kvplane bench routing``:
the hit rate a given assignment of requests to workers gets, and the oracle's.

Each worker's cache is the real bookkeeping of its host tier (an
:class:`~kvplane.offload.manager.OffloadManager` with the same slots, LRU policy and
admission), driven as :class:`~kvplane.serving.prefix_offload.PrefixOffload` drives it: look
the prompt's chunk keys up, load the leading hits but never the chunk holding the last token,
then store the prompt's first ``slots`` chunks. Requests run one at a time (each store done
before the next lookup). Pure: no tensors, no clocks. Definitions: docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvplane.blocks.hashing import BlockHasher
from kvplane.chunks import ChunkSpec
from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey
from kvplane.offload.manager import OffloadManager
from kvplane.serving.router.route_policy import ChunkKeyScheme
from kvplane.validators import require_int

Chooser = Callable[[int, Sequence[int]], int]
"""``(request index, each worker's loadable cached chunks) -> worker index``."""


@dataclass(frozen=True, slots=True)
class Replay:
    """What a replay got: per request its ``workers`` index and ``loaded`` chunks; the
    prompts' ``prompt_tokens`` and ``tokens_per_chunk``."""

    workers: tuple[int, ...]
    loaded: tuple[int, ...]
    prompt_tokens: int
    tokens_per_chunk: int

    @property
    def hit_rate(self) -> float:
        """Prompt tokens loaded from a cache instead of computed / prompt tokens."""
        return sum(self.loaded) * self.tokens_per_chunk / self.prompt_tokens


class WorkerCache:
    """One prefill worker's host tier, driven as the worker drives it (module docstring)."""

    def __init__(self, slots: int, spec: ChunkSpec) -> None:
        self.slots = require_int("slots", slots, min=1)
        self.spec = spec
        self.manager = OffloadManager("host", slots)

    def loadable(self, keys: Sequence[ChunkKey], num_tokens: int) -> int:
        """Chunks a request of ``num_tokens`` tokens with chunk ``keys`` would load here now
        (counts nothing, changes nothing)."""
        run = next((i for i, k in enumerate(keys) if not self.manager.is_hit(k)), len(keys))
        return min(run, (num_tokens - 1) // self.spec.tokens_per_chunk)

    def serve(self, keys: Sequence[ChunkKey], num_tokens: int) -> int:
        """Serve one request: look up, load, store; the chunks it loaded."""
        if not keys:
            return 0
        found = self.manager.lookup(keys)
        loaded = min(found.hit_run, (num_tokens - 1) // self.spec.tokens_per_chunk)
        if loaded:
            plan = self.manager.prepare_load(keys[:loaded])
            self.manager.complete_load(plan.keys)
        plan_store = self.manager.prepare_store(keys[: self.slots])
        if plan_store is not None and plan_store.keys:
            self.manager.complete_store(plan_store.keys, True)
        return loaded


def replay(
    prompts: Sequence[Sequence[int]],
    workers: int,
    slots: int,
    spec: ChunkSpec,
    choose: Chooser,
) -> Replay:
    """Serve ``prompts`` in order on ``workers`` fresh caches of ``slots`` chunks each, each
    request on the worker ``choose`` names."""
    require_int("workers", workers, min=1)
    scheme = ChunkKeyScheme(BlockHasher(seed=0, fingerprint=b"kvplane-bench-routing"), spec)
    caches = [WorkerCache(slots, spec) for _ in range(workers)]
    picked: list[int] = []
    loaded: list[int] = []
    for n, tokens in enumerate(prompts):
        keys = scheme.keys(tokens)
        w = choose(n, [c.loadable(keys, len(tokens)) for c in caches])
        if not 0 <= w < workers:
            raise InvalidArgumentError(f"request {n}: worker {w} chosen, of {workers}")
        picked.append(w)
        loaded.append(caches[w].serve(keys, len(tokens)))
    total = sum(len(p) for p in prompts)
    if total == 0:
        raise InvalidArgumentError("a replay needs at least one prompt token")
    return Replay(tuple(picked), tuple(loaded), total, spec.tokens_per_chunk)


def oracle_choice(n: int, loadable: Sequence[int]) -> int:
    """The oracle's pick for request ``n``: the worker with the most loadable cached chunks,
    exact ties to the first from worker ``n mod workers`` on (rotation, so that cold requests
    spread over the workers as round-robin spreads them)."""
    count = len(loadable)
    order = [(n + i) % count for i in range(count)]
    return max(order, key=lambda w: (loadable[w], -order.index(w)))


def router_round_robin(decode: int, prefill: int) -> Chooser:
    """The prefill pick of the router's round-robin over ``decode`` decode and ``prefill``
    prefill workers, every pair vetted: request ``n`` goes to decode worker ``n mod decode``,
    whose own cursor (its requests so far) picks the prefill worker."""
    require_int("decode", decode, min=1)
    require_int("prefill", prefill, min=1)

    def choose(n: int, loadable: Sequence[int]) -> int:
        return (n // decode) % prefill

    return choose
