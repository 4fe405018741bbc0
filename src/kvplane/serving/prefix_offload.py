"""Prefix offload for a prefill worker: finished prompts' chunks go device -> host -> disk, and a
new prompt's cached prefix comes back from the tiers instead of being computed.

Chunk keys are the request's own block hashes at chunk ends (:meth:`ChunkSpec.chunk_keys`).
:meth:`PrefixOffload.begin_load` loads the leading run of hits (never the chunk holding the last
token; of a window-only pool only the hit's window, possibly nothing) into the request's blocks,
untouched by the caller until :class:`LoadFinished`; a prefix still being stored here is waited
for (:mod:`~kvplane.serving.prefix_waits`). :meth:`PrefixOffload.store` stores every full chunk
after the last step (those that fit the host tier; the rest are counted and logged once). A
hybrid's prefix also needs its state (:mod:`~kvplane.serving.prefix_state`; a hit without it is
a miss). Not thread-safe: the worker loop owns it. See docs/serving.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvplane.blocks import BlockPool, BlockTable
from kvplane.chunks import ChunkSpec
from kvplane.errors import ConfigError, InvalidArgumentError
from kvplane.ids import ChunkKey, JobId, RequestId
from kvplane.metrics import MetricsRegistry
from kvplane.offload import LoadDone, OffloadConfig, StoreDone, TierCascade, build_cascade
from kvplane.offload.chunk_cost import TunedChunks
from kvplane.serving.prefix_groups import LoadJoin, common_run, group_tiers
from kvplane.serving.prefix_state import PrefixState
from kvplane.serving.prefix_waits import Parked, PrefixWaits
from kvplane.serving.producers.base import PoolTensor
from kvplane.validators import require_int, require_number

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefixSettings:
    """How a prefill worker offloads: the tiers (``offload``) and the host chunk size in
    blocks; ``tuned`` (a config's ``[tune.chunks]``) sets each tier's size from measurements
    (:meth:`~kvplane.offload.chunk_cost.TunedChunks.sizes`; a cold size set in ``offload``
    wins). ``pending_wait_s``: the longest an admitted request waits for this worker's own
    stores (in flight, or promised by a computing request) of its prefix (0: never waits)."""

    offload: OffloadConfig
    blocks_per_chunk: int = 2
    tuned: TunedChunks | None = None
    pending_wait_s: float = 2.0

    def __post_init__(self) -> None:
        if not isinstance(self.offload, OffloadConfig):
            raise InvalidArgumentError(f"offload must be an OffloadConfig, got {self.offload!r}")
        require_int("PrefixSettings.blocks_per_chunk", self.blocks_per_chunk, min=1)
        if self.tuned is not None and not isinstance(self.tuned, TunedChunks):
            raise InvalidArgumentError(f"tuned must be a TunedChunks, got {self.tuned!r}")
        require_number("PrefixSettings.pending_wait_s", self.pending_wait_s, min=0)

    def resolved(self, block_bytes: int) -> tuple[int, OffloadConfig]:
        """The host ``blocks_per_chunk`` and the tier config for blocks of ``block_bytes``."""
        if self.tuned is None:
            return self.blocks_per_chunk, self.offload
        host, disk, remote = self.tuned.sizes(block_bytes, self.blocks_per_chunk)
        off = self.offload
        return host, dataclasses.replace(
            off,
            disk_blocks_per_chunk=off.disk_blocks_per_chunk or disk,
            remote_blocks_per_chunk=off.remote_blocks_per_chunk or remote,
            disk_gbps=off.disk_gbps or self.tuned.disk_gbps,
            remote_gbps=off.remote_gbps or self.tuned.remote_gbps,
        )


@dataclass(frozen=True, slots=True)
class LoadStarted:
    """A submitted prefix load: how many chunks and from which tier each comes (``ticket_id``
    0 and no chunks: a hit wholly before its window, nothing to load, or, with ``waiting``
    chunks, a request parked until this worker's stores of them land)."""

    ticket_id: int
    chunks: int
    sources: tuple[str, ...]
    waiting: int = 0


@dataclass(frozen=True, slots=True)
class LoadFinished:
    """A request's prefix load ended: ``tokens`` leading tokens are now in its device blocks."""

    request_id: RequestId
    tokens: int
    chunks: int
    failed: int


@dataclass(frozen=True, slots=True)
class StoreFinished:
    """A request's chunks left the device (``stored`` of them reached the host tier)."""

    request_id: RequestId
    stored: int


Finished = LoadFinished | StoreFinished


@dataclass(frozen=True, slots=True)
class _Load:
    """A load in flight: whose, from which tiers, the request's chunk keys and state slot,
    and the leading chunks it skips (before the hit's window) in the request's ``table``."""

    request_id: RequestId
    sources: tuple[str, ...]
    keys: tuple[ChunkKey, ...]
    state_slot: int | None
    skip: int = 0
    table: BlockTable | None = None


class PrefixOffload:
    """One prefill pool's prefix offload (see the module docstring). With KV cache groups
    (``kv.groups``) it is group 0's and holds one ``members`` offload per other group: a hit
    is the prefix every group holds (:mod:`~kvplane.serving.prefix_groups`), never parked."""

    def __init__(
        self,
        settings: PrefixSettings,
        kv: PoolTensor,
        block_pool: BlockPool,
        *,
        state: PoolTensor | None = None,
        metrics: MetricsRegistry | None = None,
        group_pools: Sequence[BlockPool] = (),
    ) -> None:
        """``state``: the worker's whole-only state pool, if its model has recurrent state;
        ``group_pools``: the block pools of ``kv.groups``. ``ConfigError`` for groups with a
        state pool."""
        bpc, offload = settings.resolved(kv.layout.bytes_per_block)
        if len(group_pools) != len(kv.groups):
            raise InvalidArgumentError(f"{len(kv.groups)} groups 1.. but {len(group_pools)} pools")
        if kv.groups and state is not None:
            raise ConfigError("prefix offload of KV cache groups with a recurrent state")
        self.spec = ChunkSpec(kv.layout.block_size, bpc)
        self.host_slots = offload.host_slots
        """The most chunks one store can hold: the host tier's slots (stores pass through it)."""
        self.cascade: TierCascade = build_cascade(
            offload,
            kv.layout,
            bpc,
            kv.tensor,
            metrics=metrics,
            block_pool=block_pool,
        )
        self.tiers = ("host", *(tier.name for tier, _m in self.cascade.lower))
        self.layout = kv.layout
        self._span = math.lcm(1, *self.cascade.book.spans.values())
        self._unfilled: weakref.WeakKeyDictionary[BlockTable, int] = weakref.WeakKeyDictionary()
        """Per request table, its leading chunks a window load left without KV (never stored)."""
        self.state: PrefixState | None = None
        self.members: tuple[PrefixOffload, ...] = ()
        """One offload per KV cache group 1.. (their own tiers, private metrics)."""
        self._join = LoadJoin()
        try:
            if state is not None:
                self.state = PrefixState(state, self.spec.tokens_per_chunk, offload)
            for g, (pt, pool) in enumerate(zip(kv.groups, group_pools, strict=True), 1):
                each = PrefixSettings(group_tiers(offload, g), bpc, pending_wait_s=0.0)
                self.members += (PrefixOffload(each, pt, pool),)
        except BaseException:
            self.close()
            raise
        self.hits: Counter[str] = Counter()
        """Chunks loaded into the device pool, by the tier they came from."""
        self.counts: Counter[str] = Counter()
        self._loads: dict[int, _Load] = {}
        self._ready: list[LoadFinished] = []
        """Hits with nothing to load, reported by the next :meth:`poll` or :meth:`wait`."""
        self._stores: dict[JobId, RequestId] = {}
        self.waits = PrefixWaits(settings.pending_wait_s)
        registry = metrics if metrics is not None else MetricsRegistry()
        self._m_hits = registry.counter(
            "prefill_prefix_chunks", "Prefix chunks loaded instead of computed, by tier", ["tier"]
        )
        self._m_tokens = registry.counter(
            "prefill_prefix_tokens", "Prompt tokens loaded from the offload tiers"
        )
        self._m_unstored = registry.counter(
            "prefill_prefix_chunks_unstored",
            "Prompt chunks not offloaded: the prompt has more chunks than the host tier slots",
        )
        self._told_unstored = False

    # -- keys ------------------------------------------------------------------------------------
    def chunk_keys(self, table: BlockTable) -> list[ChunkKey]:
        """Keys of the full chunks of ``table``'s tokens, in order: its block hashes at chunk
        ends (no hashing)."""
        return self.spec.chunk_keys(table.block_hashes)

    def _chunk_blocks(self, block_ids: tuple[int, ...], chunks: int) -> npt.NDArray[np.int64]:
        return np.asarray(block_ids[: chunks * self.spec.blocks_per_chunk], dtype=np.int64)

    @property
    def loading(self) -> int:
        """Loads in flight (a hit with nothing to load is one until its :class:`LoadFinished`
        is polled; with groups, one until every group's load ended)."""
        return len(self._loads) + len(self._ready) + len(self.waits) + len(self._join)

    @property
    def busy(self) -> bool:
        """Jobs in flight, finished loads not yet polled or parked requests (any group's)."""
        mine = self.cascade.jobs.in_flight or self._ready or len(self.waits)
        return bool(mine) or any(m.busy for m in self.members)

    # -- load and store --------------------------------------------------------------------------
    def begin_load(self, request_id: RequestId, table: BlockTable, state_slot: int | None = None,
                   *, groups: Sequence[BlockTable] = ()) -> LoadStarted | None:  # fmt: skip
        """Look the chunks of ``table`` (the request's admitted table: its prompt, blocks and
        block hashes) up and load the leading hits into its blocks (with a state pool: only
        chunks whose state is held, restored into ``state_slot`` when the load ends). ``None``:
        a miss (compute everything). Every other answer is followed by one
        :class:`LoadFinished`, also a hit no layer reads any more (window-only pool: no chunk
        is loaded, the prefill starts at the hit's end) and a request parked because its
        leading run goes on with chunks this worker is storing or a computing request promised
        (:meth:`expect`): it is looked up again once those stores ended (a failed one is a
        miss) or ``pending_wait_s`` passed, and loads what is loadable then. ``groups``: the
        request's tables of KV cache groups 1.. (:meth:`_begin_groups`)."""
        if len(groups) != len(self.members):
            raise InvalidArgumentError(f"{len(groups)} group tables for {len(self.members)}")
        if self.members:
            return self._begin_groups(request_id, [table, *groups])
        keys = self.chunk_keys(table)
        if not keys:
            return None
        if self.state is not None and state_slot is None:
            raise InvalidArgumentError("a prefix load with a state pool needs the state slot")
        self.counts["lookups"] += 1
        return self._begin(request_id, table, state_slot, keys, park=self.waits.wait_s > 0)

    def _begin(
        self,
        request_id: RequestId,
        table: BlockTable,
        state_slot: int | None,
        keys: list[ChunkKey],
        *,
        park: bool,
    ) -> LoadStarted | None:
        """:meth:`begin_load` after its checks; ``park``: a wait is allowed."""
        found = self.cascade.lookup(keys)
        limit = (table.num_tokens - 1) // self.spec.tokens_per_chunk
        loadable = min(found.hit_run, limit)
        if park:
            covered = self.waits.cover(keys[:limit], found.where[:limit], found.pending[:limit])
            if covered.run > loadable:
                deadline = time.monotonic() + self.waits.wait_s
                parked = Parked(request_id, table, state_slot, deadline,
                                set(covered.jobs), set(covered.requests))  # fmt: skip
                self.waits.park(parked)
                self.counts["pending_waits"] += 1
                return LoadStarted(0, 0, (), waiting=covered.run - loadable)
        if self.state is not None:
            with_state = self.state.loadable(keys[:loadable])
            self.counts["chunks_without_state"] += loadable - with_state
            loadable = with_state
        if loadable == 0:
            return None
        return self._load_run(request_id, table, state_slot, keys, loadable)

    def _load_run(self, request_id: RequestId, table: BlockTable, state_slot: int | None,
                  keys: list[ChunkKey], loadable: int) -> LoadStarted | None:  # fmt: skip
        """Load the first ``loadable`` chunks of ``keys`` (those its window reads) into
        ``table``'s blocks; None: the cascade loads none of them."""
        skip = self._window_skip(loadable) if self.state is None else 0
        if skip == loadable:
            return self._nothing_to_load(request_id, table, skip)
        blocks = self._chunk_blocks(table.block_ids, loadable)[skip * self.spec.blocks_per_chunk :]
        # keys past the limit: tier context; a skip is whole lower-tier chunks, so they align
        ticket = self.cascade.load(keys[skip:], blocks, limit=loadable - skip)
        if ticket is None:
            return None
        load = _Load(request_id, ticket.sources, tuple(keys), state_slot, skip, table)
        self._loads[ticket.ticket_id] = load
        if skip:
            self._unfilled[table] = skip
            self.counts["chunks_skipped_window"] += skip
        return LoadStarted(ticket.ticket_id, len(ticket.keys), ticket.sources)

    def _begin_groups(self, request_id: RequestId, tables: list[BlockTable]) -> LoadStarted | None:
        """:meth:`begin_load` of every KV cache group's table: each group loads the prefix
        every group holds (:func:`~kvplane.serving.prefix_groups.common_run`) into its blocks,
        and one :class:`LoadFinished` reports what all of them loaded."""
        offloads = (self, *self.members)
        keys = [o.chunk_keys(t) for o, t in zip(offloads, tables, strict=True)]
        if not keys[0]:
            return None
        self.counts["lookups"] += 1
        found = [o.cascade.lookup(k).where for o, k in zip(offloads, keys, strict=True)]
        hits = [[w is not None for w in where] for where in found]
        limit = (tables[0].num_tokens - 1) // self.spec.tokens_per_chunk
        run = common_run(hits, [o._window_skip for o in offloads], limit)
        if run == 0:
            return None
        each = zip(offloads, tables, keys, strict=True)
        started = [o._load_run(request_id, t, None, k, run) for o, t, k in each]
        loads = [s for s in started if s is not None]
        if not loads:
            return None
        tokens = run * self.spec.tokens_per_chunk if len(loads) == len(started) else 0
        self._join.expect(request_id, len(loads), tokens)
        return LoadStarted(0, sum(s.chunks for s in loads), loads[0].sources)

    def _nothing_to_load(
        self, request_id: RequestId, table: BlockTable, chunks: int
    ) -> LoadStarted:
        """A ``chunks``-chunk hit wholly before its window: none loaded, all ``chunks`` left
        unfilled (never stored from ``table``), its tokens reported by the next poll."""
        tokens = chunks * self.spec.tokens_per_chunk
        self._unfilled[table] = chunks
        self.counts["chunks_skipped_window"] += chunks
        self._m_tokens.inc(tokens)
        self._ready.append(LoadFinished(request_id, tokens, 0, 0))
        return LoadStarted(0, 0, ())

    def _window_skip(self, loadable: int) -> int:
        """The leading chunks of a ``loadable``-chunk hit no layer reads again: wholly before
        the hit's window (:meth:`KVLayout.window_start`; 0 when a layer is full), rounded down
        to whole chunks of every lower tier."""
        start = self.layout.window_start(loadable * self.spec.tokens_per_chunk)
        return start // self.spec.tokens_per_chunk // self._span * self._span

    def keep_state(self, table: BlockTable, state_slot: int | None, end: int) -> bool:
        """After a prefill step of ``table``'s request ending at ``end``: keep its state (in
        ``state_slot``) when ``end`` is a chunk boundary. False without a state pool."""
        if self.state is None or state_slot is None:
            return False
        return self.state.snapshot(self.chunk_keys(table), state_slot, end)

    def expect(self, request_id: RequestId, table: BlockTable) -> None:
        """``request_id`` starts computing ``table``: until its :meth:`store` (or
        :meth:`forget`), a request admitted with the same prefix waits for it."""
        first = self._unfilled.get(table, 0)
        self.waits.promise(request_id, self.chunk_keys(table)[first:][: self.host_slots])

    def forget(self, request_id: RequestId) -> None:
        """``request_id`` stopped: it will not store what :meth:`expect` promised."""
        self.waits.forget(request_id)

    def store(
        self, request_id: RequestId, table: BlockTable, *, groups: Sequence[BlockTable] = ()
    ) -> int:
        """Offload the full chunks of ``table`` (its tokens computed) from its blocks, and each
        of KV cache groups 1..'s ``groups`` tables through its member; returns how many chunks
        the store job carries (0: all already held, not admitted or no room)."""
        if len(groups) != len(self.members):
            raise InvalidArgumentError(f"{len(groups)} group tables for {len(self.members)}")
        for member, group_table in zip(self.members, groups, strict=True):
            member.store(request_id, group_table)
        first = self._unfilled.pop(table, 0)  # chunks a window load left empty: not stored
        keys = self.chunk_keys(table)[first:]
        if len(keys) > self.host_slots:
            self._unstored(len(keys))
            keys = keys[: self.host_slots]
        if not keys:
            self.waits.storing(request_id, None, ())
            return 0
        blocks = self._chunk_blocks(table.block_ids, first + len(keys))
        job = self.cascade.store(keys, blocks[first * self.spec.blocks_per_chunk :], first=first)
        self.waits.storing(request_id, job, keys)
        if job is None:
            return 0
        self._stores[job] = request_id
        self.counts["store_jobs"] += 1
        return len(keys)

    def _unstored(self, chunks: int) -> None:
        """Count the chunks of a ``chunks``-chunk prompt that no tier will hold; log once."""
        over = chunks - self.host_slots
        self.counts["chunks_unstored"] += over
        self._m_unstored.inc(over)
        if not self._told_unstored:
            self._told_unstored = True
            log.warning(
                "prefix offload: a prompt of %d chunks exceeds the host tier's %d slots; only its "
                "first %d chunks are stored (raise --offload-host-slots; counted in "
                "kvplane_prefill_prefix_chunks_unstored_total, logged once)",
                chunks, self.host_slots, self.host_slots,
            )  # fmt: skip

    # -- completion ------------------------------------------------------------------------------
    def poll(self) -> list[Finished]:
        """Apply finished jobs without blocking."""
        return self._joined(self._events(self.cascade.poll()))

    def wait(self, timeout_s: float) -> list[Finished]:
        """Block up to ``timeout_s`` for a finished job (not at all with a hit that had nothing
        to load), then apply all finished."""
        own = self.cascade.poll() if self._ready else self.cascade.wait(timeout_s)
        return self._joined(self._events(own))

    def _joined(self, own: list[Finished]) -> list[Finished]:
        """With KV cache groups: every group's loads of a request as one :class:`LoadFinished`
        once all ended (members' stores are reported by group 0's)."""
        if not self.members:
            return own
        out: list[Finished] = [ev for ev in own if isinstance(ev, StoreFinished)]
        ended = [ev for ev in own if isinstance(ev, LoadFinished)]
        for member in self.members:
            ended += [ev for ev in member.poll() if isinstance(ev, LoadFinished)]
        for ev in ended:
            joined = self._join.finished(ev.request_id, ev.tokens, ev.chunks, ev.failed)
            out += [LoadFinished(*dataclasses.astuple(joined))] if joined is not None else []
        return out

    def _events(self, events: Sequence[object]) -> list[Finished]:
        out: list[Finished] = [*self._ready]
        self._ready.clear()
        for ev in events:
            if isinstance(ev, LoadDone):
                load = self._loads.pop(ev.ticket_id)
                rid, sources, usable = load.request_id, load.sources, ev.usable
                if self.state is not None and load.state_slot is not None:
                    usable = self.state.restore(load.keys, usable, load.state_slot)
                for tier in sources[:usable]:
                    self.hits[tier] += 1
                    self._m_hits.labels(tier).inc()
                tokens = self._hit_tokens(load, usable)
                self._m_tokens.inc(tokens)
                out.append(LoadFinished(rid, tokens, usable, len(ev.keys) - usable))
            elif isinstance(ev, StoreDone):
                rid = self._stores.pop(ev.job_id, RequestId(""))
                stored = sum(ev.ok)
                self.counts["chunks_stored"] += stored
                self.waits.stored(ev.job_id)
                out.append(StoreFinished(rid, stored))
        if len(self.waits):
            out += self._unpark()
        out += self._ready
        self._ready.clear()
        return out

    def _unpark(self) -> list[Finished]:
        """Look the prefix of each parked request that is due up again: a miss finishes at
        once (nothing loaded), a hit loads as :meth:`begin_load` does."""
        out: list[Finished] = []
        for parked in self.waits.due(time.monotonic()):
            if parked.jobs or parked.requests:
                self.counts["pending_waits_timed_out"] += 1
            rid, table = parked.request_id, parked.table
            keys = self.chunk_keys(table)
            if self._begin(rid, table, parked.state_slot, keys, park=False) is None:
                out.append(LoadFinished(rid, 0, 0, 0))
        return out

    def _hit_tokens(self, load: _Load, usable: int) -> int:
        """The leading tokens a load of ``usable`` chunks (after its skip) lets the request
        skip computing: all of them, unless a short load of a skipping one leaves its window
        partly unloaded (then 0: compute everything, and every block is filled again)."""
        tokens = (load.skip + usable) * self.spec.tokens_per_chunk if usable else 0
        if load.skip and self.layout.window_start(tokens) < load.skip * self.spec.tokens_per_chunk:
            tokens = 0
        if tokens == 0 and load.table is not None:
            self._unfilled.pop(load.table, None)
        return tokens

    def close(self) -> None:
        """Drain in-flight jobs, stop the job threads and close the lower tiers."""
        self.cascade.close()
        if self.state is not None:
            self.state.close()
        for member in self.members:
            member.close()

    def check_integrity(self) -> None:
        """The cascade's invariants (no pins, fences or tickets left once idle) and the state
        store's (and every group member's)."""
        self.cascade.check_integrity()
        if self.state is not None:
            self.state.check_integrity()
        for member in self.members:
            member.check_integrity()

    def snapshot(self) -> dict[str, int]:
        """Counters for :class:`~kvplane.serving.messages.WorkerStats`."""
        out = {f"offload_hit_chunks_{t}": int(self.hits.get(t, 0)) for t in self.tiers}
        out.update({f"offload_{k}": int(v) for k, v in self.counts.items()})
        if self.state is not None:
            out.update({f"offload_state_{k}": int(v) for k, v in self.state.store.counts.items()})
        for g, member in enumerate(self.members, 1):  # KV cache group g's, ``offload_group<g>_``
            out.update({f"offload_group{g}_{k[8:]}": v for k, v in member.snapshot().items()})
        return out
