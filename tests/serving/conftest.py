"""Shared by the serving tests: a prefill worker with host prefix offload and a decode worker
of one real model behind a router (threads, real tcp sockets)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from kvplane.offload import OffloadConfig
from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.prefix_offload import PrefixSettings
from kvplane.serving.producers.model import ModelDecoder, ModelProducer, ModelSpec
from kvplane.serving.router.router import Router
from kvplane.serving.worker_config import WorkerConfig
from kvplane.testing.cluster import FAST, TEST_SECRET, check_balanced, wait_for


@dataclass(frozen=True)
class OffloadCluster:
    """A router over a prefill worker with prefix offload and a decode worker of ``spec``."""

    router: Router
    prefill: PrefillWorker
    spec: ModelSpec

    def shared_prefix(self, vocab: int) -> dict[str, int]:
        """Serve a 98-token prompt, then a 101-token one sharing its first 96 tokens (3 chunks
        of 32), each token-exact against the one-process model; the prefill's counters after."""
        model, off = self.spec.load(), self.prefill.offload
        assert off is not None
        shared = [int(t) for t in np.random.default_rng(5).integers(0, vocab, 96)]
        for i, tokens in enumerate([[*shared, 1, 2], [*shared, 5, 6, 7, 8, 9]]):
            res = self.router.generate(f"r{i}", tokens, max_new_tokens=6)
            assert res.state == "success", res.reason
            assert res.tokens == model.generate(tokens, 6, 16, block_size=16).tokens
            wait_for(lambda: not off.busy, what="offload idle")
        return dict(check_balanced(self.router)["prefill"].counters)


@pytest.fixture
def offload_cluster() -> Iterator[Callable[[ModelSpec], OffloadCluster]]:
    """A factory: for a spec, prefill (host prefix offload of 8 slots, chunks of 2 blocks of
    16, steps of 16) and decode (blocks of 8) workers behind a router; closed after the test."""
    made: list[tuple[Router, PrefillWorker, DecodeWorker]] = []

    def make(spec: ModelSpec) -> OffloadCluster:
        common = dict(num_blocks=48, num_slots=8, timings=FAST, slice_timeout_s=5.0,
                      secret=TEST_SECRET)  # fmt: skip
        offload = PrefixSettings(OffloadConfig(host_slots=8, pin_memory=False), 2)
        prefill = PrefillWorker(
            WorkerConfig(name="prefill", block_size=16, step_size=16, **common),  # type: ignore[arg-type]
            ModelProducer.from_spec(spec), offload=offload,
        )  # fmt: skip
        decode = DecodeWorker(
            WorkerConfig(name="decode", block_size=8, **common),  # type: ignore[arg-type]
            ModelDecoder.from_spec(spec),
        )
        prefill.start()
        decode.start()
        router = Router([prefill.address], [decode.address], timeout_s=30.0, secret=TEST_SECRET)
        made.append((router, prefill, decode))
        router.connect()
        return OffloadCluster(router, prefill, spec)

    yield make
    for router, prefill, decode in made:
        router.close()
        prefill.close()
        decode.close()
