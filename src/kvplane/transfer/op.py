"""One op of a transfer plan: a batch of paired descriptors and what it serves.

A :class:`TransferOp` is what ``Transport.submit`` moves in one batch -- two aligned columnar
descriptor lists (``src[i]`` moves to ``dst[i]``) -- annotated with the token range, layers,
chunk keys and pipelined slice it serves. It checks its own fields and pairing on construction;
whether it is safe against regions is the plan's validation (:mod:`kvplane.transfer.plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.errors import PlanError
from kvplane.ids import ChunkKey, SliceId, TokenRange
from kvplane.transports.base import DescriptorList, check_pairing
from kvplane.validators import is_int


def is_index(value: object) -> bool:
    """An int >= 0 that is not a bool (slice ids, region ids)."""
    return is_int(value) and value >= 0


def check_layers(layers: tuple[int, ...], where: str) -> None:
    """``PlanError`` unless ``layers`` are non-negative ints (``where`` names the owner)."""
    # element checks in C (a plan names every layer: 61 for DeepSeek-V3, per slice)
    if layers and not (set(map(type, layers)) == {int} and min(layers) >= 0):
        raise PlanError(f"{where}.layers must be non-negative ints, got {layers!r}")


@dataclass(frozen=True, slots=True, eq=False)
class TransferOp:
    """One batch of paired descriptors and what it serves.

    ``tokens``: the sequence positions whose KV this op moves (for whole-only STATE pools, the
    block indices). ``layers``: global layer ids. ``chunk_keys``: keys of the chunks whose token
    range intersects ``tokens`` (empty when the caller gave none). ``slice_id``: the pipelined
    slice this op belongs to, if any. Construction checks the pairing (``PlanError``).
    """

    src: DescriptorList
    dst: DescriptorList
    tokens: TokenRange
    layers: tuple[int, ...]
    chunk_keys: tuple[ChunkKey, ...] = ()
    slice_id: SliceId | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.src, DescriptorList) or not isinstance(self.dst, DescriptorList):
            raise PlanError("TransferOp.src and .dst must be DescriptorLists")
        check_pairing(self.src, self.dst)
        if not isinstance(self.tokens, TokenRange):
            raise PlanError(f"TransferOp.tokens must be a TokenRange, got {self.tokens!r}")
        object.__setattr__(self, "layers", tuple(self.layers))
        check_layers(self.layers, "TransferOp")
        object.__setattr__(self, "chunk_keys", tuple(self.chunk_keys))
        if any(not isinstance(k, bytes) for k in self.chunk_keys):
            raise PlanError(f"TransferOp.chunk_keys must be bytes, got {self.chunk_keys!r}")
        if self.slice_id is not None and not is_index(self.slice_id):
            raise PlanError(
                f"TransferOp.slice_id must be None or an int >= 0, got {self.slice_id!r}"
            )

    @classmethod
    def planned(
        cls,
        src: DescriptorList,
        dst: DescriptorList,
        tokens: TokenRange,
        *,
        layers: tuple[int, ...],
        chunk_keys: tuple[ChunkKey, ...],
        slice_id: SliceId | None,
    ) -> TransferOp:
        """An op the planner built from checked pieces (paired views of checked lists sharing
        one lengths array, a ``TokenRange``, int layers, bytes keys): its fields are not
        checked one by one again; the plan's ``validate`` proves its bytes."""
        op = object.__new__(cls)
        for name, value in (("src", src), ("dst", dst), ("tokens", tokens), ("layers", layers),
                            ("chunk_keys", chunk_keys), ("slice_id", slice_id)):  # fmt: skip
            object.__setattr__(op, name, value)
        return op

    @property
    def num_bytes(self) -> int:
        return self.src.total_bytes

    @property
    def num_descriptors(self) -> int:
        return len(self.src)

    def equals(self, other: TransferOp) -> bool:
        """Value equality (descriptor lists compare by content)."""
        return (
            self.src.equals(other.src)
            and self.dst.equals(other.dst)
            and self.tokens == other.tokens
            and self.layers == other.layers
            and self.chunk_keys == other.chunk_keys
            and self.slice_id == other.slice_id
        )
