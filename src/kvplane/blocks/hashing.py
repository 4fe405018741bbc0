"""Deterministic chained block hashes: ``H(parent, token_ids, extra_keys)`` in BLAKE2b.

Seeded and fingerprinted at the root, over canonical bytes (never Python ``hash()``), so equal
across processes and machines. Changing the encoding changes every hash; the golden-digest test
in ``tests/blocks`` guards it. See docs/offload.md.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np
import torch

from kvplane.config import HashConfig
from kvplane.errors import InvalidArgumentError
from kvplane.ids import BlockHash
from kvplane.validators import is_int, require_index, require_int

ExtraKey: TypeAlias = str | int | bytes
"""One extra hash input of a block: a LoRA name, a multimodal content hash, a cache salt..."""

TokenIds: TypeAlias = Sequence[int] | np.ndarray | torch.Tensor
"""Token ids as a Python sequence, a 1-D integer numpy array or a 1-D integer torch tensor."""

DIGEST_SIZE = 32
"""Length in bytes of every :data:`~kvplane.ids.BlockHash`."""

_ROOT_TAG = b"kvplane/block-hash/root/v1"
_BLOCK_TAG = b"kvplane/block-hash/block/v1"
_U64 = struct.Struct("<Q")
_INT = {int}
BOOL_TYPES = frozenset({bool, np.bool_})
"""The bool types numpy would silently read as the ints 0/1: ``BOOL_TYPES.isdisjoint(map(type,
items))`` refuses them among ints in one C-level pass (token ids here, block ids in offload)."""


def _digest(data: bytes) -> BlockHash:
    return BlockHash(hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest())


def _lp(payload: bytes) -> bytes:
    """``payload`` with a little-endian u64 length prefix."""
    return _U64.pack(len(payload)) + payload


def _int_bytes(value: int) -> bytes:
    """Little-endian two's complement of ``value`` in ``bit_length // 8 + 1`` bytes (fixed rule)."""
    return value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True)


