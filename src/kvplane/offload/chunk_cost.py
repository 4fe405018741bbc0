"""The chunk-size cost model: a tier op costs ``op_s + bytes / bytes_per_s``.

Owns the least-squares fit of that line to measured (chunk bytes, seconds per op) samples and
the rule that picks a tier's ``blocks_per_chunk`` from a fit (:func:`choose`). Plain data, no
I/O and no timing: ``kvplane tune chunks`` measures and calls these; :class:`TunedChunks` is the
chosen sizes as the config holds them. Model and rule: docs/offload.md, "Choosing chunk sizes".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvplane.errors import ConfigError
from kvplane.validators import require_int, require_number, require_probability

MAX_OVERHEAD = 0.10
"""Default largest share of an op's transfer time its fixed overhead may take."""
MIN_CHUNKS = 64
"""Default least number of chunks a tier must hold at the chosen size."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One measurement: an op moving ``chunk_bytes`` took ``seconds`` (per op, not per run)."""

    chunk_bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Fit:
    """``seconds(nbytes) = op_s + nbytes / bytes_per_s``, least squares over ``samples``
    samples; ``residual_s`` is the root mean square of the fit's residuals. A fitted slope
    <= 0 (noise swamped the bytes) is ``bytes_per_s = inf``; ``op_s`` may come out negative
    and is kept as fitted (the rule reads a negative one as no overhead)."""

    op_s: float
    bytes_per_s: float
    residual_s: float
    samples: int

    def seconds(self, nbytes: int) -> float:
        """Modelled seconds of one op moving ``nbytes``."""
        return self.op_s + (nbytes / self.bytes_per_s if math.isfinite(self.bytes_per_s) else 0.0)


@dataclass(frozen=True, slots=True)
class Choice:
    """The chosen size: ``blocks_per_chunk`` (a power of two), its ``chunk_bytes``, the size
    the overhead rule asked for (``wanted_blocks``), the most the capacity allows
    (``cap_blocks``) and the modelled ``overhead_share`` (op_s / transfer time) at the choice."""

    blocks_per_chunk: int
    chunk_bytes: int
    wanted_blocks: int
    cap_blocks: int
    overhead_share: float


