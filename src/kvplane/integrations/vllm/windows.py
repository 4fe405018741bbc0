"""Which of a request's blocks vLLM keeps in a KV cache group with a sliding window.

Owns :class:`KVWindow`, vLLM's rule for a ``SlidingWindowSpec`` group (every layer windowed,
or the window layers of a hybrid model, a group of their own): blocks wholly before the window
of the next token are freed and their table entries become the null block (id 0); and
:func:`spec_window`, reading it from a group's spec. The connector reads this rule to match,
load, receive and store only blocks vLLM really holds. Plain data, no vLLM import. See
``docs/vllm.md`` ("Sliding windows and hybrids").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvplane.errors import UnsupportedError
from kvplane.validators import require_int

NULL_BLOCK = 0
"""vLLM's null block: the table entry of a freed (skipped) block; never holds a request's KV."""

UNSUPPORTED_SPECS = ("ChunkedLocalAttentionSpec", "RSWASpec", "CircularBufferSpec", "MambaSpec")
"""vLLM KV cache spec kinds that free or reuse blocks by rules this connector does not follow."""


@dataclass(frozen=True, slots=True)
class KVWindow:
    """A sliding window of ``tokens`` positions (vLLM's ``sliding_window``; the token at ``p``
    reads ``(p - tokens, p]``) over blocks of ``block_size`` tokens; ``retained`` extra tokens
    below it stay allocated (vLLM's ``extra_retained_tokens``)."""

    tokens: int
    block_size: int
    retained: int = 0

    def __post_init__(self) -> None:
        require_int("sliding window", self.tokens, min=2)  # 1: a load could hold no block
        require_int("block_size", self.block_size, min=1)
        require_int("extra retained tokens", self.retained, min=0)

    def skipped_tokens(self, computed: int) -> int:
        """Tokens before the window of the token after ``computed`` ones: vLLM frees their
        blocks (``SlidingWindowManager.get_num_skipped_tokens``)."""
        return max(0, computed - self.tokens + 1 - self.retained)

    def first_kept_block(self, computed: int) -> int:
        """Index of the first block vLLM still holds once ``computed`` tokens exist: every
        block before it is the null block in the request's table."""
        return self.skipped_tokens(computed) // self.block_size


def first_kept_block(window: KVWindow | None, computed: int) -> int:
    """:meth:`KVWindow.first_kept_block`, 0 without a window (vLLM keeps every block)."""
    return 0 if window is None else window.first_kept_block(computed)


def holds_null(block_ids: Sequence[int]) -> bool:
    """True when any of ``block_ids`` is vLLM's null block (a freed, skipped block)."""
    return any(int(b) == NULL_BLOCK for b in block_ids)


def spec_window(spec: Any) -> KVWindow | None:
    """The window of one vLLM KV cache group's ``kv_cache_spec`` (read by class name, no vLLM
    import), or ``None`` when vLLM keeps every block of it (full attention, and window layers
    vLLM promoted to full attention with its hybrid allocator off). :class:`UnsupportedError`
    naming a spec in :data:`UNSUPPORTED_SPECS`."""
    spec = getattr(spec, "first_spec", spec)  # UniformTypeKVCacheSpecs: layers of one kind
    if bad := spec_refusal(spec):
        raise UnsupportedError(f"kvplane's vLLM connector does not support {bad} layers")
    if "SlidingWindowSpec" not in {c.__name__ for c in type(spec).__mro__}:
        return None
    retained = int(getattr(spec, "extra_retained_tokens", 0) or 0)
    return KVWindow(int(spec.sliding_window), int(spec.block_size), retained)


def spec_refusal(spec: Any) -> str:
    """The kind in :data:`UNSUPPORTED_SPECS` that ``spec`` (one layer kind) is, else ``""``."""
    spec = getattr(spec, "first_spec", spec)
    bad = sorted({c.__name__ for c in type(spec).__mro__}.intersection(UNSUPPORTED_SPECS))
    return bad[0] if bad else ""


def freed_any(table: Sequence[int], at: Sequence[int], block_ids: Sequence[int]) -> bool:
    """True when some ``block_ids[i]``, read from slot ``at[i]`` of a request's block table, is
    no longer there in ``table`` (vLLM freed it: it left the window, its slot is the null
    block and the block may hold another request's KV)."""
    return any(i >= len(table) or int(table[i]) != b for i, b in zip(at, block_ids, strict=True))
