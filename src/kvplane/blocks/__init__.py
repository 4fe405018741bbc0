"""L1 blocks: chained block hashing, the block pool (ref counts, LRU free queue, prefix-cache
map) and per-request block tables with prefix match and token-range accounting."""

from kvplane.blocks.free_queue import FreeBlockQueue
from kvplane.blocks.hashing import (
    DIGEST_SIZE,
    BlockHasher,
    ExtraKey,
    TokenIds,
    canonical_token_ids,
    check_block_hash,
    encode_extra_keys,
)
from kvplane.blocks.pool import BlockPool
from kvplane.blocks.table import AdmitResult, BlockTable, TableState, consecutive_runs

__all__ = [
    "DIGEST_SIZE",
    "AdmitResult",
    "BlockHasher",
    "BlockPool",
    "BlockTable",
    "ExtraKey",
    "FreeBlockQueue",
    "TableState",
    "TokenIds",
    "canonical_token_ids",
    "check_block_hash",
    "consecutive_runs",
    "encode_extra_keys",
]
