"""Random runs of a SessionPair over a faulty link: the protocol's guarantees hold in each.

Default: 300 runs of 3 concurrent sessions (about a second); KVPLANE_SLOW=1: 5,000 runs.
"""

from __future__ import annotations

from collections import Counter

import pytest

from kvplane.ids import SessionId
from kvplane.pd.states import Ownership, Role, SessionState
from kvplane.testing.faults import FrameFaults, TransferFaults
from kvplane.testing.session_pair import (
    DECODE,
    PREFILL,
    SIM_TIMINGS,
    SessionPair,
    SessionPlan,
)

FRAMES = FrameFaults(drop=0.05, duplicate=0.05, reorder=0.1, corrupt=0.02)
TRANSFERS = TransferFaults(submit_error=0.02, fail=0.03, in_doubt=0.02, late=0.02, hang=0.02)


def random_runs(
    seeds: range,
) -> tuple[Counter[SessionState], Counter[tuple[Role, Ownership]], Counter[str]]:
    states: Counter[SessionState] = Counter()
    via: Counter[tuple[Role, Ownership]] = Counter()
    link: Counter[str] = Counter()
    for seed in seeds:
        pair = SessionPair.random_run(seed, frames=FRAMES, transfers=TRANSFERS)
        assert pair.violations() == [], f"seed {seed}"
        states.update(pair.final_state(pair.decode, p.session_id) for p in pair.plans)  # type: ignore[misc]
        via.update(pair.release_via)
        link.update(pair.link.stats)
        link["malformed"] += pair.malformed
    return states, via, link


def test_300_random_runs_agree_and_release_everything_exactly_once() -> None:
    states, via, link = random_runs(range(300))
    assert set(states) == {SessionState.SUCCESS, SessionState.ABORTED, SessionState.FAILED}
    for key in [
        (Role.SENDER, Ownership.BACKEND_DONE),
        (Role.SENDER, Ownership.NOT_SUBMITTED),
        (Role.SENDER, Ownership.EXPIRED),
        (Role.RECEIVER, Ownership.BACKEND_DONE),
        (Role.RECEIVER, Ownership.EXPIRED),
    ]:
        assert via[key] > 0, key  # every release path was exercised
    for fault in ("dropped", "duplicated", "reordered", "corrupted"):
        assert link[fault] > 0
    assert link["malformed"] >= link["corrupted"] > 0  # the codec caught every corruption


@pytest.mark.slow
def test_5000_random_runs() -> None:
    states, _, _ = random_runs(range(1000, 6000))
    assert sum(states.values()) == 15000


def test_the_checker_sees_broken_guarantees() -> None:
    pair = SessionPair.random_run(3, frames=FRAMES, transfers=TRANSFERS)
    assert pair.violations() == []
    key = next(iter(pair.released))
    pair.released[key] += 1
    assert any("released 2" in v for v in pair.violations())
    pair.released[key] -= 1
    sid = pair.plans[0].session_id
    pair.finished[(PREFILL, sid)] = [SessionState.ABORTED, SessionState.FAILED]
    bad = pair.violations()
    assert any("finished 2 times" in v for v in bad) and any("disagree" in v for v in bad)


def test_peer_loss_fails_both_sides_and_releases_within_lease_plus_doubt() -> None:
    pair = SessionPair(seed=1, frames=FrameFaults(), transfers=TransferFaults(hang=0.99))
    plan = SessionPlan(
        session_id=SessionId("lost"), num_tokens=64, prefix_tokens=0, step_tokens=32,
        step_s=0.01, sender_opens_at=0.0, receiver_opens_at=0.0,
    )  # fmt: skip
    pair.add(plan)
    cut = 0.05
    pair.at(cut, lambda: pair.link.partition(PREFILL, DECODE))
    pair.run(until=30.0)
    assert pair.violations() == []
    assert pair.final_state(pair.prefill, plan.session_id) is SessionState.FAILED
    assert pair.final_state(pair.decode, plan.session_id) is SessionState.FAILED
    assert pair.prefill.counters["peer_lost"] == pair.decode.counters["peer_lost"] == 1
    last_release = max(t for t, *_ in pair.release_log)
    bound = SIM_TIMINGS.lease_s + SIM_TIMINGS.in_doubt_s
    assert cut < last_release <= cut + bound
    assert {via for *_, via in pair.release_log} >= {Ownership.EXPIRED}
