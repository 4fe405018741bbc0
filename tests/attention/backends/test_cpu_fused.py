"""cpu_fused specifics: the C kernel's build, its work items and shapes the tiles do not divide."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvplane import native as native_build
from kvplane.attention import MLAKVCache, mla_problem
from kvplane.attention.backends import CPUFusedBackend
from kvplane.attention.backends.cpu_fused import SOURCE, FusedPlan, splits_for
from kvplane.attention.paged import merge_splits
from kvplane.attention.synthetic import Inputs
from kvplane.errors import InvalidArgumentError, UnsupportedError
from kvplane.verdicts import Supported, Unsupported

pytestmark = pytest.mark.skipif(
    native_build.compiler() is None, reason="needs a C compiler to build the kernel"
)


def _run(backend: CPUFusedBackend, inputs: Inputs):
    return backend.run(backend.plan(inputs.problem), inputs.query, inputs.cache)


def test_work_items_cover_every_request_once(mla_inputs) -> None:
    inputs = mla_inputs([1, 1, 1], [10, 0, 7])
    plan = CPUFusedBackend(threads=4, min_split_tokens=4).plan(inputs.problem)
    st = plan.state
    assert isinstance(st, FusedPlan) and st.splits == 2  # ceil(8 / 3) = 3, capped by 10 // 4
    # span 5: request 0 -> [0,5) [5,10); request 1 (empty) -> [0,0) [0,0); request 2 -> [0,5) [5,7)
    assert st.items.tolist() == [[0, 0, 5], [0, 5, 10], [1, 0, 0], [1, 0, 0], [2, 0, 5], [2, 5, 7]]
    assert st.limits.shape == (3, 4) and st.limits.tolist()[2] == [7, 7, 7, 7]
    assert (splits_for(8, 10_000, 4, 512), splits_for(1, 10_000, 2, 512)) == (1, 4)
    assert splits_for(1, 300, 2, 512) == 1  # too short to cut


@pytest.mark.parametrize(
    ("heads", "q_lens", "kv_lens", "rank", "rope"),
    [
        (16, [1, 1], [200, 1000], 512, 64),  # DeepSeek dims, many 64-key blocks and a ragged one
        (3, [4, 2, 1], [70, 5, 129], 64, 16),  # rows not a multiple of the 4- and 6-row tiles
        (2, [1, 3], [67, 40], 20, 4),  # rank not a multiple of 16: the scalar column tail
        (5, [2, 1], [33, 90], 13, 5),  # dim 18: the scalar tail of the dot products
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_remainders_match_reference(  # noqa: PLR0917
    heads, q_lens, kv_lens, rank, rope, dtype, mla_inputs, run_backend, assert_close
) -> None:
    inputs = mla_inputs(q_lens, kv_lens, heads=heads, rank=rank, rope=rope, dtype=dtype)
    want = run_backend("reference", inputs)
    assert_close(_run(CPUFusedBackend(), inputs), want, dtype)
    assert_close(_run(CPUFusedBackend(threads=3, min_split_tokens=8), inputs), want, dtype)


def test_strided_cache_rows_are_read_in_place(mla_inputs, run_backend, assert_close) -> None:
    """A cache that is a view with padded rows (row stride > r + p) is read without a copy."""
    inputs = mla_inputs([1, 2], [9, 21])
    data = inputs.cache.data
    wide = torch.full((*data.shape[:2], data.shape[2] + 8), float("nan"))
    wide[..., : data.shape[2]] = data
    view = wide[..., : data.shape[2]]
    cache = MLAKVCache(view, inputs.cache.kv_lora_rank)
    p = inputs.problem
    problem = mla_problem(inputs.query, cache, p.metadata, sm_scale=p.sm_scale, causal=True)
    got = _run(CPUFusedBackend(), Inputs(problem, inputs.query, cache))
    assert_close(got, run_backend("reference", inputs), torch.float32)


def test_ranges_merge_by_lse() -> None:
    """What the kernel's ranges of one request merge into (``merge_splits`` of their outputs)."""
    # one request, one row, v_dim 1; range 0 saw one key (score 0, value 2), range 1 one key
    # (score log 3, value 5), range 2 nothing (the kernel writes 0 and -inf)
    out = torch.tensor([[[[2.0]], [[5.0]], [[0.0]]]])
    lse = torch.tensor([[[0.0], [float(torch.tensor(3.0).log())], [float("-inf")]]])
    o, merged = merge_splits(out, lse)
    assert torch.allclose(o, torch.tensor([[[(1.0 * 2.0 + 3.0 * 5.0) / 4.0]]]))
    assert torch.allclose(merged, torch.tensor([[float(torch.tensor(4.0).log())]]))
    o, merged = merge_splits(torch.zeros(1, 2, 1, 1), torch.full((1, 2, 1), float("-inf")))
    assert o.tolist() == [[[0.0]]] and merged.tolist() == [[float("-inf")]]


def test_arguments_are_validated() -> None:
    with pytest.raises(InvalidArgumentError, match="threads must be a positive int"):
        CPUFusedBackend(threads=0)
    with pytest.raises(InvalidArgumentError, match="min_split_tokens must be a positive int"):
        CPUFusedBackend(min_split_tokens=-1)


def test_capabilities_and_build_failures(mla_inputs, monkeypatch, tmp_path) -> None:
    inputs = mla_inputs([1], [5])
    assert isinstance(CPUFusedBackend().check(inputs.problem), Supported)
    f16 = mla_inputs([1], [5], dtype=torch.float16)
    verdict = CPUFusedBackend().check(f16.problem)
    assert isinstance(verdict, Unsupported) and "dtype torch.float16" in verdict.reasons[0]
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "no-such-compiler-kvplane")
    backend = CPUFusedBackend()
    verdict = backend.check(inputs.problem)
    assert isinstance(verdict, Unsupported) and "no C compiler found" in verdict.reasons[0]
    with pytest.raises(UnsupportedError, match="no C compiler found"):
        backend.plan(inputs.problem)
    assert not (tmp_path / "cache").exists()


def test_build_is_cached_and_a_broken_source_is_a_reason(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path))
    first = native_build.load_kernel(SOURCE)
    assert first.library is not None and first.reason is None
    built = list(tmp_path.glob("mla_decode-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert native_build.load_kernel(SOURCE).library is not None
    assert built[0].stat().st_mtime_ns == stamp and len(list(tmp_path.iterdir())) == 1
    src = tmp_path / "src"
    src.mkdir()
    (src / "broken.c").write_text("int f(void) { return }\n")
    broken = native_build.load_kernel(src / "broken.c")
    assert broken.library is None and broken.reason is not None
    assert broken.reason.startswith("building broken.c with") and "failed" in broken.reason
    assert not list(tmp_path.glob("broken*"))  # no temporary left behind


def test_named_functions_are_typed_and_a_missing_one_is_a_reason(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path))
    src = tmp_path / "src"
    src.mkdir()
    (src / "halve.c").write_text("double halve(long long x) { return x / 2.0; }\n")
    typed = native_build.load_kernel(
        src / "halve.c", {"halve": ([ctypes.c_longlong], ctypes.c_double)}
    )
    assert typed.library is not None and typed.library.halve(7) == 3.5  # restype applied
    missing = native_build.load_kernel(src / "halve.c", {"double_it": ([], None)})
    assert missing.library is None and missing.reason is not None
    assert "no function 'double_it'" in missing.reason
