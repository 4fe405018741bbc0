"""Paired rounds of ``kvplane bench routing``: what each policy replays, and in which order.

The chosen prefix groups are dealt into rounds (:func:`~.routing_trace.split_rounds`: whole
groups, so no prefix spans two rounds); both policies replay every round on one cluster, in
the order A B, B A, A B, ... (:func:`round_orders`), so a drift of the shared host's load
falls on both alike and each round gives one paired comparison. Both routers run for the
whole comparison; before each round both serve the same solo warm-up (:func:`warm`), whose
latencies set that round's send schedule, so the offered load follows what the host gives
now, not minutes ago. Owns the replay order and the raw results; computes no figures
(:mod:`.routing` does).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvplane.apps.bench.routing_cluster import (
    BLOCK_SIZE,
    BLOCKS_PER_CHUNK,
    MODEL,
    ClusterSpec,
    PolicyRouter,
    RoutingCluster,
)
from kvplane.apps.bench.routing_oracle import Replay, oracle_choice, replay, router_round_robin
from kvplane.apps.bench.routing_trace import (
    TraceRequest,
    arrivals_s,
    prompt_tokens,
    split_rounds,
)
from kvplane.chunks import ChunkSpec
from kvplane.models import tiny_config
from kvplane.validators import require_int

POLICIES = ("round-robin", "cache-aware")
ROUNDS = 4
"""Rounds per comparison, ``--quick`` or not: 4 paired ratios (orders A B, B A, A B, B A)."""
HOST_SLOTS = {True: 32, False: 128}
"""Host-tier chunks per prefill worker, per ``--quick``: a round replays a quarter of the
groups, so both workers together hold 66% (quick) and 41% (full) of a round's distinct chunks,
as 128 and 512 slots held of the whole slice: capacity matters as it does at scale."""
BLOCK_TOKENS = BLOCK_SIZE * BLOCKS_PER_CHUNK
"""Tokens per trace block once scaled (512 -> 32: one offload chunk per hash id)."""
MAX_BLOCKS = 64
"""Hash ids kept per prompt (2,048 tokens; the tiny model's positions end at 4,096)."""
LOAD = 0.7
"""Offered load: a round's mean gap between sends is its warm-ups' mean solo latency /
``LOAD`` (a request in service 70% of the time: the two cores run all six processes, so about
one prefill at a time is what this host sustains)."""
WARMUP_QUANTILES = (0.1, 0.3, 0.5, 0.7, 0.9)
"""The warm-up prompts, by length quantile of the round (after one uncounted request)."""
WARM_SALT = 1000
"""Round ``r``'s warm-up prompts draw their blocks with ``WARM_SALT + 2r + policy index``."""


def round_orders(rounds: int) -> list[tuple[str, ...]]:
    """The policy order of each of ``rounds`` rounds: :data:`POLICIES`, then reversed, then
    as given... (A B, B A, A B, B A: each policy goes first in half of an even count)."""
    require_int("rounds", rounds, min=1)
    return [POLICIES if r % 2 == 0 else POLICIES[::-1] for r in range(rounds)]


def round_salt(r: int, policy: str) -> int:
    """The salt of ``policy``'s prompts in round ``r``: a fresh one for every replay, so no
    chunk of another replay or warm-up matches (caches are cold for each)."""
    return 1 + 2 * r + POLICIES.index(policy)


@dataclass(frozen=True, slots=True)
class Workload:
    """What one comparison replays: trace ``requests`` with prompts cut at ``max_blocks`` hash
    ids, ``host_slots`` chunks per prefill worker, sends ``gap_ms`` apart on average (None:
    each round's mean solo latency / :data:`LOAD`; ``serial``: each request sent once the
    one before it was answered)."""

    requests: tuple[TraceRequest, ...]
    host_slots: int = HOST_SLOTS[True]
    max_blocks: int = MAX_BLOCKS
    gap_ms: float | None = None
    serial: bool = False

    def prompts(self, salt: int) -> list[list[int]]:
        """The scaled prompts, their blocks drawn with ``salt`` (0: the oracle's)."""
        vocab = tiny_config(MODEL).vocab_size
        return [
            prompt_tokens(r, BLOCK_TOKENS, vocab, salt=salt, max_blocks=self.max_blocks)
            for r in self.requests
        ]

    def split(self, rounds: int) -> list[Workload]:
        """The workload of each round (:func:`~.routing_trace.split_rounds`), same settings."""
        return [replace(self, requests=tuple(p)) for p in split_rounds(self.requests, rounds)]

    def models(self) -> tuple[Replay, Replay]:
        """The oracle's replay and the router's round-robin one, on exact cache models."""
        base, spec = self.prompts(0), ChunkSpec(BLOCK_SIZE, BLOCKS_PER_CHUNK)
        oracle = replay(base, 2, self.host_slots, spec, oracle_choice)
        return oracle, replay(base, 2, self.host_slots, spec, router_round_robin(2, 2))

    def assignment(self, where: Sequence[str | None]) -> tuple[Replay, int] | None:
        """A run whose request ``i`` went to prefill worker ``where[i]`` (``p0``/``p1``)
        replayed one at a time on the exact models, and how many requests went to a worker
        that would load fewer chunks than the other; None when a request's worker is unknown."""
        if any(name not in ("p0", "p1") for name in where):
            return None
        assigned = [int(str(name)[1:]) for name in where]
        off: list[int] = []

        def choose(n: int, loadable: Sequence[int]) -> int:
            off.append(int(loadable[assigned[n]] < max(loadable)))
            return assigned[n]

        spec = ChunkSpec(BLOCK_SIZE, BLOCKS_PER_CHUNK)
        return replay(self.prompts(0), 2, self.host_slots, spec, choose), sum(off)


@dataclass(frozen=True, slots=True)
class Solo:
    """A policy's warm-up before round ``round``: each counted solo request's prompt
    ``tokens`` and latency (s)."""

    round: int
    policy: str
    tokens: tuple[int, ...]
    latency_s: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Replayed:
    """One policy's replay of round ``round``: each request's TTFT (ms) and prefill worker
    (None: unknown), and the chunks the prefill workers loaded meanwhile."""

    round: int
    policy: str
    ttft_ms: tuple[float, ...]
    hits: int
    where: tuple[str | None, ...]


def warm(router: PolicyRouter, part: Workload, r: int) -> Solo:
    """Before round ``r`` (``part``): serve one uncounted solo request, then one per
    :data:`WARMUP_QUANTILES` length quantile of its prompts (salt :data:`WARM_SALT`, each
    prompt's first token changed: no chunk shared with a replay or another warm-up)."""
    k = POLICIES.index(router.policy)
    prompts = part.prompts(WARM_SALT + 2 * r + k)
    by_length = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    picks = [by_length[0]] + [by_length[int(q * (len(by_length) - 1))] for q in WARMUP_QUANTILES]
    tokens, latency = [], []
    for i, n in enumerate(picks):
        p = list(prompts[n])
        p[0] = (p[0] + 1 + i) % tiny_config(MODEL).vocab_size
        tokens.append(len(p))
        latency.append(router.serve_serially([p], f"warm{r}.{k}.{i}.")[0].ttft_ms / 1e3)
    return Solo(r, router.policy, tuple(tokens[1:]), tuple(latency[1:]))


def play(
    work: Path, w: Workload, rounds: int = ROUNDS
) -> tuple[list[Solo], list[Replayed], list[list[float]]]:
    """Replay ``w`` in ``rounds`` paired rounds (module docstring) on one cluster: every
    warm-up and every replay in the order played, and each round's send times (s)."""
    parts = w.split(rounds)
    num_blocks = 4 * w.max_blocks * BLOCKS_PER_CHUNK + 64
    cluster = RoutingCluster(work, ClusterSpec(w.host_slots, num_blocks, step=512))
    routers: dict[str, PolicyRouter] = {}
    try:
        for p in POLICIES:
            routers[p] = cluster.router(p)
        solos: list[Solo] = []
        runs: list[Replayed] = []
        at_s: list[list[float]] = []
        for r, order in enumerate(round_orders(rounds)):
            now = [warm(routers[p], parts[r], r) for p in order]
            solos += now
            gap_s = statistics.mean(s for solo in now for s in solo.latency_s) / LOAD
            if w.gap_ms is not None:
                gap_s = w.gap_ms / 1e3
            at_s.append(arrivals_s(parts[r].requests, gap_s))
            for policy in order:
                runs.append(_replay(routers[policy], parts[r], r, at_s[r]))
    finally:
        for router in routers.values():
            router.close()
        cluster.close()
    return solos, runs, at_s


def _replay(router: PolicyRouter, part: Workload, r: int, at_s: Sequence[float]) -> Replayed:
    """``router``'s replay of round ``r`` (``part``, sent at ``at_s``, or serially)."""
    prompts, tag = part.prompts(round_salt(r, router.policy)), f"{router.policy}.{r}."
    before = router.hit_chunks()
    if part.serial:
        served = router.serve_serially(prompts, tag)
    else:
        served = router.replay(prompts, at_s, tag)
    hits = router.hit_chunks() - before
    where = router.prefill_of([s.request_id for s in served])
    return Replayed(r, router.policy, tuple(s.ttft_ms for s in served), hits, tuple(where))
