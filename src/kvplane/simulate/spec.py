"""The simulated cluster as frozen values: workers, compute costs, transport, tiers, failures.

Each class is one section of the cluster TOML (``[prefill]``, ``[tiers.host]``...) and checks its
own fields on construction, naming the TOML key: ``ConfigError("[prefill] token_s must be a
finite number >= 0, got -1")``. Reading the file is :mod:`kvplane.simulate.parse`; the KV
geometry is :mod:`kvplane.simulate.geometry`. Keys and units: docs/simulate.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvplane.errors import ConfigError
from kvplane.simulate.geometry import KVGeometry
from kvplane.validators import require_bool, require_int, require_number, require_size

TRACE_BLOCK_TOKENS = 512
"""Tokens per hash id of the Mooncake trace format: chunk sizes are multiples of it."""

TIER_ORDER = ("device", "host", "disk", "remote")
"""Tiers from fastest to slowest: lookups walk them in this order, stores write to all."""

ROUTERS = ("round-robin", "least-loaded", "prefix-aware")
ROLES = ("prefill", "decode")


def _floats(spec: object, section: str, *keys: str, positive: bool = False) -> None:
    """Check the number fields ``keys`` of the frozen ``spec`` in order (finite and >= 0, or
    > 0 when ``positive``; a ``ConfigError`` names ``[section] key``); store each as a float."""
    bound = {"above": 0.0} if positive else {"min": 0.0}
    for key in keys:
        got = require_number(f"[{section}] {key}", getattr(spec, key), **bound, error=ConfigError)
        object.__setattr__(spec, key, got)


def _choice(what: str, value: object, options: tuple[str, ...]) -> str:
    if isinstance(value, str) and value in options:
        return value
    raise ConfigError(f"{what} must be one of {', '.join(options)}, got {value!r}")


@dataclass(frozen=True, slots=True)
class PrefillSpec:
    """One prefill worker's compute: a slice ``[s, e)`` of a prompt costs ``step_s +
    token_s * (e - s) + pair_s * (s + ... + e - 1)`` seconds (the last term: attention over
    the prefix, one (query, key) pair each). Slices are ``slice_tokens`` long; ``pipelined``
    sends each slice's KV as soon as it is computed. ``contention``: a pipelined slice computed
    while this request's KV is being sent (every one after the first, or all of them after a
    loaded prefix) takes ``1 + contention`` times as long -- the KV writes and the copy share
    the host's memory bandwidth (:func:`~kvplane.simulate.timing.contention_of`).
    ``setup_s``: seconds from taking a request to its first load or step (the order's
    hand-off, slots, the session with the decode worker). ``interleave``: the worker takes
    every request at once and computes one step of each in turn (``kvplane serve``'s prefill
    worker); else one request at a time, FIFO, the worker held through its setup too."""

    SECTION: ClassVar[str] = "prefill"
    token_s: float
    pair_s: float = 0.0
    step_s: float = 0.0
    slice_tokens: int = 512
    pipelined: bool = True
    contention: float = 0.0
    setup_s: float = 0.0
    interleave: bool = False

    def __post_init__(self) -> None:
        _floats(self, self.SECTION, "token_s", "pair_s", "step_s", "contention", "setup_s")
        require_int("[prefill] slice_tokens", self.slice_tokens, min=1, error=ConfigError)
        require_bool("[prefill] pipelined", self.pipelined, error=ConfigError)
        require_bool("[prefill] interleave", self.interleave, error=ConfigError)


@dataclass(frozen=True, slots=True)
class DecodeSpec:
    """One decode worker: up to ``max_batch`` sequences (and ``kv_capacity_bytes`` of KV, 0 for
    no limit); a sequence admitted beside ``C`` context tokens decodes each token in
    ``token_s + ctx_token_s * C`` seconds (its own context included). ``serial``: one
    sequence at a time, and no new request accepted -- so no KV sent to it -- while one
    decodes (``kvplane serve``'s decode worker: one loop serving its orders and landed KVs in
    arrival order); ``max_batch`` is then 1. ``accept_s``: how long a serial worker's loop
    is held taking an order that waited, before the KV held for it starts to go."""

    SECTION: ClassVar[str] = "decode"
    token_s: float
    ctx_token_s: float = 0.0
    max_batch: int = 256
    kv_capacity_bytes: int = 0
    serial: bool = False
    accept_s: float = 0.0

    def __post_init__(self) -> None:
        _floats(self, self.SECTION, "token_s", "ctx_token_s", "accept_s")
        require_int("[decode] max_batch", self.max_batch, min=1, error=ConfigError)
        require_size("[decode] kv_capacity_bytes", self.kv_capacity_bytes, error=ConfigError)
        if require_bool("[decode] serial", self.serial, error=ConfigError):
            object.__setattr__(self, "max_batch", 1)


@dataclass(frozen=True, slots=True)
class TransportSpec:
    """The PD link of each worker: one op of ``n`` bytes holds the sender's and the receiver's
    link for ``op_overhead_s + n / bandwidth_bytes_s`` and lands ``rtt_s`` later."""

    SECTION: ClassVar[str] = "transport"
    bandwidth_bytes_s: float
    rtt_s: float = 0.0
    op_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        _floats(self, self.SECTION, "bandwidth_bytes_s", positive=True)
        _floats(self, self.SECTION, "rtt_s", "op_overhead_s")


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One cache tier: ``capacity_bytes`` of ``chunk_tokens``-token chunks under LRU eviction;
    a batch of ``k`` chunk loads or stores holds the tier's lane for ``k * op_overhead_s +
    bytes / bandwidth_bytes_s``. ``shared`` tiers are one cluster-wide store, others one per
    prefill worker."""

    name: str
    capacity_bytes: int
    bandwidth_bytes_s: float
    op_overhead_s: float = 0.0
    chunk_tokens: int = TRACE_BLOCK_TOKENS
    shared: bool = False

    def __post_init__(self) -> None:
        section = f"tiers.{_choice('a tier name', self.name, TIER_ORDER)}"
        require_size(f"[{section}] capacity_bytes", self.capacity_bytes, error=ConfigError)
        _floats(self, section, "bandwidth_bytes_s", positive=True)
        _floats(self, section, "op_overhead_s")
        chunk = require_int(
            f"[{section}] chunk_tokens", self.chunk_tokens, min=1, error=ConfigError
        )
        if chunk % TRACE_BLOCK_TOKENS:
            raise ConfigError(
                f"[{section}] chunk_tokens must be a multiple of {TRACE_BLOCK_TOKENS}, got {chunk}"
            )
        require_bool(f"[{section}] shared", self.shared, error=ConfigError)

    @property
    def chunk_blocks(self) -> int:
        return self.chunk_tokens // TRACE_BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class FailureSpec:
    """Worker ``index`` of ``role`` dies at ``at_s`` (simulated seconds) and never returns."""

    SECTION: ClassVar[str] = "failures"
    role: str
    index: int
    at_s: float

    def __post_init__(self) -> None:
        _choice("[[failures]] role", self.role, ROLES)
        require_int("[[failures]] index", self.index, min=0, error=ConfigError)
        _floats(self, self.SECTION, "at_s")


