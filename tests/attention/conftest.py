"""Shared fixtures for the attention tests: tiny seeded paged batches and an oracle runner."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from kvplane.attention import (
    AttentionResult,
    GQAShape,
    MLAShape,
    QueryLayout,
    default_registry,
)
from kvplane.attention.base import BackendRegistry
from kvplane.attention.synthetic import Inputs, make_gqa_inputs, make_mla_inputs, synthetic_metadata

R, P = 64, 16  # small latent / rope dims for most tests
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}


@pytest.fixture
def registry() -> BackendRegistry:
    return default_registry()


MLAFactory = Callable[..., Inputs]


@pytest.fixture
def mla_inputs() -> MLAFactory:
    """``mla_inputs(q_lens, kv_lens, heads=4, ...)`` -> synthetic MLA inputs, pages shuffled
    (``window``: a sliding-window problem)."""

    def make(
        q_lens: Sequence[int],
        kv_lens: Sequence[int],
        *,
        heads: int = 4,
        page_size: int = 4,
        dtype: torch.dtype = torch.float32,
        causal: bool = True,
        layout: QueryLayout = QueryLayout.PACKED,
        rank: int = R,
        rope: int = P,
        nope: int | None = None,
        v_dim: int | None = None,
        seed: int = 0,
        window: int | None = None,
    ) -> Inputs:
        meta, pages = synthetic_metadata(q_lens, kv_lens, page_size, shuffle_seed=seed + 1)
        shape = MLAShape(heads, rank, rope, nope, v_dim)
        return make_mla_inputs(
            meta, pages, shape, dtype=dtype, sm_scale=(rank + rope) ** -0.5, causal=causal,
            layout=layout, seed=seed, window=window,
        )  # fmt: skip

    return make


@pytest.fixture
def gqa_inputs() -> MLAFactory:
    def make(
        q_lens: Sequence[int],
        kv_lens: Sequence[int],
        *,
        heads: int = 4,
        kv_heads: int = 2,
        head_dim: int = 16,
        page_size: int = 4,
        dtype: torch.dtype = torch.float32,
        causal: bool = True,
        seed: int = 0,
        window: int | None = None,
    ) -> Inputs:
        meta, pages = synthetic_metadata(q_lens, kv_lens, page_size, shuffle_seed=seed + 1)
        return make_gqa_inputs(
            meta, pages, GQAShape(heads, kv_heads, head_dim), dtype=dtype,
            sm_scale=head_dim**-0.5, causal=causal, seed=seed, window=window,
        )  # fmt: skip

    return make


Runner = Callable[[str, Inputs], AttentionResult]


@pytest.fixture
def run_backend(registry: BackendRegistry) -> Runner:
    """``run_backend(name, inputs)``: plan and run one backend directly (no selection)."""

    def run(name: str, inputs: Inputs) -> AttentionResult:
        b = registry.get(name)
        return b.run(b.plan(inputs.problem), inputs.query, inputs.cache)

    return run


def _assert_close(got: AttentionResult, want: AttentionResult, dtype: torch.dtype) -> None:
    """Outputs within the dtype's tolerance; LSE (natural base) likewise, -inf where -inf."""
    atol, rtol = TOL[dtype]
    assert got.out.shape == want.out.shape and got.out.dtype == want.out.dtype
    torch.testing.assert_close(got.out.float(), want.out.float(), atol=atol, rtol=rtol)
    g, w = got.lse_natural(), want.lse_natural()
    assert torch.equal(torch.isneginf(g), torch.isneginf(w))
    fin = torch.isfinite(w)
    torch.testing.assert_close(g[fin], w[fin], atol=atol, rtol=rtol)
    assert not torch.isnan(got.out).any() and not torch.isnan(g).any()


@pytest.fixture
def assert_close() -> Callable[[AttentionResult, AttentionResult, torch.dtype], None]:
    """``assert_close(got, want, dtype)`` with the per-dtype tolerances of ``TOL``."""
    return _assert_close