def canonical_token_ids(token_ids: TokenIds) -> np.ndarray:
    """Validate token ids and return them as a fresh 1-D little-endian int64 numpy array.

    Accepts a sequence of ints, a 1-D integer numpy array or a 1-D integer torch tensor (any
    device; it is copied to the CPU). Every id must be a non-negative integer below ``2**63``.
    Raises :class:`InvalidArgumentError` naming the offending value otherwise (floats, bools
    -- also a bool among ints, which never aliases ``1`` --, strings, ``None`` or another
    non-iterable, nested or multi-dimensional input, a quantized or sparse tensor, negative or
    too-large ids). Does not mutate the input.

    Cost: an array or tensor is checked by vectorised ``min``/``max``; a Python sequence
    costs one C-level pass over its items' types (bools hide among ints otherwise) plus one
    conversion, about 4 ms for 128k plain ints, more for other item types.
    """
    if isinstance(token_ids, torch.Tensor):
        dt = token_ids.dtype
        if dt == torch.bool or dt.is_floating_point or dt.is_complex:
            raise InvalidArgumentError(f"token ids must be integers, got a {dt} tensor")
        try:
            arr = token_ids.detach().to("cpu").numpy()
        except (TypeError, RuntimeError) as exc:  # quantized, sparse: no numpy view
            raise InvalidArgumentError(f"token ids must be a dense integer tensor: {exc}") from None
    elif isinstance(token_ids, np.ndarray):
        arr = token_ids
    elif isinstance(token_ids, (str, bytes, bytearray)) or token_ids is None:
        raise InvalidArgumentError(f"token ids must be a sequence of ints, got {token_ids!r}")
    else:
        try:
            items = list(token_ids)
        except TypeError:  # a scalar or another non-iterable
            raise InvalidArgumentError(
                f"token ids must be a sequence of ints, got {token_ids!r:.80}"
            ) from None
        if not items:
            return np.zeros(0, dtype="<i8")
        if set(map(type, items)) == _INT:  # plain ints (the common case): one C pass, one copy
            try:
                arr = np.fromiter(items, dtype="<i8", count=len(items))
            except OverflowError:  # beyond int64 either way
                top, bottom = max(items), min(items)
                bad = top if top >= 2**63 else bottom
                raise InvalidArgumentError(f"token id {bad} is outside [0, 2**63)") from None
            if int(arr.min()) < 0:
                raise InvalidArgumentError(f"token id {int(arr.min())} is outside [0, 2**63)")
            return arr
        try:
            arr = np.asarray(items)
        except (ValueError, TypeError) as exc:  # ragged nesting
            raise InvalidArgumentError(f"token ids are not a flat list of ints: {exc}") from exc
        # numpy turns [7, True] into int64 [7, 1]: look for bools among the items (in C)
        if arr.dtype.kind not in "iu" or not BOOL_TYPES.isdisjoint(map(type, items)):
            for i, tok in enumerate(items):
                require_index(f"token_ids[{i}]", tok, 2**63)
            raise InvalidArgumentError(f"token ids are not a flat list of ints: {items!r}")
    if arr.ndim != 1:
        raise InvalidArgumentError(f"token ids must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size:
        if arr.dtype.kind == "i" and int(arr.min()) < 0:
            raise InvalidArgumentError(f"token id {int(arr.min())} is outside [0, 2**63)")
        if arr.dtype.kind == "u" and int(arr.max()) >= 2**63:
            raise InvalidArgumentError(f"token id {int(arr.max())} is outside [0, 2**63)")
    return arr.astype("<i8", copy=True)


def encode_extra_keys(extra_keys: tuple[ExtraKey, ...] | list[ExtraKey]) -> bytes:
    """Canonical bytes of ``extra_keys`` (count, then per key a type tag and length prefix).

    Raises :class:`InvalidArgumentError` naming a key of unsupported type (bools included,
    so ``True`` never aliases ``1``) or a non-tuple/list container.
    """
    if not isinstance(extra_keys, (tuple, list)):
        raise InvalidArgumentError(
            f"extra_keys must be a tuple of str | int | bytes, got {extra_keys!r}"
        )
    parts = [_U64.pack(len(extra_keys))]
    for key in extra_keys:
        if isinstance(key, str):
            parts += [b"s", _lp(key.encode("utf-8"))]
        elif is_int(key):  # never a bool: True must not alias 1
            parts += [b"i", _lp(_int_bytes(key))]
        elif isinstance(key, bytes):
            parts += [b"b", _lp(key)]
        else:
            raise InvalidArgumentError(
                f"extra key {key!r} has unsupported type {type(key).__name__}; "
                "use str, int or bytes"
            )
    return b"".join(parts)


def check_block_hash(value: object, what: str = "block hash") -> BlockHash:
    """``value`` as a :data:`BlockHash`, or :class:`InvalidArgumentError` naming it."""
    if not isinstance(value, bytes) or len(value) != DIGEST_SIZE:
        raise InvalidArgumentError(f"{what} must be a {DIGEST_SIZE}-byte BlockHash, got {value!r}")
    return BlockHash(value)


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Seeded chained hasher of full blocks; a pure value, safe to share between threads.

    ``seed`` is a non-negative int (see :class:`~kvplane.config.HashConfig`); ``fingerprint`` is
    any bytes identifying the model and KV layout (e.g. ``KVLayout.fingerprint``). Hashes from
    hashers that differ in either never coincide (short of a BLAKE2b collision).
    """

    seed: int
    fingerprint: bytes
    _root: BlockHash = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        require_int("BlockHasher.seed", self.seed, min=0)
        if not isinstance(self.fingerprint, bytes):
            raise InvalidArgumentError(
                f"BlockHasher.fingerprint must be bytes, got {self.fingerprint!r}"
            )
        root = _digest(_ROOT_TAG + _lp(_int_bytes(self.seed)) + _lp(self.fingerprint))
        object.__setattr__(self, "_root", root)

    @classmethod
    def from_config(cls, config: HashConfig, fingerprint: bytes) -> BlockHasher:
        """A hasher seeded by ``config.seed`` for the model/layout named by ``fingerprint``."""
        return cls(seed=config.seed, fingerprint=fingerprint)

    @property
    def root(self) -> BlockHash:
        """The parent hash of the first block of every sequence (commits to seed + fingerprint)."""
        return self._root

    def hash_block(
        self,
        parent: BlockHash | None,
        token_ids: TokenIds,
        extra_keys: tuple[ExtraKey, ...] = (),
    ) -> BlockHash:
        """Hash one full block: ``H(parent or root, token_ids, extra_keys)`` (32 bytes).

        ``token_ids`` must be non-empty (see :func:`canonical_token_ids` for accepted forms);
        the hasher does not know the block size, so the caller passes exactly one full block.
        Raises :class:`InvalidArgumentError` for a malformed parent, token ids or extra key.
        """
        par = self._root if parent is None else check_block_hash(parent, "parent")
        tokens = canonical_token_ids(token_ids)
        if tokens.size == 0:
            raise InvalidArgumentError("hash_block needs at least one token id, got none")
        return self._hash(par, tokens, encode_extra_keys(extra_keys))

    def hash_blocks(
        self,
        token_ids: TokenIds,
        block_size: int,
        extra_keys: tuple[ExtraKey, ...] = (),
        parent: BlockHash | None = None,
    ) -> list[BlockHash]:
        """Chained hashes of the FULL blocks of ``token_ids`` (a partial tail is not hashed).

        Block ``i`` covers tokens ``[i*block_size, (i+1)*block_size)``; its parent is block
        ``i-1``'s hash, and block 0's parent is ``parent`` (``None`` = :attr:`root`), so a caller
        can continue a chain. ``extra_keys`` are mixed into every block. Returns ``[]`` when there
        is no full block. Raises :class:`InvalidArgumentError` for a non-positive block size or
        malformed input, before hashing anything.
        """
        require_int("block_size", block_size, min=1)
        par = self._root if parent is None else check_block_hash(parent, "parent")
        tokens = canonical_token_ids(token_ids)
        extra = encode_extra_keys(extra_keys)
        num_full = tokens.size // block_size
        blocks = tokens[: num_full * block_size].reshape(num_full, block_size)
        out: list[BlockHash] = []
        for row in blocks:  # a chain is inherently sequential: one digest per block
            par = self._hash(par, row, extra)
            out.append(par)
        return out

    @staticmethod
    def _hash(parent: BlockHash, tokens: np.ndarray, extra: bytes) -> BlockHash:
        body = np.ascontiguousarray(tokens, dtype="<i8").tobytes()
        return _digest(_BLOCK_TAG + parent + _U64.pack(tokens.size) + body + extra)
