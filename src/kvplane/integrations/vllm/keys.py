"""Chunk keys of a vLLM request, derived deterministically from its tokens.

vLLM's own block hashes are seeded from ``PYTHONHASHSEED`` (random when unset), so they differ
between engine processes. The connector recomputes its own chain instead with kvplane's
:class:`~kvplane.blocks.hashing.BlockHasher`, rooted in the engine fingerprint digest (see
:mod:`kvplane.integrations.vllm.fingerprint`) and a configured seed: the same tokens on a
compatible engine started later give the same keys, so it finds the chunks on disk or in Redis.
A LoRA adapter name and a cache salt enter every block as extra keys.

:class:`RequestKeys` extends one request's chain incrementally as its tokens grow (prompt, then
decoded tokens), hashing each full block once; :meth:`RequestKeys.chunk_keys` returns the keys
of the full chunks within a token count via :meth:`ChunkSpec.chunk_keys`.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def request_extra_keys(lora_name: str | None, cache_salt: str | None) -> tuple[ExtraKey, ...]:
    """The extra hash inputs of a request: its LoRA adapter and cache salt, tagged by kind."""
    extra: list[ExtraKey] = []
    if lora_name:
        extra += ["lora", lora_name]
    if cache_salt:
        extra += ["salt", cache_salt]
    return tuple(extra)
