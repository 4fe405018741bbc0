"""Shared helpers of the transfer tests: an independent reference for what a plan must do, and
a scripted byte-moving transport for driving the executor through every terminal state.

``KVRef`` implements the *meaning* of a transfer without the planner: a torch gather/scatter over
each pool's canonical view (``KVLayout.canonical_view``, byte-reinterpreted so every dtype works),
and the reference executor semantics of a plan (copy ``src[i]`` bytes to ``dst[i]``). A test
plans, executes with ``memcpy`` and compares against ``scatter``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from kvplane.errors import TransportError
from kvplane.ids import PeerId, RegionId, TokenRange
from kvplane.layout import KVLayout
from kvplane.transfer.executor import PlanExecutor
from kvplane.transfer.plan import TransferPlan
from kvplane.transfer.planner import plan_transfer
from kvplane.transfer.request import PlanOptions, PlanSide
from kvplane.transports.base import (
    DescriptorList,
    FailureKind,
    Handle,
    Peer,
    Poll,
    Region,
    XferKind,
    XferState,
    check_pairing,
)
from kvplane.transports.local import LocalTransport


class KVRef:
    """Reference semantics, written against torch views only (no planner code)."""

    @staticmethod
    def region_with_pool(
        layout: KVLayout, offset: int, seed: int, slack: int = 16
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A random-byte uint8 region holding ``layout``'s pool ``offset`` bytes in."""
        gen = torch.Generator().manual_seed(seed)
        region = torch.randint(0, 256, (offset + layout.pool_bytes + slack,), generator=gen)
        region = region.to(torch.uint8)
        pool = region[offset : offset + layout.pool_bytes].view(layout.dtype).view(layout.shape)
        return region, pool

    @staticmethod
    def canon_bytes(layout: KVLayout, pool: torch.Tensor) -> torch.Tensor:
        """``[blocks, layers, comps, tokens, heads, dim_bytes]`` uint8 view of ``pool``."""
        return layout.canonical_view(pool).view(torch.uint8)

    @staticmethod
    def scatter(
        src: tuple[KVLayout, torch.Tensor, Sequence[int]],
        dst: tuple[KVLayout, torch.Tensor, Sequence[int]],
        tokens: TokenRange,
        layers: Sequence[int],
    ) -> None:
        """Copy the KV of ``tokens`` × ``layers`` × common heads from src to dst (mutates dst)."""
        if tokens.empty:
            return
        (s_layout, s_pool, s_ids), (d_layout, d_pool, d_ids) = src, dst
        lo = max(s_layout.head_range[0], d_layout.head_range[0])
        hi = min(s_layout.head_range[1], d_layout.head_range[1])
        pos = torch.arange(tokens.start, tokens.end)
        s_blk = torch.as_tensor(list(s_ids))[pos // s_layout.block_size]
        d_blk = torch.as_tensor(list(d_ids))[pos // d_layout.block_size]
        s_tok, d_tok = pos % s_layout.block_size, pos % d_layout.block_size
        s_lay = torch.tensor([s_layout.layer_ids.index(x) for x in layers])
        d_lay = torch.tensor([d_layout.layer_ids.index(x) for x in layers])
        s_h = slice(lo - s_layout.head_range[0], hi - s_layout.head_range[0])
        d_h = slice(lo - d_layout.head_range[0], hi - d_layout.head_range[0])
        sv = KVRef.canon_bytes(s_layout, s_pool)
        dv = KVRef.canon_bytes(d_layout, d_pool)
        data = sv[s_blk[:, None], s_lay[None, :], :, s_tok[:, None], s_h]
        dv[d_blk[:, None], d_lay[None, :], :, d_tok[:, None], d_h] = data

    @staticmethod
    def memcpy(plan: TransferPlan, regions: dict[RegionId, torch.Tensor]) -> None:
        """The reference executor: for every op, copy each ``src[i]`` byte range to ``dst[i]``."""
        for op in plan.ops:
            cols = zip(
                op.src.regions.tolist(),
                op.src.offsets.tolist(),
                op.dst.regions.tolist(),
                op.dst.offsets.tolist(),
                op.src.lengths.tolist(),
                strict=True,
            )
            for s_reg, s_off, d_reg, d_off, n in cols:
                regions[RegionId(d_reg)][d_off : d_off + n] = regions[RegionId(s_reg)][
                    s_off : s_off + n
                ].clone()

    @staticmethod
    def expected_tokens(
        layout: KVLayout, tokens: TokenRange | None, num_blocks: int, prefix: int
    ) -> TokenRange:
        """The effective range by the rules (prefix reuse, sliding window; STATE is whole)."""
        if tokens is None:
            return TokenRange(0, num_blocks)
        start = max(tokens.start, prefix)
        if layout.sliding_window is not None:
            start = max(start, tokens.end + 1 - layout.sliding_window)  # the next step's reads
        return TokenRange(min(start, tokens.end), tokens.end)

    @staticmethod
    def plan_and_check(
        src: tuple[KVLayout, Sequence[int]],
        dst: tuple[KVLayout, Sequence[int]],
        tokens: TokenRange | None,
        *,
        layers: Sequence[int] | None = None,
        options: PlanOptions | None = None,
        offsets: tuple[int, int] = (0, 0),
        seed: int = 0,
        via_local: bool = False,
    ) -> TransferPlan:
        """Plan, validate, execute and compare every byte of both regions with the reference
        scatter; return the plan. Executes with :meth:`memcpy`, or with ``via_local`` through
        ``PlanExecutor`` over a real ``LocalTransport`` (loopback) holding both regions."""
        (s_layout, s_ids), (d_layout, d_ids) = src, dst
        s_region, s_pool = KVRef.region_with_pool(s_layout, offsets[0], seed)
        d_region, _ = KVRef.region_with_pool(d_layout, offsets[1], seed + 1)
        transport = LocalTransport() if via_local else None
        if transport is not None:
            s_id, d_id = (transport.register(r).region_id for r in (s_region, d_region))
        else:
            s_id, d_id = RegionId(0), RegionId(1)
        regions = {s_id: s_region, d_id: d_region}
        plan = plan_transfer(
            PlanSide(s_layout, KVRef.ids(s_ids), s_id, offsets[0]),
            PlanSide(d_layout, KVRef.ids(d_ids), d_id, offsets[1]),
            tokens,
            layers=layers,
            options=options,
        )
        plan.validate(KVRef.lengths({s_id: s_region}), KVRef.lengths({d_id: d_region}))
        prefix = options.prefix_tokens if options is not None else 0
        want = KVRef.expected_tokens(s_layout, tokens, len(s_ids), prefix)
        assert plan.tokens == want
        chosen = tuple(s_layout.layer_ids) if layers is None else tuple(layers)
        assert plan.layers == chosen
        expected_src = s_region.clone()
        expected_dst = d_region.clone()
        exp_pool = expected_dst[offsets[1] : offsets[1] + d_layout.pool_bytes]
        exp_pool = exp_pool.view(d_layout.dtype).view(d_layout.shape)
        KVRef.scatter((s_layout, s_pool, s_ids), (d_layout, exp_pool, d_ids), want, chosen)
        if transport is None:
            KVRef.memcpy(plan, regions)
        else:
            try:
                peer = transport.connect(transport.metadata())
                result = PlanExecutor(transport).execute(
                    plan, peer, local_regions=KVRef.lengths(regions), deadline_s=30.0
                )
                assert result.ok, result
            finally:
                transport.close()
        assert torch.equal(s_region, expected_src), "the plan wrote into the source"
        assert torch.equal(d_region, expected_dst), "destination bytes differ from the reference"
        lo = max(s_layout.head_range[0], d_layout.head_range[0])
        hi = min(s_layout.head_range[1], d_layout.head_range[1])
        logical = (
            len(want) * len(chosen) * s_layout.num_components * (hi - lo) * s_layout.head_dim
            * s_layout.element_size
        )  # fmt: skip
        assert plan.logical_bytes == plan.num_bytes == logical
        return plan

    @staticmethod
    def lengths(regions: dict[RegionId, torch.Tensor]) -> dict[RegionId, int]:
        return {rid: int(t.numel()) for rid, t in regions.items()}

    @staticmethod
    def ids(values: Sequence[int]) -> np.ndarray:
        return np.asarray(values, dtype=np.int64)


@pytest.fixture(scope="session")
def kvref() -> type[KVRef]:
    return KVRef


class FakeClock:
    """Deterministic time: ``sleep`` advances ``now``."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Fault:
    """What the scripted transport does to one submission (by submission index).

    ``fail``/``in_doubt``: end that way after copying ``after`` descriptors; ``stall``: make no
    progress but honour deadline and cancel; ``hang``: make no progress and ignore cancel;
    ``refuse``: ``submit`` raises ``exc``; ``poll_error``: ``poll`` raises ``exc``.
    """

    kind: str
    after: int = 0
    failure: FailureKind = FailureKind.BACKEND_ERROR
    exc: Exception | None = None


@dataclass
class _Batch:
    src: DescriptorList
    dst: DescriptorList
    deadline: float
    notify: bytes | None
    fault: Fault | None
    cursor: int = 0
    poll: Poll = field(default_factory=lambda: Poll(XferState.PENDING))


class ScriptedTransport:
    """A complete in-process implementation of the ``Transport`` protocol for executor tests: it
    really copies bytes between registered tensors (``per_poll`` descriptors per ``poll``, so
    progress is observable), connects to itself (loopback) and can be scripted per submission to
    fail, end in doubt, stall, hang or refuse — the states a real transport reaches only through
    real faults. Records submissions, cancels and the most batches ever in flight."""

    name = "scripted"

    def __init__(self, clock: FakeClock, per_poll: int = 1) -> None:
        self.clock, self.per_poll = clock, per_poll
        self.buffers: dict[RegionId, torch.Tensor] = {}
        self.faults: dict[int, Fault] = {}
        self.batches: dict[int, _Batch] = {}
        self.cancelled: list[int] = []
        self.max_inflight_seen = 0
        self._notes: list[tuple[PeerId, bytes]] = []

    def register(self, buffer: torch.Tensor) -> Region:
        if not buffer.is_contiguous():
            raise TransportError("register needs a contiguous tensor")
        flat = buffer.view(-1).view(torch.uint8)
        base, end = flat.data_ptr(), flat.data_ptr() + flat.numel()
        for other in self.buffers.values():
            if base < other.data_ptr() + other.numel() and other.data_ptr() < end:
                raise TransportError("region overlaps a registered region")
        rid = RegionId(len(self.buffers))
        self.buffers[rid] = flat
        return Region(rid, base, flat.numel())

    def deregister(self, region_id: RegionId) -> None:
        self.buffers.pop(region_id)

    def lengths(self) -> dict[RegionId, int]:
        return {rid: int(t.numel()) for rid, t in self.buffers.items()}

    def metadata(self) -> bytes:
        return b"loopback"

    def connect(self, peer_metadata: bytes) -> Peer:
        return Peer(PeerId("loopback"), self.lengths())

    def submit(
        self,
        kind: XferKind,
        src: DescriptorList,
        dst: DescriptorList,
        peer: Peer,
        *,
        notify: bytes | None = None,
        deadline_s: float = 30.0,
    ) -> Handle:
        if peer.peer_id != "loopback":
            raise TransportError(f"unknown peer {peer.peer_id!r}")
        check_pairing(src, dst)
        src.check_bounds(self.lengths(), "source")
        dst.check_bounds(self.lengths(), "destination")
        index = len(self.batches)
        fault = self.faults.get(index)
        if fault is not None and fault.kind == "refuse":
            assert fault.exc is not None
            raise fault.exc
        self.batches[index] = _Batch(src, dst, self.clock() + deadline_s, notify, fault)
        pending = sum(b.poll.state is XferState.PENDING for b in self.batches.values())
        self.max_inflight_seen = max(self.max_inflight_seen, pending)
        return Handle(self.name, index, peer.peer_id, src.total_bytes)

    def poll(self, handle: Handle) -> Poll:
        b = self.batches[handle.xfer_id]
        if b.poll.state.terminal:
            return b.poll
        kind = b.fault.kind if b.fault is not None else ""
        if kind == "poll_error":
            assert b.fault is not None and b.fault.exc is not None
            raise b.fault.exc
        if kind == "hang":
            return b.poll
        if self.clock() > b.deadline:
            b.poll = Poll(XferState.FAILED, b.poll.bytes_done, FailureKind.TIMEOUT, "deadline")
            return b.poll
        if kind in ("fail", "in_doubt") and b.cursor >= b.fault.after:  # type: ignore[union-attr]
            state = XferState.FAILED if kind == "fail" else XferState.IN_DOUBT
            b.poll = Poll(state, b.poll.bytes_done, b.fault.failure, f"scripted {kind}")  # type: ignore[union-attr]
            return b.poll
        if kind == "stall":
            return b.poll
        stop = min(b.cursor + self.per_poll, len(b.src))
        for i in range(b.cursor, stop):
            s, d = b.src, b.dst
            n = int(s.lengths[i])
            so, do = int(s.offsets[i]), int(d.offsets[i])
            out = self.buffers[RegionId(int(d.regions[i]))]
            out[do : do + n] = self.buffers[RegionId(int(s.regions[i]))][so : so + n].clone()
        b.cursor = stop
        done = int(b.src.lengths[:stop].sum())
        if stop == len(b.src):
            b.poll = Poll(XferState.DONE, done, ended_at=self.clock())
            if b.notify is not None:
                self._notes.append((PeerId("loopback"), b.notify))
        else:
            b.poll = Poll(XferState.PENDING, done)
        return b.poll

    def cancel(self, handle: Handle) -> None:
        self.cancelled.append(handle.xfer_id)
        b = self.batches[handle.xfer_id]
        if b.poll.state.terminal or (b.fault is not None and b.fault.kind == "hang"):
            return
        if b.cursor:
            b.poll = Poll(XferState.IN_DOUBT, b.poll.bytes_done, FailureKind.CANCELLED, "cancel")
        else:
            b.poll = Poll(XferState.FAILED, 0, FailureKind.CANCELLED, "cancelled")

    def notifications(self) -> list[tuple[PeerId, bytes]]:
        notes, self._notes = self._notes, []
        return notes

    def close(self) -> None:
        self.buffers.clear()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def scripted(clock: FakeClock) -> ScriptedTransport:
    return ScriptedTransport(clock)


@pytest.fixture(scope="session")
def fault() -> type[Fault]:
    return Fault
