"""Synthetic KV: bytes that are a pure function of token, position, layer, component, head, dim.

Written and checked bit-exactly on any layout, vectorised per run of block ids. See
docs/serving.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvplane.blocks.table import consecutive_runs
from kvplane.errors import InvalidArgumentError
from kvplane.ids import TokenRange
from kvplane.layout import KVLayout
from kvplane.serving.producers.base import PoolTensor
from kvplane.serving.producers.synthetic_native import xor_blocks
from kvplane.validators import require_int

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT_OF_SIZE = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _wrap64(value: int) -> int:
    """``value`` (< 2**64) as the signed int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _words_fit(view: torch.Tensor, size: int) -> bool:
    """Can ``view`` (elements of ``size`` bytes) be seen as int64 words along its last axis?"""
    ratio = 8 // size
    return (
        size < 8
        and view.stride(-1) == 1
        and view.shape[-1] % ratio == 0
        and view.storage_offset() % ratio == 0
        and all(st % ratio == 0 for st in view.stride()[:-1])
    )


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * _M1
        x = x ^ (x >> np.uint64(27))
        x = x * _M2
        out: np.ndarray = x ^ (x >> np.uint64(31))
        return out


def _token_rows(rows: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Values in token order ``[T, layers, comps, local_heads, dim]`` as element-sized ints
    (one broadcast pass, GIL released)."""
    return torch.bitwise_xor(rows[:, None], grid.reshape(1, -1)).view(len(rows), *grid.shape)


CHUNK_BYTES = 4 << 20
"""Expected values are formed at most this many bytes at a time (a scattered write, a check):
temporaries stay on the allocator's heap (a fresh multi-MiB mapping would cost a page fault per
4 KiB)."""


def _whole_blocks(
    layout: KVLayout, canon: torch.Tensor, rows: torch.Tensor, grid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The canonical pool view ``canon`` as integers, and the two factors whose broadcast XOR
    is the synthetic values of whole blocks in its block order ``[n, L, C, Tb, H, D]``
    (``rows``: ``n * block_size`` token rows): ``(pool_ints, row [n, 1, 1, Tb, 1, 1], cols [1,
    L, C, 1, H, D])``. When the elements pack into 8-byte words all three are int64 words (one
    op per eight bytes: every lane of a word holds its token's value), else element-sized ints.
    Allocates nothing of the values' size."""
    size, bs = layout.element_size, layout.block_size
    dst, row, cols = canon.view(_INT_OF_SIZE[size]), rows, grid
    if _words_fit(dst, size):
        lanes = sum(1 << (8 * size * k) for k in range(8 // size))
        row = (row.to(torch.int64) & ((1 << (8 * size)) - 1)) * _wrap64(lanes)
        dst, cols = dst.view(torch.int64), grid.view(torch.int64)
    nb = len(rows) // bs
    return dst, row.view(nb, 1, 1, bs, 1, 1), cols.unsqueeze(2).unsqueeze(0)


def _block_bytes(pool_ints: torch.Tensor) -> int:
    return int(pool_ints[0].numel() * pool_ints.element_size())


RUN_MIN_BYTES = 64 << 10
"""Runs of consecutive blocks at least this long on average are worth one op each (the call
overhead is amortised); shorter ones go chunk by chunk through a temporary."""


def slots_of(block_ids: Sequence[int], block_size: int, tokens: TokenRange) -> np.ndarray:
    """``(block, offset)`` pairs as int64 ``[2, T]`` for the positions of ``tokens``."""
    pos = np.arange(tokens.start, tokens.end, dtype=np.int64)
    table = np.asarray(block_ids, dtype=np.int64)
    if len(pos) and -(-tokens.end // block_size) > len(table):
        raise InvalidArgumentError(
            f"block table of {len(table)} blocks of {block_size} cannot hold tokens {tokens}"
        )
    return np.stack([table[pos // block_size], pos % block_size])


def _pieces(
    layout: KVLayout, block_ids: Sequence[int], tokens: TokenRange
) -> list[tuple[torch.Tensor | int, slice, slice]]:
    """``tokens`` as at most three pieces: (blocks, token offsets in a block, rows of ``tokens``).

    The whole blocks in the middle are one piece indexed by a block-id tensor; a partial first
    or last block is a piece indexed by one block id. Vectorised: no loop over blocks.
    """
    bs = layout.block_size
    table = np.asarray(block_ids, dtype=np.int64)
    if -(-tokens.end // bs) > len(table):
        raise InvalidArgumentError(
            f"block table of {len(table)} blocks of {bs} cannot hold tokens {tokens}"
        )
    a = min(tokens.end, -(-tokens.start // bs) * bs)
    b = max(a, (tokens.end // bs) * bs)
    out: list[tuple[torch.Tensor | int, slice, slice]] = []
    s0 = tokens.start
    if tokens.start < a:
        first = tokens.start % bs
        out.append((int(table[tokens.start // bs]), slice(first, first + a - s0), slice(0, a - s0)))
    if a < b:
        out.append((torch.from_numpy(table[a // bs : b // bs]), slice(0, bs),
                    slice(a - s0, b - s0)))  # fmt: skip
    if b < tokens.end:
        out.append((int(table[b // bs]), slice(0, tokens.end - b), slice(b - s0, tokens.end - s0)))
    return out


class SyntheticKV:
    """The synthetic value function for pools of one layout family (any block size/order/TP)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = require_int("seed", seed, min=0)

    def _parts(
        self, layout: KVLayout, token_ids: np.ndarray, positions: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The two factors of :meth:`values`: per-token rows ``[T]`` and per-column grid
        ``[layers, comps, local_heads, dim]``, as signed ints of the element size."""
        tok = np.asarray(token_ids, dtype=np.int64).astype(np.uint64)
        pos = np.asarray(positions, dtype=np.int64).astype(np.uint64)
        if tok.shape != pos.shape or tok.ndim != 1:
            raise InvalidArgumentError(
                f"token_ids {tok.shape} and positions {pos.shape} must be equal 1-D shapes"
            )
        layers = np.asarray(layout.layer_ids, dtype=np.uint64)
        comps = np.arange(layout.num_components, dtype=np.uint64)
        heads = np.arange(*layout.head_range, dtype=np.uint64)
        dims = np.arange(layout.head_dim, dtype=np.uint64)
        with np.errstate(over="ignore"):
            base = _mix(tok * np.uint64(0x9E3779B97F4A7C15) + np.uint64(self.seed))
            base = _mix(base ^ (pos * np.uint64(0xD1B54A32D192ED03)))
            cols = _mix(
                (layers * np.uint64(0x8CB92BA72F3D8DD7))[:, None, None, None]
                + (comps * np.uint64(0xF1357AEA2E62A9C5))[None, :, None, None]
                + (heads * np.uint64(0xAEF17502108EF2D9))[None, None, :, None]
                + (dims * np.uint64(0x2545F4914F6CDD1D))[None, None, None, :]
            )
        size = layout.element_size
        kind = _NP_INT_OF_SIZE[size]
        rows = torch.from_numpy(base.view(np.int64).astype(kind) if size < 8 else base.view(kind))
        grid = torch.from_numpy(cols.view(np.int64).astype(kind) if size < 8 else cols.view(kind))
        return rows, grid

    def values(
        self, layout: KVLayout, token_ids: np.ndarray, positions: np.ndarray
    ) -> torch.Tensor:
        """Elements ``[T, layers, comps, local_heads, dim]`` of ``layout.dtype`` for the tokens.

        ``token_ids`` and ``positions`` are int64 ``[T]``; heads are the layout's TP range.
        """
        rows, grid = self._parts(layout, token_ids, positions)
        return _token_rows(rows, grid).view(layout.dtype)

    def _span(
        self, pool: PoolTensor, token_ids: np.ndarray, tokens: TokenRange
    ) -> tuple[KVLayout, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(layout, canonical pool view, rows, grid)`` of ``tokens`` of the whole sequence
        ``token_ids``: what :meth:`write` and :meth:`mismatches` both start from."""
        ids = np.asarray(token_ids)[tokens.start : tokens.end]
        rows, grid = self._parts(pool.layout, ids, np.arange(tokens.start, tokens.end))
        return pool.layout, pool.layout.canonical_view(pool.tensor), rows, grid

    def write(
        self, pool: PoolTensor, token_ids: np.ndarray, block_ids: Sequence[int], tokens: TokenRange
    ) -> None:
        """Store the synthetic KV of ``tokens`` (``token_ids`` is the whole sequence) into
        ``pool`` through the request's ``block_ids``. Mutates ``pool`` only at those slots.

        Whole blocks are computed straight into the pool in its canonical order ``[n, L, C,
        Tb, H, D]``: on CPU one broadcast XOR per run of consecutive block ids, written by the
        streaming-store C kernel
        (:func:`~kvplane.serving.producers.synthetic_native.xor_blocks`) or else
        by torch with ``out=`` (runs shorter than :data:`RUN_MIN_BYTES` on average go chunk by
        chunk through a temporary and NumPy's row scatter). A step costs about one pass over its
        bytes (36 MiB of 61 MLA layers in one run: 2.4 ms, against 20 ms for a whole-step
        temporary and a scatter, most of it page faults) -- a stand-in for model compute must
        leave the cores to the transport."""
        if tokens.empty:
            return
        layout, canon, rows, grid = self._span(pool, token_ids, tokens)  # [B, L, C, Tb, H, D]
        for blocks, offs, sel in _pieces(layout, block_ids, tokens):  # at most three pieces
            if isinstance(blocks, int):
                view = _token_rows(rows[sel], grid).view(layout.dtype)
                canon[blocks, :, :, offs] = view.permute(1, 2, 0, 3, 4)
                continue
            dst, row, cols = _whole_blocks(layout, canon, rows[sel], grid)
            if dst.device.type != "cpu":
                dst.index_copy_(0, blocks.to(dst.device), (row ^ cols).to(dst.device))
                continue
            ids, nbytes = blocks.numpy(), _block_bytes(dst)
            runs = consecutive_runs(ids)
            if len(runs) * RUN_MIN_BYTES <= len(ids) * nbytes:  # long runs: XOR into the pool
                for a, z in runs:
                    b = int(ids[a])
                    if not xor_blocks(dst[b : b + z - a], row[a:z], cols):
                        torch.bitwise_xor(row[a:z], cols, out=dst[b : b + z - a])
                continue
            per = max(1, CHUNK_BYTES // nbytes)  # short runs: chunk by chunk, NumPy's scatter
            for k in range(0, len(ids), per):
                dst.numpy()[ids[k : k + per]] = (row[k : k + per] ^ cols).numpy()

    def mismatches(
        self, pool: PoolTensor, token_ids: np.ndarray, block_ids: Sequence[int], tokens: TokenRange
    ) -> int:
        """How many elements of ``tokens`` in ``pool`` differ from the synthetic KV (bit-exact)."""
        if tokens.empty:
            return 0
        layout, canon, rows, grid = self._span(pool, token_ids, tokens)
        ints = _INT_OF_SIZE[layout.element_size]
        bad = 0
        for blocks, offs, sel in _pieces(layout, block_ids, tokens):
            if isinstance(blocks, int):  # a partial block: token order [t, L, C, H, D]
                got = canon[blocks, :, :, offs].permute(2, 0, 1, 3, 4).contiguous().view(ints)
                bad += int((got != _token_rows(rows[sel], grid)).sum())
                continue
            # whole blocks, compared in the pool's own order by runs of consecutive ids (no
            # gathered copy); elements are counted one by one only when some word differs
            pool_ints, row, cols = _whole_blocks(layout, canon, rows[sel], grid)
            ids, nbytes = blocks.numpy(), _block_bytes(pool_ints)
            per = max(1, CHUNK_BYTES // nbytes)
            runs = consecutive_runs(ids)
            direct = len(runs) * RUN_MIN_BYTES <= len(ids) * nbytes
            if not direct:  # short runs: gathered chunk by chunk
                runs = [(k, min(k + per, len(ids))) for k in range(0, len(ids), per)]
            for a, z in runs:
                for k in range(a, z, per):
                    m = min(per, z - k)
                    if direct:
                        b = int(ids[a]) + k - a
                        got = pool_ints[b : b + m]
                    else:
                        got = pool_ints.index_select(0, blocks[k : k + m])
                    want = (row[k : k + m] ^ cols).to(got.device)
                    if not torch.equal(got, want):
                        bad += int((got.view(ints) != want.view(ints)).sum())
        return bad

    def state_bytes(self, token_ids: np.ndarray, nbytes: int) -> torch.Tensor:
        """A whole-only per-request state of ``nbytes`` uint8: a function of every prompt token."""
        tok = np.asarray(token_ids, dtype=np.int64).astype(np.uint64)
        pos = np.arange(len(tok), dtype=np.uint64)
        with np.errstate(over="ignore"):
            per_token = _mix(tok * np.uint64(0x9E3779B97F4A7C15) + pos * _M1 + np.uint64(self.seed))
            acc = _mix(np.bitwise_xor.reduce(per_token, initial=np.uint64(len(tok))))
            idx = np.arange((nbytes + 7) // 8, dtype=np.uint64)
            words = _mix(idx * np.uint64(0x9E3779B97F4A7C15) + acc)
        return torch.from_numpy(words.view(np.uint8)[:nbytes].copy())

    def first_token(self, token_ids: np.ndarray, vocab_size: int) -> int:
        """The synthetic 'sampled' first token: a function of the whole prompt."""
        return int(self.state_bytes(token_ids, 8).view(torch.int64).item() % vocab_size)
