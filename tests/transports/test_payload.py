"""Payload streaming: every path (one span, vectored, staged, direct) lands exact bytes."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
import torch

from kvplane.ids import RegionId
from kvplane.transports import payload
from kvplane.transports.base import DescriptorList
from kvplane.transports.payload import recv_payload, send_payload, staging_buffer

SRC, DST = RegionId(1), RegionId(2)


def _descs(region: RegionId, offsets: np.ndarray, block: int) -> DescriptorList:
    n = len(offsets)
    return DescriptorList(np.full(n, int(region)), offsets.astype(np.int64), np.full(n, block))


class _Recorder:
    """A socket stand-in that records each ``sendall``'s length."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.data = bytearray()

    def sendall(self, data: memoryview) -> None:
        self.calls.append(len(data))
        self.data += bytes(data)


@pytest.mark.parametrize("block", [512, 4096])
def test_a_contiguous_source_goes_in_one_sendall_whatever_its_run_length(
    block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Paged-size runs back to back in memory: one ``sendall``, neither staging nor vectored."""
    vectored_calls: list[int] = []
    monkeypatch.setattr(payload.vectored, "usable", lambda sock, views: True)
    monkeypatch.setattr(payload.vectored, "send_runs", lambda s, iov: vectored_calls.append(1))
    src = torch.arange(64 * block, dtype=torch.int64).to(torch.uint8)
    descs = _descs(SRC, np.arange(64) * block, block)
    rec = _Recorder()
    send_payload(rec, {SRC: src}, descs, staging_buffer())  # type: ignore[arg-type]
    assert (rec.calls, vectored_calls) == ([64 * block], [])
    assert bytes(rec.data) == bytes(src.numpy())


@pytest.mark.parametrize("block", [8, 4096, 96 << 10])
@pytest.mark.parametrize("contiguous_src", [True, False])
def test_every_path_lands_each_run_at_its_destination(block: int, contiguous_src: bool) -> None:
    n = 48
    rng = np.random.default_rng(block)
    src_off = np.arange(n) * block if contiguous_src else rng.permutation(n) * block
    dst_off = rng.permutation(n) * block
    src = torch.from_numpy(rng.integers(0, 256, n * block, dtype=np.uint8))
    dst = torch.zeros(n * block + 64, dtype=torch.uint8)
    a, b = socket.socketpair()
    sender = threading.Thread(
        target=send_payload, args=(a, {SRC: src}, _descs(SRC, src_off, block), staging_buffer())
    )
    sender.start()
    try:
        recv_payload(b, {DST: dst}, _descs(DST, dst_off, block), staging_buffer())
    finally:
        sender.join()
        a.close()
        b.close()
    expected = torch.zeros_like(dst)
    for s, d in zip(src_off.tolist(), dst_off.tolist(), strict=True):
        expected[d : d + block] = src[s : s + block]
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("block", [100, 4096])
def test_a_contiguous_destination_is_one_receive(
    block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    got: list[int] = []
    monkeypatch.setattr(payload, "recv_exact", lambda sock, view: got.append(len(view)))
    monkeypatch.setattr(payload.vectored, "usable", lambda sock, views: True)
    monkeypatch.setattr(payload.vectored, "recv_into_runs", lambda s, iov: got.append(-1))
    dst = torch.zeros(32 * block, dtype=torch.uint8)
    descs = _descs(DST, np.arange(32) * block, block)
    recv_payload(None, {DST: dst}, descs, staging_buffer())  # type: ignore[arg-type]
    assert got == [32 * block]
