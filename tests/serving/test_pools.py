"""A worker's pools tell PD peers and the router which rank of a TP × PP layout they hold."""

from __future__ import annotations

from kvplane.pd.handshake import Placement
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.producers.model import ModelSpec
from kvplane.serving.producers.rank import RankProducer
from kvplane.serving.producers.synthetic import SyntheticProducer
from kvplane.testing.cluster import MLA, base_config


def test_a_rank_workers_profile_and_info_carry_its_placement() -> None:
    at = Placement(tp_rank=1, tp_size=2, pp_stage=1, pp_size=2)
    worker = PrefillWorker(
        base_config(), RankProducer.for_rank(ModelSpec("tiny-llama", seed=3), at)
    )
    try:
        profile = worker.pools.profile()
        assert profile.placement == at
        assert [(lay.head_start, lay.head_end) for lay in profile.layouts] == [(1, 2), (0, 1)]
        assert profile.layouts[0].layer_ids == (1,)
        info = worker.info()
        assert (info.pp_stage, info.tp_rank, info.layer_ids) == (1, 1, (1,))
        assert info.head_ranges == ((1, 2), (0, 1))
    finally:
        worker.close()


def test_a_one_process_workers_placement_is_the_default() -> None:
    worker = PrefillWorker(base_config(), SyntheticProducer(MLA))
    try:
        assert worker.pools.profile().placement == Placement()
        assert (worker.info().pp_stage, worker.info().tp_rank) == (0, 0)
    finally:
        worker.close()
