"""PD over vLLM's KV cache groups (hybrid KV cache manager on): one session, one pool per group.

Owns what makes a request's groups one PD session, as kvplane's own serving sends them: each
group's layout (:func:`pd_layouts`: the model's layer numbers as layer ids, so
``pd.handshake.pool_pairs`` pairs pools by layers; a window group's :func:`plan_window`), the
receiver's ``dst_block_ids`` (:func:`destination_ids`, ``advert.split_destination``'s order),
the sender's sources (:func:`sources`; :func:`window_hole`: a window vLLM freed under them)
and the one-line refusal of a peer with other groups (:func:`group_refusal`). A window group
moves what the planner's window rule (``KVLayout.window_start``) keeps from the session's
block-aligned end (:func:`~.pd_params.transferred_tokens`). No vLLM import. See
``docs/vllm.md`` ("Sliding windows and hybrids").
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import msgspec

from kvplane.errors import InvalidArgumentError, KVPlaneError, UnsupportedError
from kvplane.ids import RegionId
from kvplane.integrations.vllm.groups import HMA_OFF, KVGroup
from kvplane.integrations.vllm.pd_ranks import rank_layout
from kvplane.integrations.vllm.pool import VllmPool
from kvplane.integrations.vllm.tp import TPShard
from kvplane.integrations.vllm.windows import KVWindow, holds_null
from kvplane.layout import KVLayout
from kvplane.pd.handshake import LayoutInfo
from kvplane.pipeline.advert import PoolAdvert, advert_refusal, num_paged, rebuild
from kvplane.pipeline.slicing import LocalPool

_NUMBER = re.compile(r"\d+")


def plan_window(window: KVWindow) -> int:
    """The window a window group's pool is planned with: ``1 + block_size * ceil((W - 1) /
    block_size)`` for vLLM's window ``W``. From a block-aligned end ``e`` (the session's), the
    planner moves from ``e + 1 - plan_window`` on: the first token of the block holding ``e + 1
    - W``, the first the decode engine's query at ``e`` reads, so whole blocks move and the
    receiver holds each (vLLM keeps from ``(e + 1 - W - retained) // block_size``)."""
    bs = window.block_size
    return 1 + bs * -(-(window.tokens - 1) // bs)


def layer_numbers(groups: Sequence[KVGroup]) -> dict[str, int]:
    """Every group's layer names numbered in model order (the first integer in a name, then
    the name): the layer ids both engines give a layer (one model, one numbering)."""
    names = sorted({n for g in groups for n in g.layers}, key=_order)
    return {name: i for i, name in enumerate(names)}


def _order(name: str) -> tuple[int, str]:
    found = _NUMBER.search(name)
    return (int(found.group()) if found else -1, name)


def pd_layouts(
    pools: Sequence[VllmPool], groups: Sequence[KVGroup], shard: TPShard
) -> tuple[KVLayout, ...]:
    """Each group's PD layout: ``pools[i]``'s rank layout (:func:`~.pd_ranks.rank_layout`) with
    the model's layer numbers (:func:`layer_numbers`) and, for a window group,
    :func:`plan_window`; with one group (or ``groups`` empty) the rank layout alone.
    :class:`InvalidArgumentError` for another count of pools than groups."""
    if groups and len(groups) != len(pools):
        raise InvalidArgumentError(f"{len(pools)} pools for {len(groups)} KV cache groups")
    layouts = [rank_layout(p.layout, shard) for p in pools]
    if len(groups) <= 1:
        return tuple(layouts)
    ids = layer_numbers(groups)
    out = []
    for layout, pool, group in zip(layouts, pools, groups, strict=True):
        window = None if group.window is None else plan_window(group.window)
        layers = tuple(ids[name] for name in pool.layer_names)
        out.append(dataclasses.replace(layout, layer_ids=layers, sliding_window=window))
    return tuple(out)


def layout_info(layout: KVLayout) -> LayoutInfo:
    """``layout`` as a PD handshake announces it (with its fingerprints)."""
    return LayoutInfo.from_description(
        layout.describe(),
        compat_fingerprint=layout.compat_fingerprint(),
        fingerprint=layout.fingerprint(),
    )


def destination_ids(block_ids: Sequence[Sequence[int]], need: int) -> tuple[int, ...]:
    """A receiver's ``dst_block_ids``: each group's first ``need`` block ids, one group after
    the other (a window group's blocks left of its window are vLLM's null block, never
    written). :class:`UnsupportedError` for a group holding fewer."""
    out: list[int] = []
    for g, ids in enumerate(block_ids):
        if len(ids) < need:
            raise UnsupportedError(
                f"KV cache group {g}: {len(ids)} blocks, the receive needs {need}"
            )
        out += (int(b) for b in ids[:need])
    return tuple(out)


def sources(
    layouts: Sequence[KVLayout], regions: Sequence[RegionId], block_ids: Sequence[Sequence[int]]
) -> tuple[LocalPool, ...]:
    """A sender's plan sources: each group's pool with the request's block ids in it (a window
    group's table holds null blocks left of its window; the planner reads from its window on)."""
    if len(block_ids) != len(layouts):
        raise UnsupportedError(
            f"{len(block_ids)} block tables for {len(layouts)} KV cache group pools"
        )
    return tuple(
        LocalPool(lay, r, tuple(int(b) for b in ids))
        for lay, r, ids in zip(layouts, regions, block_ids, strict=True)
    )


def window_hole(
    layouts: Sequence[KVLayout], tables: Sequence[Sequence[int]], num_tokens: int
) -> str | None:
    """Why a sender cannot move a session of ``num_tokens`` from ``tables`` (each group's block
    ids so far), else None: a window group's table holds vLLM's null block where its window
    is read from (vLLM freed it: a prefill step started past the session's end), one line."""
    for g, (layout, ids) in enumerate(zip(layouts, tables, strict=True)):
        first = layout.window_start(num_tokens) // layout.block_size
        if layout.windowed and holds_null(ids[first : num_tokens // layout.block_size]):
            return f"KV cache group {g} freed a block of its window before the PD send"
    return None


def group_refusal(ours: Sequence[KVLayout], blob: bytes) -> str | None:
    """Why a PD peer whose pool advert is ``blob`` cannot pair with our group pools ``ours``
    (one line), else None: another advert version (``advert_refusal``), or other KV cache
    groups (their count, or a group's layers or window), naming :data:`~.groups.HMA_OFF`. One
    group on both sides is judged by the handshake's own checks."""
    why = advert_refusal(blob)
    if why is not None:
        return why
    try:
        advert = msgspec.msgpack.decode(blob, type=PoolAdvert)
        theirs = [rebuild(p.layout) for p in advert.pools]
        count = num_paged(theirs)
    except (msgspec.DecodeError, KVPlaneError) as exc:
        return f"peer's pool advert is malformed: {exc}"
    mine = [(lay.layer_ids, lay.sliding_window) for lay in ours]
    got = [(lay.layer_ids, lay.sliding_window) for lay in theirs[:count]]
    if (len(mine) == 1 and count == 1) or got == mine:
        return None
    return (
        f"the PD peer has {count} KV cache group(s) {_groups(got)}, this engine {len(mine)} "
        f"{_groups(mine)}: start both engines alike, with or without {HMA_OFF}"
    )


def _groups(pairs: Sequence[tuple[tuple[int, ...], int | None]]) -> str:
    return "[" + "; ".join(f"layers {list(ls)} window {w}" for ls, w in pairs) + "]"
