"""Per-tier chunk spans: a lower tier's chunk is ``span`` consecutive host chunks of a sequence.

A tier of ``span * host_blocks_per_chunk`` blocks per chunk stores host chunks ``[g * span,
(g + 1) * span)`` of a sequence as one chunk (its *group*) keyed by the group's last host key:
the hash of its last block, as for every chunk. Keys at every granularity thus come from one
block hash chain, and host keys of a prefix that covers a group find it. Owns the key
arithmetic and the span-aware lookup; pure functions of keys and managers, no tensors, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvplane.errors import ConfigError, InvalidArgumentError
from kvplane.ids import ChunkKey
from kvplane.offload.manager import CascadeLookup, ChunkLookup, OffloadManager
from kvplane.offload.slots import check_chunk_keys
from kvplane.validators import require_int


def tier_spans(host_blocks_per_chunk: int, tiers: Mapping[str, int]) -> dict[str, int]:
    """Per tier, host chunks per tier chunk, from each tier's ``blocks_per_chunk`` (0: the
    host's). ``ConfigError`` for a size that is not a positive multiple of the host's."""
    host = require_int("host blocks_per_chunk", host_blocks_per_chunk, min=1, error=ConfigError)
    spans: dict[str, int] = {}
    for name, bpc in tiers.items():
        got = require_int(f"{name}_blocks_per_chunk", bpc, min=0, error=ConfigError) or host
        if got % host:
            raise ConfigError(
                f"{name}_blocks_per_chunk = {got} is not a multiple of the host tier's {host}"
            )
        spans[name] = got // host
    return spans


def check_span(span: object) -> int:
    """``span`` as a positive int; ``InvalidArgumentError`` otherwise."""
    return require_int("span", span, min=1)


def groups(keys: Sequence[ChunkKey], span: int, first: int = 0) -> list[tuple[int, ChunkKey]]:
    """The whole groups inside ``keys`` (``keys[i]`` is host chunk ``first + i`` of its
    sequence): ``(position of the group's first key, the group's tier key)`` in order."""
    n = len(keys)
    start = -first % span
    return [(i, keys[i + span - 1]) for i in range(start, n - span + 1, span)]


def cover(keys: Sequence[ChunkKey], span: int, first: int = 0) -> list[ChunkKey | None]:
    """Per position of ``keys``, the tier key of the whole group holding it, or ``None``
    (its group reaches past ``keys``)."""
    out: list[ChunkKey | None] = [None] * len(keys)
    for i, tier_key in groups(keys, span, first):
        out[i : i + span] = [tier_key] * span
    return out


def members(keys: Sequence[ChunkKey], start: int, span: int) -> tuple[ChunkKey, ...]:
    """The host keys of the group starting at position ``start`` of ``keys``."""
    if not 0 <= start <= len(keys) - span:
        raise InvalidArgumentError(f"a group of {span} at {start} lies outside {len(keys)} keys")
    return tuple(keys[start : start + span])


def lookup_spans(
    host: OffloadManager,
    lower: Sequence[tuple[OffloadManager, int]],
    keys: Sequence[ChunkKey],
) -> CascadeLookup:
    """Ask host about ``keys`` (host chunks from the start of a sequence) and each lower tier
    ``(manager, span)`` about the tier keys of the whole groups they make: each tier counts
    its keys toward admission once. ``where[i]``: the fastest tier holding chunk ``i``; each
    chunk of the leading hit run is an access in that tier (a lower tier's chunk once, however
    many of its host chunks the run holds). Validates the keys before anything counts.
    """
    ks = check_chunk_keys(keys)
    spans = [check_span(span) for _m, span in lower]
    answers: list[tuple[OffloadManager, list[ChunkKey | None], list[ChunkLookup]]] = []
    host_res = host.lookup(ks, access=False).results
    answers.append((host, list(ks), list(host_res)))
    for (mgr, _s), span in zip(lower, spans, strict=True):
        cov = cover(ks, span)
        tier_keys = [k for _i, k in groups(ks, span)]
        res = dict(zip(tier_keys, mgr.lookup(tier_keys, access=False).results, strict=True))
        answers.append((mgr, cov, [ChunkLookup.MISS if k is None else res[k] for k in cov]))
    where: list[str | None] = []
    pending: list[bool] = []
    found: list[tuple[OffloadManager, ChunkKey] | None] = []
    for i in range(len(ks)):
        hit = next(((m, c[i]) for m, c, r in answers if r[i] is ChunkLookup.HIT), None)
        found.append(None if hit is None or hit[1] is None else (hit[0], hit[1]))
        where.append(None if hit is None else hit[0].tier)
        pending.append(
            hit is None and any(r[i] is ChunkLookup.HIT_PENDING for _m, _c, r in answers)
        )
    run = next((i for i, w in enumerate(where) if w is None), len(where))
    accessed: set[tuple[str, ChunkKey]] = set()
    for entry in found[:run]:
        if entry is not None and (entry[0].tier, entry[1]) not in accessed:
            accessed.add((entry[0].tier, entry[1]))
            entry[0].policy.access(entry[1])
    return CascadeLookup(tuple(where), tuple(pending), run)


def lookup_tiers(managers: Sequence[OffloadManager], keys: Sequence[ChunkKey]) -> CascadeLookup:
    """:func:`lookup_spans` of tiers that all move one chunk size (``managers`` fastest first)."""
    return lookup_spans(managers[0], [(mgr, 1) for mgr in managers[1:]], keys)
