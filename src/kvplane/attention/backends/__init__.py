"""Attention backends, one file each; :func:`default_registry` lists them in ``auto`` order.

GPU engines come first (skipped by the platform filter where no GPU, architecture or package
lets them run: not a fallback), then the CPU/torch backends, then the float64 oracles.
"""

from __future__ import annotations

from kvplane.attention.backends.cpu_fused import CPUFusedBackend
from kvplane.attention.backends.flashinfer_mla import FlashInferMLABackend
from kvplane.attention.backends.gqa_reference import GQAReferenceBackend
from kvplane.attention.backends.gqa_torch import GQATorchBackend
from kvplane.attention.backends.mha import MHABackend
from kvplane.attention.backends.reference import ReferenceBackend
from kvplane.attention.backends.sdpa import SDPABackend
from kvplane.attention.backends.torch_mla import TorchMLABackend
from kvplane.attention.backends.torch_splitkv import TorchSplitKVBackend
from kvplane.attention.backends.triton_mla import TritonMLABackend
from kvplane.attention.base import BackendRegistry

__all__ = [
    "CPUFusedBackend",
    "FlashInferMLABackend",
    "GQAReferenceBackend",
    "GQATorchBackend",
    "MHABackend",
    "ReferenceBackend",
    "SDPABackend",
    "TorchMLABackend",
    "TorchSplitKVBackend",
    "TritonMLABackend",
    "default_registry",
]


def default_registry() -> BackendRegistry:
    """A fresh registry of every built-in backend, in ``auto`` order."""
    return BackendRegistry(
        [
            FlashInferMLABackend(),
            TritonMLABackend(),
            TorchMLABackend(),
            TorchSplitKVBackend(),
            SDPABackend(),
            CPUFusedBackend(),
            MHABackend(),
            ReferenceBackend(),
            GQATorchBackend(),
            GQAReferenceBackend(),
        ]
    )
