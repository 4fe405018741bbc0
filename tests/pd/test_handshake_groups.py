"""The handshake pairs pools by what they hold: a worker serving one paged pool per KV cache
group (layers (0, 2) windowed, (1,) full) and one serving one pool of every layer, or a
pipeline stage's one pool of some layers of each group, are compatible both ways; a layer one
side lacks or a whole-only pool too few is one line (#33)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvplane.layout import KVLayout
from kvplane.models.kv_groups import KVGroups
from kvplane.pd.handshake import (
    PROTOCOL_VERSION,
    LayoutInfo,
    PeerProfile,
    Placement,
    Verdict,
    check_compatible,
    compat_fingerprint,
    pool_pairs,
)

MODEL = KVLayout.gqa(
    num_blocks=8, block_size=16, num_layers=3, kv_heads=2, head_dim=16, dtype=torch.float32,
    layer_windows=(8, None, 8),
)  # fmt: skip
GROUPS = KVGroups.of_layout(MODEL).layouts(MODEL)
TAIL = KVLayout.state(num_slots=4, num_layers=1, state_dim=32, dtype=torch.uint8)


def info(layout: KVLayout) -> LayoutInfo:
    return LayoutInfo.from_description(
        layout.describe(), compat_fingerprint=layout.compat_fingerprint(),
        fingerprint=layout.fingerprint(), geometry_fingerprint=layout.geometry_fingerprint(),
    )  # fmt: skip


def peer(*layouts: KVLayout, pp: tuple[int, int] = (0, 1)) -> PeerProfile:
    at = Placement(pp_stage=pp[0], pp_size=pp[1])
    return PeerProfile(protocol_version=PROTOCOL_VERSION, model_id="m",
                       layouts=tuple(info(lay) for lay in layouts), placement=at)  # fmt: skip


def stage(layers: tuple[int, ...], index: int) -> PeerProfile:
    """Pipeline stage ``index`` of 2: one pool of ``layers`` (a rank keeps one), the tail."""
    return peer(dataclasses.replace(MODEL, layer_ids=layers), TAIL, pp=(index, 2))


GROUPED = peer(*GROUPS, TAIL)
ONE_POOL = peer(MODEL, TAIL)


def both_ways(sender: PeerProfile, receiver: PeerProfile) -> Verdict:
    """The sender's verdict of the receiver; the receiver's of the sender must be the same."""
    ours = check_compatible(sender, receiver, compat_fingerprint(receiver), sends=True)
    theirs = check_compatible(receiver, sender, compat_fingerprint(sender), sends=False)
    assert ours == theirs
    return ours


def test_pools_pair_by_the_layers_they_hold() -> None:
    assert pool_pairs(ONE_POOL, GROUPED) == ((0, 0), (0, 1), (1, 2))
    assert pool_pairs(GROUPED, ONE_POOL) == ((0, 0), (1, 0), (2, 1))
    assert pool_pairs(GROUPED, GROUPED) == ((0, 0), (1, 1), (2, 2))
    assert pool_pairs(stage((0, 1), 0), GROUPED) == ((0, 0), (0, 1), (1, 2))
    assert pool_pairs(stage((2,), 1), GROUPED) == ((0, 0), (1, 2))


@pytest.mark.parametrize(
    ("sender", "receiver", "verdict"),
    [
        (ONE_POOL, GROUPED, Verdict(compatible=True)),
        (GROUPED, ONE_POOL, Verdict(compatible=True)),
        (GROUPED, GROUPED, Verdict(compatible=True)),
        (stage((0, 1), 0), GROUPED, Verdict(compatible=True, member=True)),
        (stage((2,), 1), GROUPED, Verdict(compatible=True, member=True)),
    ],
)
def test_any_sender_layout_covering_the_layers_feeds_a_grouped_receiver(
    sender: PeerProfile, receiver: PeerProfile, verdict: Verdict
) -> None:
    assert both_ways(sender, receiver) == verdict


def test_a_layer_the_groups_lack_or_a_pool_too_few_is_one_line() -> None:
    four = KVLayout.gqa(num_blocks=8, block_size=16, num_layers=4, kv_heads=2, head_dim=16,
                        dtype=torch.float32, layer_windows=(8, None, 8, 8))  # fmt: skip
    got = check_compatible(peer(four, TAIL), GROUPED, compat_fingerprint(GROUPED), sends=True)
    ours, theirs = four.geometry_fingerprint().hex(), MODEL.geometry_fingerprint().hex()
    assert got.reasons == (  # its window map differs too: each pair it shares layers with says so
        f"pool 0 layout geometry fingerprint: ours {ours}, theirs {theirs}",
        f"pool 0 (theirs 1) layout geometry fingerprint: ours {ours}, theirs {theirs}",
        "paged pools layer_ids: ours (0, 1, 2, 3), theirs (0, 1, 2)",
    )
    got = check_compatible(peer(*GROUPS), ONE_POOL, compat_fingerprint(ONE_POOL), sends=True)
    assert got.reasons == ("whole-only pools: ours 0, theirs 1",)
    receiver = stage((0, 1), 0)  # a receiver split into stages: not a layout the rule admits
    got = check_compatible(GROUPED, receiver, compat_fingerprint(receiver), sends=True)
    assert got.reasons == ("paged pools layer_ids: ours (0, 1, 2), theirs (0, 1)",)