def fit(samples: Sequence[Sample]) -> Fit:
    """Ordinary least squares of ``seconds`` on ``chunk_bytes``. ``ConfigError`` unless there
    are at least two distinct sizes and every sample is a positive size with finite seconds."""
    for s in samples:
        require_int("Sample.chunk_bytes", s.chunk_bytes, min=1, error=ConfigError)
        require_number("Sample.seconds", s.seconds, min=0.0, error=ConfigError)
    if len({s.chunk_bytes for s in samples}) < 2:
        raise ConfigError("a chunk cost fit needs samples at two or more chunk sizes")
    n = len(samples)
    mx = sum(s.chunk_bytes for s in samples) / n
    my = sum(s.seconds for s in samples) / n
    sxx = sum((s.chunk_bytes - mx) ** 2 for s in samples)
    sxy = sum((s.chunk_bytes - mx) * (s.seconds - my) for s in samples)
    slope = sxy / sxx
    op_s = my - slope * mx
    sq = sum((s.seconds - op_s - slope * s.chunk_bytes) ** 2 for s in samples)
    bw = 1.0 / slope if slope > 0 else math.inf
    return Fit(op_s, bw, math.sqrt(sq / n), n)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _pow2_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def choose(
    f: Fit,
    *,
    block_bytes: int,
    capacity_bytes: int,
    max_overhead: float = MAX_OVERHEAD,
    min_chunks: int = MIN_CHUNKS,
) -> Choice:
    """A tier's ``blocks_per_chunk`` from its fit, in three steps:

    1. wanted: the smallest power of two ``b`` with ``op_s <= max_overhead * b * block_bytes /
       bytes_per_s``, i.e. ``b >= op_s * bytes_per_s / (max_overhead * block_bytes)``; 1 when
       ``op_s <= 0``; unbounded (only the cap applies) when the fit saw no bandwidth cost;
    2. cap: the largest power of two ``b`` with ``capacity_bytes // (b * block_bytes) >=
       min_chunks`` (the tier still holds ``min_chunks`` chunks), at least 1;
    3. the choice is ``min(wanted, cap)``.

    ``ConfigError`` for a non-positive size, count or ``max_overhead`` outside (0, 1]."""
    require_int("block_bytes", block_bytes, min=1, error=ConfigError)
    require_int("capacity_bytes", capacity_bytes, min=1, error=ConfigError)
    require_int("min_chunks", min_chunks, min=1, error=ConfigError)
    x = require_probability("max_overhead", max_overhead, error=ConfigError)
    if x <= 0.0:
        raise ConfigError(f"max_overhead must be > 0, got {max_overhead!r}")
    cap = _pow2_at_most(max(1, capacity_bytes // (min_chunks * block_bytes)))
    if f.op_s <= 0.0:
        wanted = 1
    elif not math.isfinite(f.bytes_per_s):
        wanted = cap
    else:
        need = f.op_s * f.bytes_per_s / (x * block_bytes)
        wanted = _pow2_at_least(max(1, math.ceil(need - 1e-9 * need)))
    got = min(wanted, cap)
    transfer = got * block_bytes / f.bytes_per_s
    share = max(f.op_s, 0.0) / transfer if transfer > 0 else math.inf
    return Choice(got, got * block_bytes, wanted, cap, share)


@dataclass(frozen=True, slots=True)
class TunedChunks:
    """A config file's ``[tune.chunks]`` table (written by ``kvplane tune chunks``): each tier's
    chosen ``blocks_per_chunk`` for blocks of ``block_bytes`` (0: not tuned), each cold tier's
    fitted bandwidth ``<tier>_gbps`` (the lesser of store and load; 0: not measured; what
    ``codec = "auto"`` judges against) and the rule's parameters. :meth:`sizes` turns them
    into a pool's blocks."""

    block_bytes: int = 16384
    max_overhead: float = MAX_OVERHEAD
    min_chunks: int = MIN_CHUNKS
    host_blocks_per_chunk: int = 0
    disk_blocks_per_chunk: int = 0
    remote_blocks_per_chunk: int = 0
    disk_gbps: float = 0.0
    remote_gbps: float = 0.0

    def __post_init__(self) -> None:
        require_int("[tune.chunks] block_bytes", self.block_bytes, min=1, error=ConfigError)
        require_int("[tune.chunks] min_chunks", self.min_chunks, min=1, error=ConfigError)
        require_probability("[tune.chunks] max_overhead", self.max_overhead, error=ConfigError)
        for tier in ("host", "disk", "remote"):
            name = f"{tier}_blocks_per_chunk"
            require_int(f"[tune.chunks] {name}", getattr(self, name), min=0, error=ConfigError)
        for name in ("disk_gbps", "remote_gbps"):
            require_number(f"[tune.chunks] {name}", getattr(self, name), min=0.0, error=ConfigError)

    def sizes(self, block_bytes: int, host: int) -> tuple[int, int, int]:
        """``(host, disk, remote)`` blocks per chunk for a pool of ``block_bytes`` blocks: each
        tuned tier's chunk bytes in those blocks (the nearest power of two, at least 1); the
        host's is ``host`` when not tuned; a cold tier's is a multiple of the host's, at
        least it, and the host's when not tuned."""
        require_int("block_bytes", block_bytes, min=1, error=ConfigError)

        def scaled(bpc: int) -> int:
            want = bpc * self.block_bytes / block_bytes
            return 1 << max(0, round(math.log2(want))) if want > 1 else 1

        h = scaled(self.host_blocks_per_chunk) if self.host_blocks_per_chunk else host
        cold = [self.disk_blocks_per_chunk, self.remote_blocks_per_chunk]
        disk, remote = (max(1, round(scaled(c) / h)) * h if c else h for c in cold)
        return h, disk, remote
