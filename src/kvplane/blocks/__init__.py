"""L1 blocks: chained block hashing, the block pool (ref counts, LRU free queue, prefix-cache
map), per-request block tables with prefix match and token-range accounting, and the rules
joining one request's tables across a model's KV cache groups."""

from kvplane.blocks.free_queue import FreeBlockQueue
from kvplane.blocks.groups import (
    GroupShort,
    Windowed,
    admit_groups,
    after_step,
    drop_windows,
    grow_groups,
    short_group,
    window_peak,
)
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
from kvplane.blocks.table import AdmitResult, BlockTable, Growth, TableState, consecutive_runs

__all__ = [
    "DIGEST_SIZE",
    "AdmitResult",
    "BlockHasher",
    "BlockPool",
    "BlockTable",
    "ExtraKey",
    "FreeBlockQueue",
    "GroupShort",
    "Growth",
    "TableState",
    "TokenIds",
    "Windowed",
    "admit_groups",
    "after_step",
    "canonical_token_ids",
    "check_block_hash",
    "consecutive_runs",
    "drop_windows",
    "encode_extra_keys",
    "grow_groups",
    "short_group",
    "window_peak",
]
