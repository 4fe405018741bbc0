"""The pool advert in the PD handshake, and the worker pools it describes."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from kvplane.errors import BlockStateError, LayoutError, ProtocolError
from kvplane.ids import RegionId
from kvplane.layout import LAYER_MAJOR, KVLayout
from kvplane.pd.handshake import PROTOCOL_VERSION, LayoutInfo, PeerProfile
from kvplane.pipeline.advert import (
    LayoutDesc,
    PoolAdvert,
    RemotePool,
    decode_advert,
    describe,
    encode_advert,
    rebuild,
    split_destination,
)
from kvplane.serving.pools import TAIL_BYTES, TailRecord, WorkerPools, prompt_digest
from kvplane.serving.producers.synthetic import SyntheticModel, SyntheticSpec
from kvplane.state_split import MambaGeometry, StateSplit
from kvplane.transports.local import LocalTransport

SPEC = SyntheticSpec(kind="gqa", num_layers=2, kv_heads=4, head_dim=8, state_dim=12)


@pytest.fixture
def pools() -> WorkerPools:
    return WorkerPools(
        SyntheticModel(SPEC),
        LocalTransport(),
        num_blocks=10,
        block_size=4,
        num_slots=3,
        head_range=(1, 3),
    )


def test_layouts_rebuild_exactly() -> None:
    lay = KVLayout.gqa(
        num_blocks=7,
        block_size=4,
        num_layers=3,
        kv_heads=8,
        head_dim=16,
        head_range=(2, 6),
        order=LAYER_MAJOR,
        sliding_window=32,
    )
    back = rebuild(describe(lay))
    assert back == lay and back.fingerprint() == lay.fingerprint()
    bad = msgspec.structs.replace(describe(lay), order=("BLOCK",) * 6)
    with pytest.raises(LayoutError):
        rebuild(bad)


def test_advert_round_trip_against_the_handshake_profile(pools: WorkerPools) -> None:
    advert, remote = decode_advert(pools.advert(), pools.profile())
    assert advert.transport == "local"
    assert [p.layout for p in remote] == pools.layouts
    assert [p.region for p in remote] == pools.regions
    assert len(remote) == 3 and remote[2].layout.head_dim == TAIL_BYTES


def test_advert_that_disagrees_with_the_profile_is_refused(pools: WorkerPools) -> None:
    other = WorkerPools(
        SyntheticModel(SPEC), LocalTransport(), num_blocks=10, block_size=8, num_slots=3
    )
    with pytest.raises(ProtocolError, match="does not match"):
        decode_advert(other.advert(), pools.profile())
    with pytest.raises(ProtocolError, match="malformed"):
        decode_advert(b"\x93junk", pools.profile())
    old = msgspec.msgpack.decode(pools.advert(), type=PoolAdvert)
    stale = msgspec.msgpack.encode(msgspec.structs.replace(old, version=99))
    with pytest.raises(ProtocolError, match="version 99"):
        decode_advert(stale, pools.profile())
    one = encode_advert("local", b"", [(pools.layouts[0], RegionId(1))])
    with pytest.raises(ProtocolError, match="lists 1 pools"):
        decode_advert(one, pools.profile())


def test_split_destination(pools: WorkerPools) -> None:
    remote = [RemotePool(lay, RegionId(i)) for i, lay in enumerate(pools.layouts)]
    assert split_destination((4, 5, 6, 2, 2), remote, 9) == [(4, 5, 6), (2,), (2,)]
    with pytest.raises(ProtocolError, match="the pools need 5"):
        split_destination((4, 5, 2, 2), remote, 9)


def test_tail_records_and_slots(pools: WorkerPools) -> None:
    slot = pools.take_slot()
    assert slot == 0
    prompt = np.arange(4096, dtype=np.int64)
    pools.write_tail(slot, 31999, prompt)
    assert pools.read_tail(slot) == TailRecord(31999, 4096, prompt_digest(prompt))
    assert prompt_digest(prompt) != prompt_digest(prompt[::-1].copy())
    assert pools.state is not None
    pools.state.layout.canonical_view(pools.state.tensor)[slot].fill_(7)
    with pytest.raises(BlockStateError, match="1 slots"):
        pools.check_idle()
    pools.free_slot(slot)
    again = pools.take_slot()
    assert again is not None and pools.read_tail(again) == TailRecord(0, 0, bytes(16))
    assert int(pools.state.layout.canonical_view(pools.state.tensor)[again].sum()) == 0
    rest = [pools.take_slot(), pools.take_slot()]
    assert pools.take_slot() is None
    assert sorted([again, *rest]) == [0, 1, 2]  # type: ignore[list-item]
    for s in (again, *rest):
        pools.free_slot(s)  # type: ignore[arg-type]
    pools.check_idle()


def test_profile_carries_every_pool(pools: WorkerPools) -> None:
    prof = pools.profile()
    assert [lay.kind for lay in prof.layouts] == ["gqa", "state", "state"]
    assert (prof.layouts[0].head_start, prof.layouts[0].head_end) == (1, 3)
    assert prof.model_id == SPEC.model_id
    assert isinstance(describe(pools.layouts[0]), LayoutDesc)
    assert pools.kv.tensor.dtype == torch.bfloat16


def test_a_tp_ranks_state_split_is_advertised_and_rebuilt_exactly() -> None:
    """A TP rank's state pool holds its part of each row: the advert carries the split, so the
    peer rebuilds the same layout (and physical fingerprint) instead of refusing it (#33)."""
    geometry = MambaGeometry(num_heads=8, head_dim=16, num_groups=1, state_size=16, conv_kernel=4)
    split = StateSplit(geometry, tp_size=2, tp_rank=1)
    state = KVLayout.state(num_slots=3, layer_ids=(0, 2), state_dim=geometry.row_dim, split=split)
    kv = KVLayout.gqa(num_blocks=4, block_size=4, num_layers=2, kv_heads=2, head_dim=8)
    assert describe(state).state_split == (8, 16, 1, 16, 4, 2, 1)
    back = rebuild(describe(state))
    assert back == state and back.state_split == split
    assert back.fingerprint() == state.fingerprint() != KVLayout.state(
        num_slots=3, layer_ids=(0, 2), state_dim=geometry.row_dim
    ).fingerprint()  # fmt: skip
    profile = PeerProfile(
        protocol_version=PROTOCOL_VERSION, model_id="m",
        layouts=tuple(LayoutInfo.from_description(lay.describe(), fingerprint=lay.fingerprint())
                      for lay in (kv, state)),
    )  # fmt: skip
    blob = encode_advert("local", b"", [(kv, RegionId(1)), (state, RegionId(2))])
    _, remote = decode_advert(blob, profile)
    assert [p.layout for p in remote] == [kv, state]
    assert describe(kv).state_split == () and rebuild(describe(kv)).state_split is None
    bad = msgspec.structs.replace(describe(state), state_split=(8, 16, 1, 16, 4, 3, 0))
    with pytest.raises(LayoutError, match="TP 3 does not divide the state's 8 heads"):
        rebuild(bad)
    short = msgspec.structs.replace(describe(state), state_split=(8, 16))
    with pytest.raises(LayoutError, match=r"advertised state_split \(8, 16\) is not"):
        rebuild(short)
