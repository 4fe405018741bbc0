"""Eviction policies for offload tiers: the protocol, LRU, ARC and a name registry."""

from kvplane.offload.policies.arc import ARCPolicy
from kvplane.offload.policies.base import EvictionPolicy
from kvplane.offload.policies.lru import LRUPolicy
from kvplane.offload.policies.registry import POLICIES, make_policy

__all__ = ["POLICIES", "ARCPolicy", "EvictionPolicy", "LRUPolicy", "make_policy"]
