"""``--png FILE``: a finished run drawn as a TTFT CDF and per-tier occupancy over time.

The series are plain functions (:func:`ttft_cdf`, :func:`tier_occupancy`, testable without
matplotlib); :func:`draw_png` needs the optional ``plot`` extra (``pip install
'kvplane[plot]'``) and says so as an ``UnsupportedError`` when it is missing.
"""

from __future__ import annotations

import heapq
import importlib.util
from collections.abc import Sequence
from pathlib import Path

from kvplane.errors import UnsupportedError
from kvplane.simulate.engine import Simulation
from kvplane.simulate.result import Outcome
from kvplane.simulate.summary import all_tiers
from kvplane.simulate.tiers import TierCache

INSTALL = "pip install 'kvplane[plot]'"


def ttft_cdf(outcomes: Sequence[Outcome]) -> tuple[list[float], list[float]]:
    """The finished requests' TTFTs ascending, and the fraction of requests at or below each."""
    ttfts = sorted(o.ttft_s for o in outcomes if o.done_s >= 0)
    n = len(ttfts)
    return ttfts, [(i + 1) / n for i in range(n)]


def tier_occupancy(instances: Sequence[TierCache]) -> list[tuple[float, int]]:
    """The resident bytes of all ``instances`` of one tier together, ``(time, bytes)`` at each
    change of any instance's count, in time order (from each instance's own samples)."""
    if not instances:
        return []
    counts = [0] * len(instances)
    total = 0
    out: list[tuple[float, int]] = []
    tagged = [[(t, i, n) for t, n in tier.occupancy] for i, tier in enumerate(instances)]
    for t, i, n in heapq.merge(*tagged):
        total += n - counts[i]
        counts[i] = n
        if out and out[-1][0] == t:
            out.pop()
        out.append((t, total * instances[0].chunk_bytes))
    return out


def tiers_by_name(sim: Simulation) -> dict[str, list[TierCache]]:
    """Every tier instance of a run, by tier name in the spec's order."""
    out: dict[str, list[TierCache]] = {t.name: [] for t in sim.spec.tiers}
    for tier in all_tiers(sim):
        out[tier.spec.name].append(tier)
    return out


def require_matplotlib() -> None:
    """``UnsupportedError`` naming the ``plot`` extra unless matplotlib is importable."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UnsupportedError(f"--png needs matplotlib, which is not installed: {INSTALL}")


def draw_png(sim: Simulation, path: str | Path, title: str = "kvplane simulate") -> None:
    """Write ``path``: the TTFT CDF (left) and each tier's resident bytes as a fraction of its
    total capacity over simulated time (right). ``UnsupportedError`` without matplotlib."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outcomes = sim.outcomes()
    end = max((o.done_s for o in outcomes), default=0.0)
    fig, (cdf, occ) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs, ys = ttft_cdf(outcomes)
    cdf.step(xs, ys, where="post")
    cdf.set_xlabel("TTFT (s)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title(f"TTFT CDF ({len(xs):,} requests)")
    cdf.grid(alpha=0.3)
    for name, instances in tiers_by_name(sim).items():
        capacity = sum(t.capacity * t.chunk_bytes for t in instances)
        series = tier_occupancy(instances)
        if not series or capacity == 0:
            continue
        times = [t for t, _ in series] + [max(end, series[-1][0])]
        fracs = [b / capacity for _, b in series] + [series[-1][1] / capacity]
        occ.step(times, fracs, where="post", label=f"{name} ({capacity / 1e9:,.0f} GB)")
    occ.set_xlabel("simulated time (s)")
    occ.set_ylabel("resident / capacity")
    occ.set_ylim(0, 1.05)
    occ.set_title("tier occupancy")
    occ.grid(alpha=0.3)
    if occ.get_legend_handles_labels()[0]:
        occ.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
