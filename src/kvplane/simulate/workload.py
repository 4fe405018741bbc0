"""Simulated requests: a Mooncake trace read from JSON lines, or seeded Poisson arrivals.

A :class:`Request` carries its prompt's block ids (one per 512-token block, equal ids at equal
positions meaning an equal prefix), so prefix hits come from the ids alone. A prompt's full
blocks are stored, and at most the blocks before its last token are reused (that token is always
computed): :func:`reusable_blocks`. Must not import the engine.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvplane.errors import ConfigError
from kvplane.simulate.spec import TRACE_BLOCK_TOKENS, PoissonSpec
from kvplane.validators import finite_number, is_int


@dataclass(frozen=True, slots=True)
class Replayed:
    """A request's prefill and transfer seconds measured in a run, replayed in place of the
    cluster's costs (:mod:`kvplane.simulate.timing` applies them): ``step_s``, each computed
    step's; ``after_s``, its worker's own time after each step, before its next one (stores,
    submissions, being descheduled); ``op_s``, each PD transfer op's span in send order, its
    wait for the link included (``None``: the link's cost); ``submit_s``, each op's delay
    from when the model lets it go (its step's end, or its order's acceptance) to its
    submission. A step or op beyond them: the model's.

    Its orders: ``prefill_s``, its prefill order's delay behind its arrival to the prefill
    worker's taking it (``None``: taken at once), ``inbox_s`` to its reaching the worker's
    inbox (from then the worker steps no request until it has taken it), and ``setup_s`` its
    setup after (``None``: the cluster's);
    ``order_s``, its decode order's delay behind its arrival to the decode worker;
    ``accept_s``, a serial decode worker's loop held taking that order until its KV is free
    to go (``None``: the cluster's ``[decode] accept_s`` for an order that waited, 0 for one
    taken at once); ``lag_s``, its replayed ops' latency after their spans, to the decode
    worker's having its KV (``None``: the link's ``rtt_s``)."""

    step_s: tuple[float, ...] = ()
    after_s: tuple[float, ...] = ()
    op_s: tuple[float, ...] | None = None
    submit_s: tuple[float, ...] = ()
    prefill_s: float | None = None
    inbox_s: float = 0.0
    order_s: float = 0.0
    accept_s: float | None = None
    setup_s: float | None = None
    lag_s: float | None = None


@dataclass(frozen=True, slots=True)
class Request:
    """One request: arrival time (s), prompt and output token counts, the prompt's block ids.
    ``decode_s``: seconds it holds its decode worker, replayed from a measured run, in place
    of the cluster's per-token decode cost (``None``: that cost); ``replayed``: its measured
    prefill steps and transfer ops (``None``: the cluster's costs)."""

    rid: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    decode_s: float | None = None
    replayed: Replayed | None = None


def stored_blocks(input_tokens: int) -> int:
    """The full blocks of a prompt: what prefill stores."""
    return input_tokens // TRACE_BLOCK_TOKENS


def reusable_blocks(input_tokens: int) -> int:
    """The blocks a prefix hit may cover: full blocks before the prompt's last token."""
    return (input_tokens - 1) // TRACE_BLOCK_TOKENS


def _bad(where: str, what: str) -> ConfigError:
    return ConfigError(f"{where}: {what}")


def parse_trace_line(line: str, rid: int, where: str) -> Request:
    """One Mooncake JSON line as a :class:`Request`; ``ConfigError`` naming ``where`` (file and
    line) and the first bad field."""
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise _bad(where, f"not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise _bad(where, "not a JSON object")
    ts = finite_number(obj.get("timestamp"))
    if ts is None or ts < 0:
        raise _bad(where, f"timestamp must be a number >= 0 (ms), got {obj.get('timestamp')!r}")
    n_in, n_out, ids = obj.get("input_length"), obj.get("output_length"), obj.get("hash_ids")
    if not is_int(n_in) or n_in < 1:
        raise _bad(where, f"input_length must be a positive int, got {n_in!r}")
    if not is_int(n_out) or n_out < 1:
        raise _bad(where, f"output_length must be a positive int, got {n_out!r}")
    if not isinstance(ids, list) or not all(is_int(h) for h in ids):
        raise _bad(where, "hash_ids must be a list of ints")
    if len(ids) < stored_blocks(n_in):
        raise _bad(where, f"{len(ids)} hash_ids cannot cover {n_in} tokens of 512-token blocks")
    return Request(rid, ts / 1e3, n_in, n_out, tuple(ids))


def read_trace(path: str | Path) -> tuple[Request, ...]:
    """Every request of a Mooncake trace file, sorted by arrival (stable), ids by line order."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"trace {str(p)!r} cannot be read: {exc}") from None
    reqs = [
        parse_trace_line(line, len_before, f"{p.name} line {n}")
        for n, line, len_before in _numbered(lines)
    ]
    if not reqs:
        raise ConfigError(f"trace {str(p)!r} has no requests")
    return tuple(sorted(reqs, key=lambda r: r.arrival_s))


def _numbered(lines: list[str]) -> Iterable[tuple[int, str, int]]:
    """(1-based line number, line, request index) of the non-blank lines."""
    count = 0
    for n, line in enumerate(lines, 1):
        if line.strip():
            yield n, line, count
            count += 1


def poisson_requests(rate: float, n: int, spec: PoissonSpec, seed: int) -> tuple[Request, ...]:
    """``n`` requests arriving as a Poisson process of ``rate`` per second, shaped by ``spec``;
    the same ``seed`` gives the same requests."""
    rng = random.Random(seed)
    shared = spec.shared_blocks
    next_id = spec.prefix_groups * shared  # ids below are the groups' shared prefixes
    t = 0.0
    out = []
    for rid in range(n):
        t += rng.expovariate(rate)
        n_in = rng.randint(max(1, spec.input_tokens // 2), max(1, spec.input_tokens * 3 // 2))
        n_out = rng.randint(max(1, spec.output_tokens // 2), max(1, spec.output_tokens * 3 // 2))
        blocks = -(-n_in // TRACE_BLOCK_TOKENS)
        group = rng.randrange(spec.prefix_groups)
        head = min(shared, blocks)
        ids = [group * shared + j for j in range(head)]
        ids.extend(range(next_id, next_id + blocks - head))
        next_id += blocks - head
        out.append(Request(rid, t, n_in, n_out, tuple(ids)))
    return tuple(out)
