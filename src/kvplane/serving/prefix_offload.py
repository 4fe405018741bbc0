"""Prefix offload for a prefill worker: finished prompts' chunks go device -> host -> disk, and a
new prompt's cached prefix comes back from the tiers instead of being computed.

Owns the tiers, the KV cache groups (:mod:`~kvplane.serving.prefix_groups`) and the routing of
finished jobs to the load path (:mod:`~kvplane.serving.prefix_loads`: the leading hits, never the
last token's chunk, of a window pool its window only, waiting for this worker's own stores) and
the store path (:mod:`~kvplane.serving.prefix_stores`). Chunk keys are the table's block hashes
at chunk ends. The values (:mod:`~kvplane.serving.prefix_values`) are re-exported here. A
hybrid's hit also needs its state (:mod:`~kvplane.serving.prefix_state`). Not thread-safe: the
worker loop owns it. See docs/serving.md.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

from kvplane.blocks import BlockPool, BlockTable
from kvplane.chunks import ChunkSpec
from kvplane.errors import ConfigError, InvalidArgumentError
from kvplane.ids import ChunkKey, RequestId
from kvplane.metrics import MetricsRegistry
from kvplane.offload import LoadDone, StoreDone, TierCascade, build_cascade
from kvplane.serving.prefix_groups import LoadJoin, common_run, group_tiers
from kvplane.serving.prefix_loads import PrefixLoads
from kvplane.serving.prefix_state import PrefixState
from kvplane.serving.prefix_stores import PrefixStores
from kvplane.serving.prefix_values import (
    Finished,
    LoadFinished,
    LoadStarted,
    PoolParts,
    PrefixSettings,
    StoreFinished,
)
from kvplane.serving.prefix_waits import PrefixWaits
from kvplane.serving.producers.base import PoolTensor
from kvplane.validators import require_int

__all__ = [
    "Finished",
    "LoadFinished",
    "LoadStarted",
    "PrefixOffload",
    "PrefixSettings",
    "StoreFinished",
]


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
        self.counts: Counter[str] = Counter()
        self.waits = PrefixWaits(settings.pending_wait_s)
        registry = metrics if metrics is not None else MetricsRegistry()
        parts = PoolParts(self.cascade, self.spec, self.waits, self.counts, registry)
        self.loads = PrefixLoads(parts, self.layout, self.state, block_pool)
        self.stores = PrefixStores(parts, self.host_slots)
        self.hits: Counter[str] = self.loads.hits
        """Chunks loaded into the device pool, by the tier they came from."""

    def chunk_keys(self, table: BlockTable) -> list[ChunkKey]:
        """Keys of the full chunks of ``table``'s tokens, in order: its block hashes at chunk
        ends (no hashing)."""
        return self.spec.chunk_keys(table.block_hashes)

    @property
    def loading(self) -> int:
        """Loads in flight (a hit with nothing to load is one until its :class:`LoadFinished`
        is polled; with groups, one until every group's load ended)."""
        return len(self.loads) + len(self.waits) + len(self._join)

    @property
    def busy(self) -> bool:
        """Jobs in flight, finished loads not yet polled or parked requests (any group's)."""
        mine = self.cascade.jobs.in_flight or self.loads.has_ready or len(self.waits)
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
        return self.loads.begin(request_id, table, state_slot, keys, park=self.waits.wait_s > 0)

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
        run = common_run(hits, [o.loads.window_skip for o in offloads], limit)
        if run == 0:
            return None
        each = zip(offloads, tables, keys, strict=True)
        started = [o.loads.load_run(request_id, t, None, k, run) for o, t, k in each]
        loads = [s for s in started if s is not None]
        if not loads:
            return None
        tokens = run * self.spec.tokens_per_chunk if len(loads) == len(started) else 0
        self._join.expect(request_id, len(loads), tokens)
        return LoadStarted(0, sum(s.chunks for s in loads), loads[0].sources)

    def keep_state(self, table: BlockTable, state_slot: int | None, end: int) -> bool:
        """After a prefill step of ``table``'s request ending at ``end``: keep its state (in
        ``state_slot``) when ``end`` is a chunk boundary. False without a state pool."""
        if self.state is None or state_slot is None:
            return False
        return self.state.snapshot(self.chunk_keys(table), state_slot, end)

    def expect(self, request_id: RequestId, table: BlockTable) -> None:
        """``request_id`` starts computing ``table``: until its :meth:`store` (or
        :meth:`forget`), a request admitted with the same prefix waits for it."""
        first = self.loads.unfilled.get(table, 0)
        self.stores.expect(request_id, self.chunk_keys(table)[first:])

    def forget(self, request_id: RequestId) -> None:
        """``request_id`` stopped: it will not store what :meth:`expect` promised."""
        self.stores.forget(request_id)

    @property
    def store_unit(self) -> int:
        """Positions a step's store ends on a multiple of (every group's): a chunk of every
        lower tier (:attr:`~kvplane.serving.prefix_stores.PrefixStores.unit`)."""
        return max(o.stores.unit for o in (self, *self.members))

    def store_reads(
        self, table: BlockTable, *, groups: Sequence[BlockTable] = ()
    ) -> tuple[int | None, ...]:
        """Per KV cache group (``table``, then ``groups`` 1..), the first position whose block
        a store of the request reads, in flight or to be issued by a coming :meth:`store` (its
        chunks a window load did not leave unfilled), None where none will: blocks from there
        on stay the request's until those stores ended."""
        if len(groups) != len(self.members):
            raise InvalidArgumentError(f"{len(groups)} group tables for {len(self.members)}")
        offloads = (self, *self.members)
        return tuple(
            o.stores.reads_from(t, o.loads.unfilled.get(t, 0))
            for o, t in zip(offloads, (table, *groups), strict=True)
        )

    def store(
        self,
        request_id: RequestId,
        table: BlockTable,
        *,
        groups: Sequence[BlockTable] = (),
        upto: int | None = None,
    ) -> int:
        """Offload the full chunks of ``table`` from its blocks not offloaded yet, and each of
        KV cache groups 1..'s ``groups`` tables through its member: with ``upto``, after a
        step, the chunks whole by position ``upto`` (computed); without, after the last, all
        the rest (:meth:`~kvplane.serving.prefix_stores.PrefixStores.store`). Returns how many
        chunks group 0's job carries (0: none due, all already held, not admitted or no
        room). ``InvalidArgumentError`` before any store for a bad ``upto`` or groups."""
        if len(groups) != len(self.members):
            raise InvalidArgumentError(f"{len(groups)} group tables for {len(self.members)}")
        if upto is not None:
            require_int("upto", upto, min=0, max=table.num_tokens)
        for member, group_table in zip(self.members, groups, strict=True):
            member.store(request_id, group_table, upto=upto)
        unfilled = self.loads.unfilled  # chunks a window load left empty: never stored
        first = unfilled.pop(table, 0) if upto is None else unfilled.get(table, 0)
        return self.stores.store(request_id, table, first, upto)

    # -- completion ------------------------------------------------------------------------------
    def poll(self) -> list[Finished]:
        """Apply finished jobs without blocking."""
        return self._joined(self._events(self.cascade.poll()))

    def wait(self, timeout_s: float) -> list[Finished]:
        """Block up to ``timeout_s`` for a finished job (not at all with a hit that had nothing
        to load), then apply all finished."""
        own = self.cascade.poll() if self.loads.has_ready else self.cascade.wait(timeout_s)
        return self._joined(self._events(own))

    def _joined(self, own: list[Finished]) -> list[Finished]:
        """With KV cache groups: every group's loads of a request as one :class:`LoadFinished`
        once all ended; members' stores as they end (``StoreFinished.group``)."""
        if not self.members:
            return own
        out: list[Finished] = [ev for ev in own if isinstance(ev, StoreFinished)]
        ended = [ev for ev in own if isinstance(ev, LoadFinished)]
        for g, member in enumerate(self.members, 1):
            for ev in member.poll():
                if isinstance(ev, LoadFinished):
                    ended.append(ev)
                else:  # what it held may be dropped now
                    out.append(dataclasses.replace(ev, group=g))
        for ev in ended:
            joined = self._join.finished(ev.request_id, ev.tokens, ev.chunks, ev.failed)
            out += [joined] if joined is not None else []
        return out

    def _events(self, events: Sequence[object]) -> list[Finished]:
        """The cascade's finished jobs, in order, after the hits with nothing to load taken
        before them; then the parked requests now due (and what they found nothing to load)."""
        out: list[Finished] = [*self.loads.take_ready()]
        for ev in events:
            if isinstance(ev, LoadDone):
                out.append(self.loads.finished(ev))
            elif isinstance(ev, StoreDone):
                out.append(self.stores.finished(ev))
        if len(self.waits):
            out += self.loads.unpark()
        out += self.loads.take_ready()
        return out

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
