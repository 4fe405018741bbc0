"""One forward step's inputs: packed new tokens of one or more requests over paged KV.

KV for ``[0, start)`` is the caller's promise, so chunked prefill, decode and decode after a
transfer are one operation; the slots one step writes must be distinct. A model with several KV
cache groups gets one page table and slot mapping per group. See docs/attention.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvplane.attention import PlanMetadata
from kvplane.blocks import BlockTable, canonical_token_ids
from kvplane.blocks.hashing import TokenIds
from kvplane.errors import InvalidArgumentError
from kvplane.ids import BlockId, TokenRange
from kvplane.validators import require_int


@dataclass(frozen=True, slots=True)
class StepRequest:
    """One request's share of a step: ``token_ids`` are positions ``[start, start + n)``;
    ``block_ids`` hold the request's tokens from position 0 and cover at least ``[0, end)``;
    ``state_slot`` is its row of a hybrid model's recurrent state (ignored by pure attention);
    ``group_block_ids``: with KV cache groups, the blocks of groups 1.. (``block_ids`` are
    group 0's), each covering ``[0, end)`` of its group's pool."""

    token_ids: TokenIds
    start: int
    block_ids: Sequence[BlockId] | Sequence[int]
    state_slot: int = 0
    group_block_ids: tuple[Sequence[BlockId] | Sequence[int], ...] = ()

    @property
    def range(self) -> TokenRange:
        return TokenRange(self.start, self.start + len(self.token_ids))


@dataclass(frozen=True, slots=True)
class GroupPages:
    """One KV cache group's share of a step: int64 ``slot_mapping [T]`` and its page table."""

    slot_mapping: torch.Tensor
    metadata: PlanMetadata


@dataclass(frozen=True, slots=True)
class StepBatch:
    """Packed inputs of one forward step (see the module docstring).

    ``token_ids``, ``positions``, ``slot_mapping``: int64 ``[T]`` on the model device;
    ``last_rows``: int64 ``[B]`` row of each request's last token; ``metadata``: the page table
    (``kv_len = end``, ``q_len = end - start`` per request); ``ranges``: each request's range;
    ``state_slots``: each request's recurrent-state row (see :class:`StepRequest`);
    ``groups``: with several KV cache groups, each group's pages (group 0's are also
    ``slot_mapping`` and ``metadata``), else empty (read them through :meth:`pages`).
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    last_rows: torch.Tensor
    metadata: PlanMetadata
    ranges: tuple[TokenRange, ...]
    block_size: int
    state_slots: tuple[int, ...] = ()
    groups: tuple[GroupPages, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def batch_size(self) -> int:
        return len(self.ranges)

    @property
    def num_groups(self) -> int:
        return len(self.groups) or 1

    def pages(self, group: int) -> GroupPages:
        """KV cache group ``group``'s slot mapping and page table (group 0: the step's own)."""
        if self.groups:
            return self.groups[group]
        if group != 0:
            raise InvalidArgumentError(f"a one-group step has no KV cache group {group}")
        return GroupPages(self.slot_mapping, self.metadata)

    @property
    def is_decode(self) -> bool:
        """Every request computes exactly one token."""
        return all(len(r) == 1 for r in self.ranges)

    @classmethod
    def build(
        cls,
        requests: Sequence[StepRequest],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> StepBatch:
        """Pack ``requests``; ``InvalidArgumentError`` naming the request for bad input,
        including two tokens of the step (of one request or two) that write the same slot of
        one pool, or requests naming the blocks of different numbers of KV cache groups."""
        require_int("block_size", block_size, min=1)
        if not requests:
            raise InvalidArgumentError("a step needs at least one request")
        ids, ranges, slots = [], [], []
        tables: list[list[list[int]]] = []  # [group][request]: the blocks covering [0, end)
        for i, req in enumerate(requests):
            if not isinstance(req, StepRequest):
                raise InvalidArgumentError(f"request {i} is not a StepRequest: {req!r}")
            tokens = canonical_token_ids(req.token_ids)
            if tokens.size == 0:
                raise InvalidArgumentError(f"request {i} computes no tokens")
            require_int(f"request {i} start", req.start, min=0)
            slots.append(require_int(f"request {i} state_slot", req.state_slot, min=0))
            end = req.start + int(tokens.size)
            per_group = (req.block_ids, *req.group_block_ids)
            if i == 0:
                tables = [[] for _ in per_group]
            elif len(per_group) != len(tables):
                raise InvalidArgumentError(
                    f"request {i} names the blocks of {len(per_group)} KV cache groups, "
                    f"request 0 of {len(tables)}"
                )
            for g, group_ids in enumerate(per_group):
                blocks = [int(b) for b in group_ids]
                if len(blocks) * block_size < end or any(b < 0 for b in blocks):
                    where = f" in KV cache group {g}" if len(per_group) > 1 else ""
                    raise InvalidArgumentError(
                        f"request {i} computes tokens [{req.start}, {end}) but its {len(blocks)} "
                        f"blocks of {block_size}{where} cover {len(blocks) * block_size} "
                        f"(ids {blocks[:8]})"
                    )
                tables[g].append(blocks[: -(-end // block_size)])
            ids.append(tokens)
            ranges.append(TokenRange(req.start, end))
        batch = cls._pack(ids, ranges, tables, block_size, torch.device(device))
        return dataclasses.replace(batch, state_slots=tuple(slots))

    @classmethod
    def from_tables(
        cls,
        items: Sequence[tuple[BlockTable, TokenRange]],
        device: torch.device | str = "cpu",
    ) -> StepBatch:
        """A step over ``token_range`` of each ADMITTED block table (one block size for all)."""
        return cls.from_group_tables([((table,), rng) for table, rng in items], device)

    @classmethod
    def from_group_tables(
        cls,
        items: Sequence[tuple[Sequence[BlockTable], TokenRange]],
        device: torch.device | str = "cpu",
    ) -> StepBatch:
        """A step over ``token_range`` of each request, given by one ADMITTED block table per
        KV cache group (the tables of a request hold the same tokens; one block size for all)."""
        if not items:
            raise InvalidArgumentError("a step needs at least one request")
        sizes = {table.block_size for tables, _ in items for table in tables}
        if len(sizes) != 1:
            raise InvalidArgumentError(f"the tables of one step disagree on block size: {sizes}")
        reqs = []
        for tables, rng in items:
            table = tables[0]
            if not isinstance(rng, TokenRange) or rng.empty or rng.end > table.num_tokens:
                raise InvalidArgumentError(
                    f"request {table.request_id!r}: step range {rng} must be non-empty and "
                    f"inside its tokens [0, {table.num_tokens})"
                )
            if any(t.num_tokens != table.num_tokens for t in tables):
                counts = [t.num_tokens for t in tables]
                raise InvalidArgumentError(
                    f"request {table.request_id!r}: its group tables hold {counts} tokens"
                )
            more = tuple(t.block_ids for t in tables[1:])
            tokens = table.token_ids[rng.start : rng.end]
            reqs.append(StepRequest(tokens, rng.start, table.block_ids, group_block_ids=more))
        return cls.build(reqs, sizes.pop(), device)

    @classmethod
    def _pack(
        cls,
        ids: list[np.ndarray],
        ranges: list[TokenRange],
        tables: list[list[list[int]]],
        block_size: int,
        device: torch.device,
    ) -> StepBatch:
        q_len = torch.tensor([len(r) for r in ranges], dtype=torch.int64)
        kv_len = torch.tensor([r.end for r in ranges], dtype=torch.int64)
        starts = torch.tensor([r.start for r in ranges], dtype=torch.int64)
        row_req = torch.repeat_interleave(torch.arange(len(ranges)), q_len)
        first_row = torch.cumsum(q_len, 0) - q_len
        positions = starts[row_req] + torch.arange(int(q_len.sum())) - first_row[row_req]
        pages = []
        for group in tables:
            width = max(len(t) for t in group)
            table = torch.tensor([t + [0] * (width - len(t)) for t in group], dtype=torch.int64)
            slots = table[row_req, positions // block_size] * block_size + positions % block_size
            _check_distinct_slots(slots, row_req, positions, block_size)
            metadata = PlanMetadata.from_dense(block_size, table, kv_len, q_len)
            pages.append(GroupPages(slots.to(device), metadata))
        return cls(
            token_ids=torch.from_numpy(np.concatenate(ids)).to(device),
            positions=positions.to(device),
            slot_mapping=pages[0].slot_mapping,
            last_rows=(first_row + q_len - 1).to(device),
            metadata=pages[0].metadata,
            ranges=tuple(ranges),
            block_size=block_size,
            groups=tuple(pages) if len(pages) > 1 else (),
        )


def _check_distinct_slots(
    slots: torch.Tensor, row_req: torch.Tensor, positions: torch.Tensor, block_size: int
) -> None:
    """``InvalidArgumentError`` naming the first pair of rows that write one slot (vectorised:
    one stable sort, no loop per slot)."""
    order = torch.sort(slots, stable=True).indices
    ordered = slots[order]
    dup = (ordered[1:] == ordered[:-1]).nonzero().flatten()
    if dup.numel():
        k = int(dup[0])
        a, b = int(order[k]), int(order[k + 1])
        slot, ra, rb = int(slots[a]), int(row_req[a]), int(row_req[b])
        pa, pb = int(positions[a]), int(positions[b])
        where = f"slot {slot} (block {slot // block_size}, offset {slot % block_size})"
        if ra == rb:
            raise InvalidArgumentError(
                f"request {ra} writes {where} twice in one step (positions {pa} and {pb})"
            )
        raise InvalidArgumentError(
            f"requests {ra} (position {pa}) and {rb} (position {pb}) both write {where} in one step"
        )
