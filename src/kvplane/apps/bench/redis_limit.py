"""The remote tier's limit for ``kvplane bench offload``: ``redis-benchmark``, the server's own
C client, run against the same server with the tier's value size and pipeline depth.

Owns building its command line, running it and parsing its ``--csv`` output into seconds per
request batch; :func:`redis_benchmark_support` says why it cannot run here. Not a bench of its
own; it never starts or stops a server (the offload bench owns the server).
"""

from __future__ import annotations

import csv
import io
import math
import shutil
import subprocess
from dataclasses import dataclass

from kvplane.errors import InvalidArgumentError, OffloadError, UnsupportedError
from kvplane.validators import require_int, require_size

BINARY = "redis-benchmark"
BENCH_KEY = "key:__rand_int__"
"""The one key ``redis-benchmark`` writes without ``-r`` (the ``__rand_int__`` is left as is):
every ``SET`` overwrites it and every ``GET`` reads it back, so a ``GET`` run after a ``SET``
of ``value_bytes`` returns that many bytes. The bench deletes it afterwards."""
TESTS = ("SET", "GET")
RUN_TIMEOUT_S = 120.0
MIN_RUN_S = 0.05
"""Shortest run by ``redis-benchmark``'s millisecond clock: one tick is then at most 2%."""
MAX_SCALE = 64
"""Most requests of a rerun, as a multiple of the requested ones."""
DEPTHS = (1, 4, 16)
"""Pipeline depths tried besides the tier's own: with large values ``redis-benchmark``'s
``SET`` ran fastest unpipelined here (2.3 GB/s at ``-P 1`` against 0.8 at ``-P 32``, 256 KiB),
so the limit is the fastest depth, not the tier's."""


def redis_benchmark_support() -> str | None:
    """``None`` when ``redis-benchmark`` is on PATH, else why the limit is unavailable."""
    if shutil.which(BINARY) is None:
        return "no redis-benchmark binary on PATH (Debian: apt-get install redis-tools)"
    return None


@dataclass(frozen=True, slots=True)
class RedisBenchmark:
    """One ``redis-benchmark`` measurement: ``requests`` commands of one test (``SET`` or
    ``GET``) with ``value_bytes`` values, ``pipeline`` commands per round trip, on one
    connection (``-c 1``, as the tier's client), against the server at ``url``."""

    url: str
    value_bytes: int
    pipeline: int
    requests: int

    def __post_init__(self) -> None:
        require_size("value_bytes", self.value_bytes, min=1)
        require_int("pipeline", self.pipeline, min=1)
        require_int("requests", self.requests, min=1)

    @property
    def name(self) -> str:
        """The limit's name in a row, e.g. ``"redis-benchmark -P 32"``."""
        return f"{BINARY} -P {self.pipeline}"

    def argv(self, test: str) -> list[str]:
        """The command line timing ``test`` (one of :data:`TESTS`)."""
        if test not in TESTS:
            raise InvalidArgumentError(f"redis-benchmark test must be one of {TESTS}, got {test!r}")
        return [
            BINARY, "-u", self.url, "-c", "1", "-n", str(self.requests),
            "-P", str(self.pipeline), "-d", str(self.value_bytes), "-t", test.lower(), "--csv",
        ]  # fmt: skip

    def seconds(self, test: str) -> float:
        """Seconds ``requests`` commands of ``test`` take at ``redis-benchmark``'s rate, by its
        own clock (process start and connection set-up excluded). Its clock counts whole
        milliseconds, so a run shorter than :data:`MIN_RUN_S` (or one it reports as ``inf``) is
        redone with 4x the requests, up to :data:`MAX_SCALE` x. :class:`UnsupportedError`
        without the binary, :class:`OffloadError` when it fails or prints no figure."""
        why = redis_benchmark_support()
        if why is not None:
            raise UnsupportedError(why)
        n = self.requests
        while True:
            rps = self._rps(test, n)
            if (math.isfinite(rps) and n / rps >= MIN_RUN_S) or n >= MAX_SCALE * self.requests:
                break
            n *= 4
        if not math.isfinite(rps):
            raise OffloadError(f"{BINARY} {test}: {n} requests took under its 1 ms clock tick")
        return self.requests / rps

    def _rps(self, test: str, requests: int) -> float:
        argv = self.argv(test)
        argv[argv.index("-n") + 1] = str(requests)
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise OffloadError(f"{BINARY} {test}: no result within {RUN_TIMEOUT_S} s") from exc
        if done.returncode != 0:
            raise OffloadError(f"{BINARY} {test} exited {done.returncode}: {done.stderr[-500:]}")
        rps = parse_csv(done.stdout).get(test)
        if rps is None or not rps > 0:
            raise OffloadError(f"{BINARY} {test}: no positive rps in {done.stdout[-500:]!r}")
        return rps


def fastest(
    url: str, value_bytes: int, requests: int, tier_depth: int
) -> dict[str, RedisBenchmark]:
    """Per test of :data:`TESTS`, the :class:`RedisBenchmark` of the pipeline depth (of
    :data:`DEPTHS` and ``tier_depth``, none deeper than ``requests``: a pipeline deeper than
    its requests made ``redis-benchmark`` abort now and then) that ran it fastest, one timed
    run each after one warm-up run of each test; each ``GET`` runs after a ``SET`` of
    ``value_bytes``, so it reads that many bytes back. Errors as
    :meth:`RedisBenchmark.seconds`."""
    depths = sorted({min(d, requests) for d in (*DEPTHS, tier_depth)})
    out: dict[str, RedisBenchmark] = {}
    for test in TESTS:
        runs = [RedisBenchmark(url, value_bytes, d, requests) for d in depths]
        runs[-1].seconds(test)  # warm-up: the server's buffers and the key at this size
        out[test] = min(runs, key=lambda rb: rb.seconds(test))
    return out


def parse_csv(text: str) -> dict[str, float]:
    """``{test: requests per second}`` from ``redis-benchmark --csv`` output: a header row
    starting ``"test","rps"`` and one row per test. Lines before the header (warnings) are
    skipped; :class:`OffloadError` when no header is found or an rps is not a number."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"test","rps"')), None)
    if start is None:
        raise OffloadError(f"{BINARY} printed no CSV header: {text[-500:]!r}")
    out: dict[str, float] = {}
    for rec in csv.reader(io.StringIO("\n".join(lines[start + 1 :]))):
        if len(rec) < 2:
            continue
        try:
            out[rec[0]] = float(rec[1])
        except ValueError as exc:
            raise OffloadError(f"{BINARY} rps of {rec[0]!r} is not a number: {rec[1]!r}") from exc
    return out
