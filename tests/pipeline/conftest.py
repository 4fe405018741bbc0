"""Shared by the pipeline tests: a prefill and a decode worker of one real model behind a
router (threads, real tcp sockets), for the PD tests of windowed models (the tiny random
transformers Qwen2 mixing window and full layers they serve: the session fixture ``mixed_qwen2``
of ``tests/conftest.py``, from ``qwen2_testlib``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvplane.models import PagedDecoder
from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.producers.model import ModelDecoder, ModelProducer, ModelSpec
from kvplane.serving.router.router import Router
from kvplane.serving.worker_config import WorkerConfig
from kvplane.testing.cluster import FAST, TEST_SECRET, check_balanced


class ModelPair:
    """Prefill (block size 16, ``step`` tokens per step) and decode (block size 8) workers of
    ``spec`` (the decode side's: ``decode_spec`` when given); ``model`` is the same model in
    this process, for one-process references; ``decoder``: the decode side's class (a
    :class:`ModelDecoder`)."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        step: int,
        pipelined: bool = True,
        decoder: type[ModelDecoder] = ModelDecoder,
        decode_spec: ModelSpec | None = None,
    ) -> None:
        common = {"num_blocks": 48, "num_slots": 8, "timings": FAST, "slice_timeout_s": 5.0}
        self.prefill = PrefillWorker(
            WorkerConfig(name="prefill", block_size=16, step_size=step, pipelined=pipelined,
                         secret=TEST_SECRET, **common),  # type: ignore[arg-type]
            ModelProducer.from_spec(spec),
        )  # fmt: skip
        self.decode = DecodeWorker(
            WorkerConfig(name="decode", block_size=8, secret=TEST_SECRET, **common),  # type: ignore[arg-type]
            decoder.from_spec(spec if decode_spec is None else decode_spec),
        )  # fmt: skip
        self.prefill.start()
        self.decode.start()
        self.router = Router(
            [self.prefill.address], [self.decode.address], timeout_s=30.0, secret=TEST_SECRET
        )
        self.router.connect()
        self.model: PagedDecoder = spec.load()

    def moved(self) -> tuple[int, int]:
        """``(pd_bytes_moved, pd_logical_bytes)`` so far, once every worker is idle."""
        counters = check_balanced(self.router)["prefill"].counters
        return counters["pd_bytes_moved"], counters["pd_logical_bytes"]

    def close(self) -> None:
        self.router.close()
        self.prefill.close()
        self.decode.close()


@pytest.fixture
def model_pair() -> Iterator[Callable[..., ModelPair]]:
    """A factory of :class:`ModelPair` s; every pair made is closed after the test."""
    made: list[ModelPair] = []

    def make(spec: ModelSpec, **kw: object) -> ModelPair:
        made.append(ModelPair(spec, **kw))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for pair in made:
        pair.close()
