"""L3 offload: chunk-granular tiered KV storage (host memory, disk, Redis) with slot status,
eviction policies, admission, transfer jobs and the device fence."""

from kvplane.offload.admission import AdmissionFilter
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
    lookup_tiers,
)
from kvplane.offload.slots import SlotStatus, SlotTable

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
    "LoadTicket",
    "LookupResult",
    "OffloadConfig",
    "OffloadManager",
    "SlotStatus",
    "SlotTable",
    "StoreDone",
    "StorePlan",
    "TierCascade",
    "TransferJob",
    "build_cascade",
    "lookup_tiers",
]
