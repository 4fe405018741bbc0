"""L4 offload: chunk-granular tiered KV storage (host memory, disk, Redis) with slot status,
eviction policies, admission, the tier book (every cascade decision, tensor-free), transfer
jobs, the device fence and the cascade that executes the book in one process."""

from kvplane.offload.admission import AdmissionFilter
from kvplane.offload.book import TierBook
from kvplane.offload.book_types import (
    LoadReservation,
    Promotion,
    StoreReservation,
    TierIndex,
    TierWrite,
    WriteDown,
)
from kvplane.offload.cascade import TierCascade, build_cascade
from kvplane.offload.config import OffloadConfig
from kvplane.offload.copier import ChunkCopier
from kvplane.offload.events import CascadeDone, LoadDone, LoadTicket, StoreDone
from kvplane.offload.jobs import BlockFence, JobResult, JobRunner, TransferJob
from kvplane.offload.manager import (
    CascadeLookup,
    ChunkLookup,
    LoadPlan,
    LookupResult,
    OffloadManager,
    StorePlan,
)
from kvplane.offload.slots import SlotStatus, SlotTable
from kvplane.offload.spans import lookup_tiers

__all__ = [
    "AdmissionFilter",
    "BlockFence",
    "CascadeDone",
    "CascadeLookup",
    "ChunkCopier",
    "ChunkLookup",
    "JobResult",
    "JobRunner",
    "LoadDone",
    "LoadPlan",
    "LoadReservation",
    "LoadTicket",
    "LookupResult",
    "OffloadConfig",
    "OffloadManager",
    "Promotion",
    "SlotStatus",
    "SlotTable",
    "StoreDone",
    "StorePlan",
    "StoreReservation",
    "TierBook",
    "TierCascade",
    "TierIndex",
    "TierWrite",
    "TransferJob",
    "WriteDown",
    "build_cascade",
    "lookup_tiers",
]
