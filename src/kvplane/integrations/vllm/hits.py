"""Hit claims of the connector's scheduler side: how many tokens past vLLM's local hit to load.

Owns :class:`Hits` (vLLM's ``get_num_new_matched_tokens``: the hit, "ask again", sync or async,
discovery in a shared store) and :func:`load_start` (where a load for a hit starts: the first
block vLLM holds, on whole chunks of every lower tier). With a sliding window a hit needs only
the chunks of its end's window; under vLLM's hybrid manager each group claims under a cap and
settles the end the groups agreed on (:meth:`Hits.claim`, :meth:`Hits.settle`). No tier state
changes, no tensors, no vLLM import. See
``docs/vllm.md`` ("The scheduler side", "Sliding windows and hybrids").
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.chunks import ChunkSpec
from kvplane.ids import ChunkKey
from kvplane.integrations.vllm.request_state import Match, RequestTable, RequestView
from kvplane.integrations.vllm.store_probe import StoreProbe
from kvplane.integrations.vllm.windows import KVWindow, first_kept_block
from kvplane.metrics import MetricsRegistry
from kvplane.offload.book import TierBook


@dataclass(frozen=True, slots=True)
class LoadGrid:
    """How a load lies on a request's chunks: ``spec``, ``align`` (host chunks per chunk of
    every lower tier: a load starts on a whole group) and vLLM's sliding ``window``."""

    spec: ChunkSpec
    align: int = 1
    window: KVWindow | None = None

    def load_start(self, num_computed: int, end: int) -> tuple[int, int]:
        """``(first block, first chunk)`` of a load of tokens ``[num_computed, end)``: the first
        block vLLM holds once ``end`` tokens are computed (none before the window of token
        ``end``, none before ``num_computed``), and the chunk holding it, rounded down to a
        whole chunk of every lower tier (the blocks between are not written)."""
        bs = self.spec.block_size
        first_block = max(num_computed // bs, first_kept_block(self.window, end))
        first = first_block // self.spec.blocks_per_chunk
        return first_block, first - first % self.align


class Hits:
    """The scheduler side's matches over ``book``; ``load_mode`` (``sync``, ``async``,
    ``auto``) says when a load runs asynchronously; ``probe`` (set by the handshake) asks a
    shared store. Not thread-safe."""

    def __init__(
        self,
        book: TierBook,
        requests: RequestTable,
        grid: LoadGrid,
        load_mode: str,
        metrics: MetricsRegistry,
    ) -> None:
        self.book = book
        self.requests = requests
        self.grid = grid
        self.load_mode = load_mode
        self.probe: StoreProbe | None = None
        self._m_retry = metrics.counter("vllm_ask_again", "Lookups answered 'ask again'")
        self._m_found = metrics.counter(
            "vllm_discovered_chunks", "Chunks other engines published, found in the shared store"
        )

    def match(self, view: RequestView, num_computed: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed`` (block aligned, local hit) that kvplane can load now,
        or ``None`` to be asked again later, and whether that load runs asynchronously (False
        with no tokens). Remembers the answer for the load planned next. Changes no tier
        state (only memoises the request's hashes) but for the shared store's chunks a
        request's first call discovers. The caller checks ``eligible``, ``readable`` and the
        block alignment of ``num_computed``."""
        claim = self.claim(view, num_computed)
        if claim is None:
            self.ask_again()
            return None, False
        return self.settle(view, num_computed, *claim)

    def claim(
        self, view: RequestView, num_computed: int, cap: int | None = None
    ) -> tuple[int, int] | None:
        """``(first chunk, end chunk)`` of the longest hit ending at chunk ``cap`` or before
        (:meth:`_claim`; ``None``: no cap), ``None`` for "ask again". Remembers nothing: a
        hybrid model's groups first agree on one end
        (:class:`~.hybrid_scheduler.HybridScheduler`), then each group settles it
        (:meth:`settle`)."""
        return self._claim(self._keys(view), num_computed, cap)

    def ask_again(self) -> None:
        """Count an "ask again" answer."""
        self._m_retry.inc()

    def settle(
        self, view: RequestView, num_computed: int, first: int, end: int, force_async: bool = False
    ) -> tuple[int, bool]:
        """Answer the hit of chunks ``[first, end)`` (a :meth:`claim`): its tokens past
        ``num_computed`` and whether its load runs asynchronously (``force_async``: always,
        with tokens); remembered as the request's :class:`~.request_state.Match`."""
        keys = self._keys(view)
        tokens = max(end * self.grid.spec.tokens_per_chunk - num_computed, 0)
        load_async = tokens > 0 and (force_async or self._load_async(keys[first:], end - first))
        self.requests.state(view).match = Match(num_computed, end - first, load_async)
        return tokens, load_async

    def _keys(self, view: RequestView) -> list[ChunkKey]:
        """The request's chunk keys short of its last token (never a hit: vLLM computes it).
        A request's first call first asks the shared store about the chunks past the known
        hit run and adopts what it holds (:meth:`~kvplane.offload.book.TierBook.to_discover`,
        ``discovered``)."""
        limit = max(view.num_tokens - 1, 0)
        req = self.requests.state(view)
        req.keys.extend(view.token_ids, limit)
        keys = req.keys.chunk_keys(limit)
        if self.probe is not None and not req.discovered:
            req.discovered = True  # once per request: a waiting request is matched each step
            asked = self.book.to_discover(keys)
            if asked:
                self._m_found.inc(len(self.book.discovered(asked, self.probe.held(asked))))
        return keys

    def _claim(
        self, keys: list[ChunkKey], num_computed: int, cap: int | None = None
    ) -> tuple[int, int] | None:
        """``(first chunk, end chunk)`` of the longest hit ending at chunk ``cap`` or before,
        ``None`` for "ask again".

        A hit ending at chunk ``end`` needs the chunks ``[first, end)`` a load of it reads
        (:meth:`LoadGrid.load_start`: with a window, only the window of token ``end``; a held
        late chunk proves its prefix, its key hashes it) loadable now
        (:meth:`~kvplane.offload.book.TierBook.loadable`: only as far as host can promote, so
        the load keeps the promise; ``None`` when a missing one is being stored into host).
        From the longest ``end``, each miss moves ``end`` to the first chunk missing, whose
        window starts no later; it ends on a hit or when nothing past ``first`` is left."""
        tpc = self.grid.spec.tokens_per_chunk
        end = len(keys) if cap is None else min(cap, len(keys))
        _b, first = self.grid.load_start(num_computed, end * tpc)
        while end > first:
            run = self.book.loadable(keys[first:])  # keys past end: whole lower-tier chunks
            if run is None:
                return None
            if run >= end - first:
                return first, end
            end = first + run
            _b, start = self.grid.load_start(num_computed, end * tpc)
            if start == first:  # the same window start: [first, end) was just found loadable
                return first, end
            first = start
        return first, first

    def _load_async(self, keys: list[ChunkKey], run: int) -> bool:
        """``load_mode``: ``sync`` never, ``async`` always, ``auto`` when one of the first
        ``run`` chunks of ``keys`` (the load's) comes from a tier below host."""
        if self.load_mode != "auto":
            return self.load_mode == "async"
        return any(src != "host" for src in self.book.sources(keys)[:run])
