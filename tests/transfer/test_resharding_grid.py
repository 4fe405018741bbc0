"""The resharding property grid (issue #31): every (TP_p, PP_p, block size) → (TP_d, block size)
pairing, for MHA, GQA with 2 and 8 KV heads and MLA, moves exactly the KV a one-process producer
holds. Per-rank prefill pools are cut from one full KV; the plans of every piece run through
``PlanExecutor`` on real ``local`` transports (one per rank, one fabric); each decode pool must
then equal, byte for byte, its pre-transfer bytes with its heads of the full KV written at its
block table — nothing else changed — and the pieces must tile its destination."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvplane.ids import RegionId, TokenRange
from kvplane.layout import KVLayout
from kvplane.pd.tiling import Tiling
from kvplane.transfer.executor import PlanExecutor
from kvplane.transfer.request import PlanSide
from kvplane.transfer.resharding import Parallelism, SenderId, destination, plan_pieces, reshard
from kvplane.transports.local import LocalFabric, LocalTransport

NUM_LAYERS = 4
NUM_TOKENS = 77  # not a multiple of either block size: every plan ends mid-block
SPARE_BLOCKS = 3  # blocks outside every table: must stay untouched

MODELS = {
    # An MHA model's KV is one K and V per attention head; a TP head range needs the GQA kind
    # (KVLayout: "an MHA layout holds all heads"), as every model of kvplane describes it.
    "mha": KVLayout.gqa(num_blocks=1, block_size=16, num_layers=NUM_LAYERS, kv_heads=4,
                        head_dim=8, dtype=torch.float16),
    "gqa2": KVLayout.gqa(num_blocks=1, block_size=16, num_layers=NUM_LAYERS, kv_heads=2,
                         head_dim=8, dtype=torch.bfloat16),
    "gqa8": KVLayout.gqa(num_blocks=1, block_size=16, num_layers=NUM_LAYERS, kv_heads=8,
                         head_dim=4, dtype=torch.float16),
    "mla": KVLayout.mla(num_blocks=1, block_size=16, num_layers=NUM_LAYERS, latent_dim=12,
                        rope_dim=4, dtype=torch.bfloat16),
}  # fmt: skip
TP = (1, 2, 4)
GRID = list(itertools.product(MODELS, TP, (1, 2), (16, 32), TP, (16, 32)))


@pytest.fixture(scope="module")
def ranks() -> Iterator[dict[str, LocalTransport]]:
    """One local transport per prefill rank (``p<stage>.<tp>``) and decode rank (``d<tp>``)."""
    fabric = LocalFabric()
    names = [f"p{s}.{r}" for s in range(2) for r in range(4)] + [f"d{r}" for r in range(4)]
    made = {n: LocalTransport(fabric=fabric, agent=n, copy_threads=1) for n in names}
    yield made
    for t in made.values():
        t.close()


def _rank_pool(
    model: KVLayout, side: Parallelism, stage: int, rank: int, gen: torch.Generator
) -> tuple[KVLayout, torch.Tensor, np.ndarray]:
    """A rank's layout, its pool of random bytes and a shuffled block table for the tokens."""
    need = len(side.blocks_of(TokenRange(0, NUM_TOKENS)))
    layout = side.rank_layout(model, stage, rank, need + SPARE_BLOCKS)
    raw = torch.randint(0, 256, (layout.pool_bytes,), generator=gen, dtype=torch.uint8)
    pool = raw.view(layout.dtype).view(layout.shape)
    table = torch.randperm(layout.num_blocks, generator=gen)[:need].numpy().astype(np.int64)
    return layout, pool, table


def _cells(layout: KVLayout, table: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Block and in-block position of every token: indexing a canonical byte view with them
    gives ``[tokens, layers, comps, heads, dim bytes]``."""
    pos = torch.arange(NUM_TOKENS)
    blocks = torch.as_tensor(table)[pos // layout.block_size]
    return blocks, pos % layout.block_size


@pytest.mark.parametrize("case", range(len(GRID)), ids=lambda i: "-".join(map(str, GRID[i])))
def test_every_decode_rank_holds_the_one_process_kv(
    ranks: dict[str, LocalTransport], case: int
) -> None:
    model_name, tp_p, pp_p, bs_p, tp_d, bs_d = GRID[case]
    model = MODELS[model_name]
    gen = torch.Generator().manual_seed(case)
    prefill = Parallelism.pipeline(tp_size=tp_p, num_layers=NUM_LAYERS, pp_size=pp_p,
                                   block_size=bs_p)  # fmt: skip
    decode = Parallelism.pipeline(tp_size=tp_d, num_layers=NUM_LAYERS, block_size=bs_d)
    row = model.head_dim * model.element_size
    shape = (NUM_LAYERS, model.num_components, NUM_TOKENS, model.total_heads, row)
    full = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    registered: list[tuple[LocalTransport, RegionId]] = []
    sources: dict[SenderId, PlanSide] = {}
    lengths: dict[SenderId, int] = {}
    try:
        for stage, layers in enumerate(prefill.stages):
            for r in range(tp_p):
                layout, pool, table = _rank_pool(model, prefill, stage, r, gen)
                lo, hi = layout.head_range
                blocks, offs = _cells(layout, table)
                canon = layout.canonical_view(pool).view(torch.uint8)
                canon[blocks, :, :, offs] = full[list(layers), :, :, lo:hi].permute(2, 0, 1, 3, 4)
                t = ranks[f"p{stage}.{r}"]
                rid = t.register(pool).region_id
                registered.append((t, rid))
                sources[SenderId(stage, r)] = PlanSide(layout, table, rid)
                lengths[SenderId(stage, r)] = layout.pool_bytes
        tokens = TokenRange(0, NUM_TOKENS)
        for d, pieces in enumerate(reshard(model, prefill, decode, tokens)):
            layout, pool, table = _rank_pool(model, decode, 0, d, gen)
            expected = pool.clone()
            lo, hi = layout.head_range
            blocks, offs = _cells(layout, table)
            want = full[:, :, :, lo:hi].permute(2, 0, 1, 3, 4)
            layout.canonical_view(expected).view(torch.uint8)[blocks, :, :, offs] = want
            target = ranks[f"d{d}"]
            rid = target.register(pool).region_id
            registered.append((target, rid))
            tiling = Tiling(destination(model, decode, d, tokens))
            planned = plan_pieces(pieces, sources, PlanSide(layout, table, rid))
            for pp in planned:
                sender = ranks[f"p{pp.sender.stage}.{pp.sender.tp_rank}"]
                peer = sender.connect(target.metadata())
                result = PlanExecutor(sender).execute(
                    pp.plan, peer, local_regions={sources[pp.sender].region: lengths[pp.sender]}
                )
                assert result.ok, result
                tiling.add(pp.piece)
            tiling.check_complete()
            moved = sum(pp.plan.num_bytes for pp in planned)
            assert moved == (hi - lo) * NUM_LAYERS * NUM_TOKENS * model.num_components * row
            assert torch.equal(pool.view(torch.uint8), expected.view(torch.uint8))
    finally:
        for t, rid in registered:
            t.deregister(rid)
    assert all(t.pinned_regions() == 0 and t.live_batches() == 0 for t in ranks.values())