@dataclass(frozen=True, slots=True)
class PoissonSpec:
    """Synthetic prompts for ``--poisson``: lengths uniform in ``[mean/2, 3*mean/2]``; each
    prompt starts with the ``shared_blocks`` blocks of one of ``prefix_groups`` prefixes."""

    SECTION: ClassVar[str] = "poisson"
    input_tokens: int = 4096
    output_tokens: int = 256
    prefix_groups: int = 16
    shared_blocks: int = 4

    def __post_init__(self) -> None:
        for key in ("input_tokens", "output_tokens", "prefix_groups"):
            require_int(f"[poisson] {key}", getattr(self, key), min=1, error=ConfigError)
        require_int("[poisson] shared_blocks", self.shared_blocks, min=0, error=ConfigError)


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """The whole cluster: the ``[cluster]`` keys plus one value per other section. Tiers are in
    :data:`TIER_ORDER`, each name once; at least one worker of each role outlives the failures."""

    SECTION: ClassVar[str] = "cluster"
    geometry: KVGeometry
    prefill: PrefillSpec
    decode: DecodeSpec
    transport: TransportSpec
    prefill_workers: int
    decode_workers: int
    tiers: tuple[TierSpec, ...] = ()
    router: str = "round-robin"
    lease_s: float = 1.0
    failures: tuple[FailureSpec, ...] = ()
    poisson: PoissonSpec = PoissonSpec()

    def __post_init__(self) -> None:
        for key in ("prefill_workers", "decode_workers"):
            require_int(f"[cluster] {key}", getattr(self, key), min=1, error=ConfigError)
        _choice("[cluster] router", self.router, ROUTERS)
        _floats(self, self.SECTION, "lease_s")
        names = [t.name for t in self.tiers]
        if names != sorted(set(names), key=TIER_ORDER.index):
            raise ConfigError(f"tiers must be distinct and in the order {TIER_ORDER}, got {names}")
        for role, count in (("prefill", self.prefill_workers), ("decode", self.decode_workers)):
            dead = {f.index for f in self.failures if f.role == role}
            if any(i >= count for i in dead):
                raise ConfigError(f"[[failures]] names a {role} worker past the {count} there are")
            if len(dead) >= count:
                raise ConfigError(f"[[failures]] kill every {role} worker; leave one alive")

    def workers(self, role: str) -> int:
        """How many workers of ``role`` (``"prefill"`` or ``"decode"``)."""
        return self.prefill_workers if role == "prefill" else self.decode_workers
