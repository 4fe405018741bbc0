"""The Mooncake trace as ``kvplane bench routing`` replays it: rows read, prompts scaled down
with the block structure kept, arrival times compressed.

Pure functions over plain data (no processes, no clocks). A trace row's ``hash_ids`` name its
512-token blocks; :func:`prompt_tokens` turns each hash id into a fixed block of
``block_tokens`` token ids (a function of the id and a ``salt`` only), so equal hash ids at
equal positions give equal tokens, hence equal chunk keys on the workers. See
docs/benchmarks.md ("bench routing").
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvplane.errors import ConfigError, InvalidArgumentError
from kvplane.validators import require_int, require_number

TRACE_BLOCK_TOKENS = 512
"""Tokens per hash id in the Mooncake trace."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One trace row: arrival ``timestamp_ms``, ``input_length`` and ``output_length`` tokens,
    and the prompt's block ``hash_ids`` (one per :data:`TRACE_BLOCK_TOKENS` tokens)."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        require_int("TraceRequest.timestamp_ms", self.timestamp_ms, min=0)
        require_int("TraceRequest.input_length", self.input_length, min=1)
        require_int("TraceRequest.output_length", self.output_length, min=0)
        if not self.hash_ids:
            raise InvalidArgumentError("TraceRequest.hash_ids must not be empty")


def load_trace(path: Path, start: int = 0, count: int | None = None) -> list[TraceRequest]:
    """Rows ``start .. start + count`` (``None``: to the end) of the JSON-lines trace at
    ``path``; ``ConfigError`` for a missing file, a malformed row, or fewer rows than asked."""
    require_int("start", start, min=0)
    if count is not None:
        require_int("count", count, min=1)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"trace {path}: {exc.strerror}") from None
    rows = [line for line in lines if line.strip()][start:]
    rows = rows if count is None else rows[:count]
    if (count is not None and len(rows) < count) or not rows:
        raise ConfigError(f"trace {path}: {count} rows from row {start} asked, {len(rows)} there")
    out = []
    for i, line in enumerate(rows, start):
        try:
            d = json.loads(line)
            out.append(
                TraceRequest(
                    int(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                    tuple(int(h) for h in d["hash_ids"]),
                )
            )  # fmt: skip
        except (ValueError, KeyError, TypeError, InvalidArgumentError) as exc:
            raise ConfigError(f"trace {path} row {i}: {exc}"[:4000]) from None
    return out


def reused_groups(
    reqs: Sequence[TraceRequest], groups: int, min_requests: int = 2
) -> list[TraceRequest]:
    """The requests of the first ``groups`` prefix groups of ``reqs`` (requests sharing their
    first hash id) that hold at least ``min_requests`` requests in ``reqs``, groups taken in
    order of first arrival, requests kept in trace order. The trace reuses a prefix across
    minutes, so a run of consecutive rows short enough to replay here shares little (48 rows:
    a median 1.7% of blocks even with unbounded caches); whole groups keep the reuse."""
    require_int("groups", groups, min=1)
    require_int("min_requests", min_requests, min=1)
    sizes = Counter(r.hash_ids[0] for r in reqs)
    chosen: set[int] = set()
    for r in reqs:
        if len(chosen) == groups:
            break
        if sizes[r.hash_ids[0]] >= min_requests:
            chosen.add(r.hash_ids[0])
    return [r for r in reqs if r.hash_ids[0] in chosen]


def split_rounds(reqs: Sequence[TraceRequest], rounds: int) -> list[list[TraceRequest]]:
    """``reqs`` dealt into ``rounds`` disjoint parts by prefix group (first hash id): the
    ``k``-th group by first arrival goes to part ``k mod rounds``, whole, so no prefix is
    shared across parts and each part mixes early and late groups alike; requests stay in trace
    order. ``InvalidArgumentError`` when a part would be empty (fewer groups than rounds)."""
    require_int("rounds", rounds, min=1)
    rank: dict[int, int] = {}
    for r in reqs:
        rank.setdefault(r.hash_ids[0], len(rank))
    if len(rank) < rounds:
        raise InvalidArgumentError(f"{rounds} rounds need as many prefix groups, got {len(rank)}")
    parts: list[list[TraceRequest]] = [[] for _ in range(rounds)]
    for r in reqs:
        parts[rank[r.hash_ids[0]] % rounds].append(r)
    return parts


def block_of(hash_id: int, block_tokens: int, vocab: int, salt: int = 0) -> list[int]:
    """The ``block_tokens`` token ids (in ``[0, vocab)``) standing for trace block ``hash_id``:
    a SHA-256 stream of ``(salt, hash_id)``, so equal inputs give equal blocks on any host."""
    require_int("block_tokens", block_tokens, min=1)
    require_int("vocab", vocab, min=2)
    out: list[int] = []
    counter = 0
    while len(out) < block_tokens:
        digest = hashlib.sha256(f"{salt}:{hash_id}:{counter}".encode()).digest()
        out.extend(int.from_bytes(digest[i : i + 4], "little") % vocab for i in range(0, 32, 4))
        counter += 1
    return out[:block_tokens]


def scaled_length(req: TraceRequest, block_tokens: int) -> int:
    """``req``'s prompt length scaled by ``block_tokens / 512``: every full trace block becomes
    ``block_tokens`` tokens and the last (partial) block its share, rounded up, at least 1."""
    full = len(req.hash_ids) - 1
    tail = req.input_length - full * TRACE_BLOCK_TOKENS
    tail = min(max(tail, 1), TRACE_BLOCK_TOKENS)
    return full * block_tokens + max(1, -(-tail * block_tokens // TRACE_BLOCK_TOKENS))


def prompt_tokens(
    req: TraceRequest, block_tokens: int, vocab: int, *, salt: int = 0, max_blocks: int = 0
) -> list[int]:
    """``req``'s scaled prompt: the blocks of its hash ids (:func:`block_of`) concatenated and
    cut to :func:`scaled_length`; with ``max_blocks`` > 0, only its first ``max_blocks`` hash
    ids (a longer prompt is cut there, its prefix structure kept)."""
    require_int("max_blocks", max_blocks, min=0)
    ids = req.hash_ids
    length = scaled_length(req, block_tokens)
    if max_blocks and len(ids) > max_blocks:
        ids, length = ids[:max_blocks], max_blocks * block_tokens
    tokens = [t for h in ids for t in block_of(h, block_tokens, vocab, salt)]
    return tokens[:length]


def arrivals_s(reqs: Sequence[TraceRequest], mean_gap_s: float) -> list[float]:
    """Each request's send time in seconds from the first: the trace's gaps scaled by one
    factor so that their mean is ``mean_gap_s`` (order and relative spacing kept; all 0 when
    every request arrives at once)."""
    require_number("mean_gap_s", mean_gap_s, min=0)
    if not reqs:
        return []
    t0 = reqs[0].timestamp_ms
    span = reqs[-1].timestamp_ms - t0
    if span <= 0 or len(reqs) < 2:
        return [0.0] * len(reqs)
    factor = mean_gap_s * (len(reqs) - 1) / span
    return [(r.timestamp_ms - t0) * factor for r in reqs]
