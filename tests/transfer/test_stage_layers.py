"""Which pipeline stage holds a layer of a pool (KV or a hybrid's state), and which senders
move a whole-only pool: the rules a hybrid's stages share (#33)."""

from __future__ import annotations

import pytest
import torch

from kvplane.errors import PlanError
from kvplane.layout import KVLayout
from kvplane.transfer.resharding import moves_whole_only, stage_layers


def test_a_pools_layers_go_to_the_stage_whose_range_holds_them() -> None:
    # 5 layers in 2 stages: [0, 3) and [3, 5); attention at 1 and 4, Mamba everywhere else
    assert stage_layers((1, 4), 5, 2) == ((1,), (4,))
    assert stage_layers((0, 2, 3), 5, 2) == ((0, 2), (3,))
    assert stage_layers((1,), 4, 2) == ((1,), ())  # a stage may hold none of a pool's layers
    assert stage_layers(range(4), 4, 1) == ((0, 1, 2, 3),)
    with pytest.raises(PlanError, match="pp_size must be an int in"):
        stage_layers((0,), 2, 3)


def _state(layers: tuple[int, ...]) -> KVLayout:
    return KVLayout.state(num_slots=2, layer_ids=layers, state_dim=8, dtype=torch.float32)


def test_the_lead_moves_every_whole_only_pool_the_others_their_stage_share() -> None:
    full, stage = _state((0, 2)), _state((0,))
    tail = KVLayout.state(num_slots=2, num_layers=1, state_dim=32, dtype=torch.uint8)
    assert moves_whole_only(stage, full, lead=False)
    assert moves_whole_only(stage, full, lead=True)
    assert not moves_whole_only(tail, tail, lead=False)
    assert moves_whole_only(tail, tail, lead=True)
    assert not moves_whole_only(full, full, lead=False)  # a whole state pool: the lead's
