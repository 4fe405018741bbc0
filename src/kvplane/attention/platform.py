"""Where an attention problem runs: device type, CUDA architecture, CPU ISA, importable packages.

:class:`Platform` is a value read once per device (:func:`platform_of`); selection filters its
candidates by it before it looks at the problem, so a backend that cannot run here at all is
skipped, not counted as a fallback. It owns detection only: what a backend needs is declared in
its :class:`~kvplane.attention.base.Capabilities`. See docs/attention.md.
"""

from __future__ import annotations

import functools
import importlib.util
import platform as host
from dataclasses import dataclass

import torch

from kvplane.native import cpu_flags


@dataclass(frozen=True, slots=True)
class Platform:
    """One device's platform: ``device`` type (``cpu``, ``cuda``, ...), the CUDA ``cuda_arch``
    ``(major, minor)`` of a CUDA device (None elsewhere or unknown), the CPU's ISA flags
    (``avx2``, ``avx512f``, ``neon``...; empty where unknown) and its ``machine`` name."""

    device: str
    cuda_arch: tuple[int, int] | None = None
    cpu_isa: frozenset[str] = frozenset()
    machine: str = ""

    def has_package(self, name: str) -> bool:
        """Whether the Python package ``name`` can be imported in this process."""
        return _importable(name)


@functools.cache
def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@functools.lru_cache(maxsize=16)
def _detect(device_type: str, index: int | None) -> Platform:
    arch: tuple[int, int] | None = None
    if device_type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(index)
        arch = (int(major), int(minor))
    return Platform(device_type, arch, cpu_flags(), host.machine().lower())


def platform_of(device: torch.device) -> Platform:
    """The platform of ``device`` (read once per device and cached for the process)."""
    return _detect(device.type, device.index)
