"""Discovery in a shared store: what a lookup asks the shared tier, and adopting what it holds.

A shared tier's manager knows only the chunks this engine wrote or found at its re-index; other
engines publish more while it runs. Before a lookup, :func:`ask_keys` names the shared tier's
keys of the chunks that extend the hit run (none when every chunk is known, so no round trip),
and :func:`adopt_held` adopts the leading run the store holds into the manager, as a store
would (free slots, then READY victims of the policy). Pure decisions: no tensors, no I/O; the
tier book calls them, an executor asks the store. See docs/offload.md ("The shared store").
"""

from __future__ import annotations

from collections.abc import Sequence

from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey
from kvplane.offload.manager import OffloadManager
from kvplane.offload.slots import SlotStatus, check_chunk_keys
from kvplane.offload.spans import cover


def ask_keys(
    host: OffloadManager,
    shared: OffloadManager,
    span: int,
    keys: Sequence[ChunkKey],
    where: Sequence[object | None],
) -> tuple[ChunkKey, ...]:
    """The shared tier keys to ask about before a lookup of ``keys`` (host chunks from a
    sequence's start; ``where[i]``: the tier a load could read chunk ``i`` from, ``None``).

    From the first chunk no tier can serve, each such chunk's shared tier key (the whole
    group covering it at ``span`` > 1) that ``shared`` does not know, in order, once each, at
    most ``shared.num_slots``. Empty when every chunk is served, or when the first unserved
    one is a host store in flight (it will be a hit). It stops before a chunk that no group of
    ``keys`` covers, or whose shared copy is being stored or doomed (not loadable now), or
    whose host copy is being stored."""
    if len(where) != len(keys):
        raise InvalidArgumentError(f"{len(keys)} keys need {len(keys)} sources, got {len(where)}")
    first = next((i for i, w in enumerate(where) if w is None), None)
    if first is None:
        return ()
    covers = cover(keys, span)
    asked: list[ChunkKey] = []
    for i in range(first, len(keys)):
        if where[i] is not None:
            continue
        tier_key = covers[i]
        if tier_key is None or host.status(keys[i]) is not SlotStatus.EMPTY:
            break
        if tier_key in asked:
            continue
        if shared.status(tier_key) is not SlotStatus.EMPTY or len(asked) == shared.num_slots:
            break
        asked.append(tier_key)
    return tuple(asked)


def adopt_held(
    shared: OffloadManager, asked: Sequence[ChunkKey], held: Sequence[bool]
) -> tuple[ChunkKey, ...]:
    """Adopt the leading run of ``asked`` that the store holds (``held[i]``) into ``shared``
    as READY chunks: free slots first, then READY chunks the policy picks (forgotten, not
    deleted: the store keeps them), at most as many as there is room for. Keys ``shared``
    holds already are skipped. Returns the adopted keys, in order."""
    ks = check_chunk_keys(asked)
    if len(held) != len(ks):
        raise InvalidArgumentError(f"{len(ks)} keys asked need {len(ks)} answers, got {len(held)}")
    run = next((i for i, h in enumerate(held) if not h), len(ks))
    table = shared.table
    room = table.num_free + len(table.keys_in(SlotStatus.READY))
    found = [k for k in ks[:run] if shared.status(k) is SlotStatus.EMPTY][:room]
    plan = shared.prepare_store(found, bypass_admission=True) if found else None
    if plan is None or not plan.keys:
        return ()
    shared.complete_store(plan.keys, True)
    return plan.keys
