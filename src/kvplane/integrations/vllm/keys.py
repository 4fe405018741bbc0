"""Chunk keys of a vLLM request, derived deterministically from its tokens.

vLLM's own block hashes are seeded from ``PYTHONHASHSEED`` (random when unset), so they differ
between engine processes. The connector recomputes its own chain instead with kvplane's
:class:`~kvplane.blocks.hashing.BlockHasher`, rooted in the engine fingerprint digest (see
:mod:`kvplane.integrations.vllm.fingerprint`) and a configured seed: the same tokens on a
compatible engine started later give the same keys, so it finds the chunks on disk or in Redis.
A LoRA adapter (its name, vLLM's integer id and a stamp of its files, see
:class:`LoraIdentity`) and a cache salt enter every block as extra keys.

:class:`RequestKeys` extends one request's chain incrementally as its tokens grow (prompt, then
decoded tokens), hashing each full block once; :meth:`RequestKeys.chunk_keys` returns the keys
of the full chunks within a token count via :meth:`ChunkSpec.chunk_keys`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvplane.blocks.hashing import BlockHasher, ExtraKey
from kvplane.chunks import ChunkSpec
from kvplane.errors import InvalidArgumentError
from kvplane.ids import BlockHash, ChunkKey


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
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(token_ids):
            raise InvalidArgumentError(
                f"num_tokens {num_tokens!r} must be in 0..{len(token_ids)} (the known tokens)"
            )
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
        if isinstance(self.int_id, bool) or not isinstance(self.int_id, int):
            raise InvalidArgumentError(f"LoraIdentity.int_id must be an int: {self.int_id!r}")


def request_extra_keys(lora: LoraIdentity | None, cache_salt: str | None) -> tuple[ExtraKey, ...]:
    """The extra hash inputs of a request: its LoRA adapter and cache salt, tagged by kind."""
    extra: list[ExtraKey] = []
    if lora is not None:
        extra += ["lora", lora.name, lora.int_id, lora.stamp]
    if cache_salt:
        extra += ["salt", cache_salt]
    return tuple(extra)
