"""Chunk keys of a vLLM request, derived deterministically from its tokens.

Owns :class:`RequestKeys` (one request's block-hash chain, extended incrementally, and its chunk
keys), :class:`LoraIdentity` and the request's extra hash inputs (LoRA adapter, cache salt). The
chain is rooted in the engine fingerprint digest and a seed, never in vLLM's own hashes. Pure
computation: no tier, no vLLM import. Why, in ``docs/vllm.md`` ("Chunk keys").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvplane.blocks.hashing import BlockHasher, ExtraKey
from kvplane.chunks import ChunkSpec
from kvplane.errors import InvalidArgumentError
from kvplane.ids import BlockHash, ChunkKey
from kvplane.validators import require_int


class RequestKeys:
    """The growing block-hash chain of one request and the chunk keys it implies.

    Not thread-safe; owned by the scheduler side. ``extra_keys`` are fixed for the request.
    """

    def __init__(
        self, hasher: BlockHasher, spec: ChunkSpec, extra_keys: tuple[ExtraKey, ...] = ()
    ) -> None:
        self.hasher = hasher
        self.spec = spec
        self.extra_keys = extra_keys
        self._hashes: list[BlockHash] = []

    @property
    def num_hashed_blocks(self) -> int:
        return len(self._hashes)

    def extend(self, token_ids: Sequence[int], num_tokens: int | None = None) -> None:
        """Hash the full blocks of ``token_ids[:num_tokens]`` not hashed yet.

        ``token_ids`` is the request's whole token list (prompt + output so far); the blocks
        already hashed must be unchanged (a request's tokens only grow). Raises
        :class:`InvalidArgumentError` for ``num_tokens`` beyond the list.
        """
        n = len(token_ids) if num_tokens is None else num_tokens
        n = require_int("num_tokens (at most the known tokens)", n, min=0, max=len(token_ids))
        bs = self.spec.block_size
        have = len(self._hashes)
        full = n // bs
        if full <= have:
            return
        parent = self._hashes[-1] if self._hashes else None
        self._hashes += self.hasher.hash_blocks(
            token_ids[have * bs : full * bs], bs, self.extra_keys, parent=parent
        )

    def chunk_keys(self, num_tokens: int) -> list[ChunkKey]:
        """Keys of the full chunks inside the first ``num_tokens`` tokens (already extended)."""
        blocks = num_tokens // self.spec.block_size
        if blocks > len(self._hashes):
            raise InvalidArgumentError(
                f"{num_tokens} tokens need {blocks} hashed blocks, have {len(self._hashes)}; "
                "call extend() first"
            )
        return self.spec.chunk_keys(self._hashes[:blocks])


@dataclass(frozen=True, slots=True)
class LoraIdentity:
    """What names a LoRA adapter's effect on KV: its name, vLLM's ``lora_int_id`` and a stamp
    of its files (:func:`~.fingerprint.adapter_stamp`), so an adapter retrained under the same
    name derives other keys."""

    name: str
    int_id: int
    stamp: str

    def __post_init__(self) -> None:
        require_int("LoraIdentity.int_id", self.int_id)


def request_extra_keys(lora: LoraIdentity | None, cache_salt: str | None) -> tuple[ExtraKey, ...]:
    """The extra hash inputs of a request: its LoRA adapter and cache salt, tagged by kind."""
    extra: list[ExtraKey] = []
    if lora is not None:
        extra += ["lora", lora.name, lora.int_id, lora.stamp]
    if cache_salt:
        extra += ["salt", cache_salt]
    return tuple(extra)
