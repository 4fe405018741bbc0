"""Pointer-addressed engines' tables: metadata rows, peer tables, addresses; CPU-only cores."""

from __future__ import annotations

import pytest
import torch

from kvplane.errors import TransportError
from kvplane.ids import PeerId, RegionId
from kvplane.transports.base import DescriptorList
from kvplane.transports.core import TransportCore
from kvplane.transports.pointers import addresses, local_bases, peer_tables, region_infos
from kvplane.transports.regions import RegionTable
from kvplane.transports.wire import Metadata, RegionInfo


def test_addresses_are_base_plus_offset_as_int64():
    descs = DescriptorList.of([(2, 5, 10), (1, 0, 3), (2, 0, 1)])
    got = addresses({RegionId(1): 1000, RegionId(2): 5000}, descs, "Eng")
    assert str(got.dtype) == "int64"
    assert got.tolist() == [5005, 1000, 5000]
    assert addresses({}, DescriptorList.empty(), "Eng").tolist() == []


def test_addresses_name_the_engine_and_the_missing_regions():
    with pytest.raises(TransportError, match=r"^Eng has no base address for region\(s\) \[3\]$"):
        addresses({RegionId(1): 0}, DescriptorList.of([(3, 0, 1), (1, 0, 1)]), "Eng")
    with pytest.raises(TransportError, match=r"\[1\]"):
        addresses({}, DescriptorList.of([(1, 0, 1)]), "Eng")


def test_region_rows_and_bases_of_a_table():
    table = RegionTable()
    buf = torch.zeros(16, dtype=torch.uint8)
    region = table.add(buf, exported=True, extra=None)
    rid = int(region.region_id)
    assert region_infos(table.entries()) == [RegionInfo(rid, 16, buf.data_ptr())]
    assert local_bases(table.entries()) == {RegionId(rid): buf.data_ptr()}


def test_peer_tables_read_lengths_and_bases():
    meta = Metadata(1, "nixl", "far", regions=[RegionInfo(4, 100, 7000), RegionInfo(9, 8, 50)])
    peer, bases = peer_tables(meta)
    assert peer.peer_id == PeerId("far")
    assert peer.regions == {RegionId(4): 100, RegionId(9): 8}
    assert bases == {RegionId(4): 7000, RegionId(9): 50}


class _CpuOnly(TransportCore):
    name = "cpuonly"
    _cpu_only = True


def test_a_cpu_only_core_refuses_other_memory_and_keeps_cpu_memory():
    t = _CpuOnly(agent="a")
    try:
        with pytest.raises(
            TransportError, match=r"^the cpuonly adapter registers CPU memory, got meta$"
        ):
            t.register(torch.empty(8, dtype=torch.uint8, device="meta"))
        assert t.regions() == []
        assert t.register(torch.zeros(8, dtype=torch.uint8)).length == 8
    finally:
        t.close()
