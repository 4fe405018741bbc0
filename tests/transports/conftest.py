"""Shared helpers of the transport tests: random batches, an independent reference, waiting.

The reference (:meth:`Kit.reference`) computes what a batch must do with a plain torch gather and
scatter over index tensors built from the descriptors (no ``copier`` code), so transports are
checked against an implementation that shares nothing with theirs.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvplane.ids import RegionId
from kvplane.transports.base import DescriptorList, Handle, Poll, Transport

# Byte-run helpers live in runs_testlib.py beside this file (importlib mode puts no test
# directory on sys.path; this one is, for the transport tests only).
sys.path.insert(0, str(Path(__file__).resolve().parent))


class Kit:
    @staticmethod
    def byte_index(descs: DescriptorList) -> torch.Tensor:
        """Every byte offset the descriptors cover, in descriptor order (int64 tensor)."""
        lengths = descs.lengths
        starts = np.repeat(descs.offsets - (np.cumsum(lengths) - lengths), lengths)
        return torch.from_numpy(starts + np.arange(int(lengths.sum())))

    @staticmethod
    def reference(
        src: torch.Tensor, dst: torch.Tensor, s: DescriptorList, d: DescriptorList
    ) -> torch.Tensor:
        """``dst`` after moving ``s[i]`` of ``src`` to ``d[i]`` (single-region lists)."""
        out = dst.clone()
        out[Kit.byte_index(d)] = src[Kit.byte_index(s)]
        return out

    @staticmethod
    def random_batch(
        rng: np.random.Generator, src_region: int, src_len: int, dst_region: int, dst_len: int,
        *, max_desc: int = 64, max_run: int = 4096,
    ) -> tuple[DescriptorList, DescriptorList]:  # fmt: skip
        """Random pairs: sources anywhere (may overlap), destinations pairwise disjoint."""
        n = int(rng.integers(1, max_desc + 1))
        lengths = rng.integers(1, max_run + 1, size=n)
        lengths = lengths[np.cumsum(lengths) <= dst_len] if lengths.sum() > dst_len else lengths
        if len(lengths) == 0:
            lengths = np.array([min(max_run, dst_len)])
        n = len(lengths)
        slack = dst_len - int(lengths.sum())
        gaps = np.sort(rng.integers(0, slack + 1, size=n))
        order = rng.permutation(n)
        starts = np.cumsum(lengths[order]) - lengths[order] + gaps
        dst_off = np.empty(n, dtype=np.int64)
        dst_off[order] = starts
        src_off = rng.integers(0, src_len - lengths + 1)
        src = DescriptorList(np.full(n, src_region), src_off, lengths)
        dst = DescriptorList(np.full(n, dst_region), dst_off, lengths)
        return src, dst

    @staticmethod
    def wait(transport: Transport, handle: Handle, timeout_s: float = 20.0) -> Poll:
        """Poll until terminal (or ``timeout_s``, returning the last, pending, poll)."""
        end = time.monotonic() + timeout_s
        while True:
            got = transport.poll(handle)
            if got.state.terminal or time.monotonic() > end:
                return got
            time.sleep(2e-4)

    @staticmethod
    def settle(t: Transport, timeout_s: float = 20.0) -> None:
        """Wait until ``t`` holds no pinned region and no live batch, then assert it does not."""
        end = time.monotonic() + timeout_s
        while (t.pinned_regions() or t.live_batches()) and time.monotonic() < end:
            time.sleep(1e-3)
        assert t.pinned_regions() == 0 and t.live_batches() == 0

    @staticmethod
    def kv_threads() -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("kvplane-"))

    @staticmethod
    def one(region: RegionId | int, offset: int, length: int) -> DescriptorList:
        return DescriptorList.of([(int(region), offset, length)])


@pytest.fixture(scope="session")
def kit() -> type[Kit]:
    return Kit
