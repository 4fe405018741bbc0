"""What the connector's scheduler side and worker side tell each other, as plain data.

Owns the per-step messages (:class:`StepMeta` of :class:`StoreOp`, :class:`LoadOp` and
:class:`DemoteOp`; :class:`WorkerReport` of :class:`JobReport`); the tier book's parts
(:class:`TierWrite`, :class:`Promotion`, the :class:`TierIndex` handshake) are re-exported from
:mod:`kvplane.offload.book_types`. Frozen values of ints, strs, bytes, bools and tuples: no
logic, no vLLM types. Conventions (job ids, chunk-major block ids): ``docs/vllm.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.ids import ChunkKey
from kvplane.offload.book_types import Promotion, TierIndex, TierWrite

__all__ = [
    "DemoteOp",
    "EndOp",
    "JobReport",
    "LoadOp",
    "PDResult",
    "Promotion",
    "RecvOp",
    "SendOp",
    "StepMeta",
    "StoreOp",
    "TierIndex",
    "TierWrite",
    "WorkerReport",
]


@dataclass(frozen=True, slots=True)
class StoreOp:
    """Gather vLLM blocks ``block_ids`` (chunk-major) into host slots ``host_slots``, then write
    the gathered chunks on down to the lower tiers named in ``writes``.

    The host slots are STORING in the scheduler's bookkeeping until the worker reports the
    gather; the worker reports each :class:`TierWrite` separately, after the gather.
    """

    job_id: int
    req_id: str
    keys: tuple[ChunkKey, ...]
    host_slots: tuple[int, ...]
    block_ids: tuple[int, ...]
    writes: tuple[TierWrite, ...] = ()


@dataclass(frozen=True, slots=True)
class DemoteOp:
    """Write tier ``tier``'s chunks of larger size from the host: tier chunk ``j`` is the bytes
    of host slots ``host_slots[j]`` end to end, written as ``tier_keys[j]`` into
    ``tier_slots[j]`` (a write-down the tier book decided once a gather published the last
    of its host chunks; they stay pinned until the worker reports it, per tier chunk)."""

    job_id: int
    tier: str
    tier_slots: tuple[int, ...]
    tier_keys: tuple[ChunkKey, ...]
    host_slots: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class LoadOp:
    """Load chunks ``keys`` into vLLM blocks for request ``req_id``.

    ``host_slots[i]`` holds (or, for a :class:`Promotion`, will hold) chunk ``i``. The first
    ``skip_blocks`` blocks of the first chunk are already computed locally and are not written,
    and a load whose token count ends inside its last chunk does not write that chunk's tail:
    ``block_ids`` lists exactly the blocks to write, in order. ``keys[0]`` is chunk
    ``first_chunk`` of the request. Chunks from index ``doomed_from`` on could not be planned at
    allocation time; the worker reports their blocks as load errors without reading anything.
    ``load_async``: vLLM does not wait for it in a forward (the request waits in
    ``WAITING_FOR_REMOTE_KVS``); the worker names ``req_id`` finished receiving once it ended.
    """

    job_id: int
    req_id: str
    keys: tuple[ChunkKey, ...]
    host_slots: tuple[int, ...]
    block_ids: tuple[int, ...]
    skip_blocks: int = 0
    promotions: tuple[Promotion, ...] = ()
    doomed_from: int | None = None
    first_chunk: int = 0
    load_async: bool = False

    @property
    def num_planned(self) -> int:
        """Chunks the worker actually moves (the rest are reported failed)."""
        return len(self.keys) if self.doomed_from is None else self.doomed_from


@dataclass(frozen=True, slots=True)
class SendOp:
    """PD, prefill side: request ``req_id``'s KV of tokens ``[0, computed_end)`` exists after
    this step in ``block_ids`` (its whole table so far); ``last`` once its prefill is complete.

    ``num_tokens`` is what the session moves (:func:`~.pd_params.transferred_tokens`) and
    ``prompt`` the prompt's key (:func:`~.pd_params.prompt_key`), checked against the decode
    side's request. ``group_block_ids``: KV cache groups 1.. tables (vLLM's hybrid manager;
    ``block_ids`` is group 0's).
    """

    req_id: str
    session_id: str
    prompt: str
    num_tokens: int
    computed_end: int
    block_ids: tuple[int, ...]
    last: bool
    group_block_ids: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class RecvOp:
    """PD, decode side: receive tokens ``[prefix_tokens, num_tokens)`` of request ``req_id``
    from the prefill engine at ``address`` (session ``session_id``) into ``block_ids``, the
    request's first ``ceil(num_tokens / block_size)`` blocks (with several KV cache groups
    each group's, one group after the other: :func:`~.pd_groups.destination_ids`). With
    ``abandon`` set nothing is received: the prefill engine is told (the reason) that this
    decode will never ask, so its session's blocks are freed now instead of at its timeout.
    ``rank_addresses``: every prefill rank's address in rank order when the prefill engine runs
    TP > 1 (``address`` is rank 0's); empty at TP 1. Each decode rank receives from its own
    rank (:meth:`peer`)."""

    req_id: str
    session_id: str
    address: str
    prompt: str
    num_tokens: int
    prefix_tokens: int
    block_ids: tuple[int, ...]
    abandon: str = ""
    rank_addresses: tuple[str, ...] = ()

    def peer(self, rank: int) -> str | None:
        """The prefill endpoint decode rank ``rank`` pairs with (None: that rank has none)."""
        if not self.rank_addresses:
            return self.address if rank == 0 else None
        return self.rank_addresses[rank] if rank < len(self.rank_addresses) else None


@dataclass(frozen=True, slots=True)
class EndOp:
    """PD: request ``req_id`` ended in vLLM before its session did (aborted, stopped early):
    cancel the session; its blocks stay held until the session released them."""

    req_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class StepMeta:
    """One engine step's work for the worker side.

    ``flush`` asks the worker to finish every in-flight store before the forward (this step
    writes a block a store may still read: a fenced block of a finished or preempted request);
    ``pd_delayed`` names finished prefill requests whose blocks wait for their PD send.
    """

    loads: tuple[LoadOp, ...] = ()
    stores: tuple[StoreOp, ...] = ()
    flush: bool = False
    sends: tuple[SendOp, ...] = ()
    recvs: tuple[RecvOp, ...] = ()
    ends: tuple[EndOp, ...] = ()
    pd_delayed: tuple[str, ...] = ()
    idle: bool = False
    """vLLM scheduled no token this step (it steps only to let transfers finish)."""
    demotes: tuple[DemoteOp, ...] = ()

    @property
    def empty(self) -> bool:
        return not (
            self.loads or self.stores or self.demotes or self.flush
            or self.sends or self.recvs or self.ends or self.pd_delayed
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class JobReport:
    """A finished part of job ``job_id``: ``ok[i]`` for its ``i``-th chunk.

    ``tier`` says which part: ``"host"`` for a store's gather (all its keys), a lower tier's
    name for one :class:`TierWrite` of a store (its ``indices``, in order) or for a
    :class:`DemoteOp` (its tier chunks, in order), ``"device"`` for a
    load (all its keys: the chunk's bytes read back valid; only the leading run of valid
    chunks was written into the vLLM blocks, the rest are reported to vLLM as load errors).
    ``rank``: the tensor-parallel rank that did it (every rank reports every part of every
    job for its own head shard; :class:`~.tp.RankTally` joins them).
    """

    job_id: int
    tier: str
    ok: tuple[bool, ...]
    rank: int = 0


@dataclass(frozen=True, slots=True)
class PDResult:
    """A PD session of request ``req_id`` ended and its memory is released: ``role`` is
    ``"send"`` or ``"recv"``, ``ok`` whether its KV arrived whole, ``reason`` why not;
    ``rank``: the tensor-parallel rank whose session it was (:class:`~.pd_ranks.RankResults`
    joins them)."""

    req_id: str
    role: str
    ok: bool
    reason: str = ""
    rank: int = 0


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """What the worker side finished since its last report."""

    jobs: tuple[JobReport, ...] = ()
    pd: tuple[PDResult, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.jobs or self.pd)

    def merge(self, other: WorkerReport) -> WorkerReport:
        """Both reports' jobs and PD results (vLLM merges the ranks' reports of a step this
        way: a job part appears once per rank that finished it this step)."""
        return WorkerReport(self.jobs + other.jobs, self.pd + other.pd)
