"""The prompts of ``kvplane bench pd`` (its worker pairs run in tests/apps/bench/test_pd.py)."""

from __future__ import annotations

from kvplane.apps.bench import pd_pair


def test_prompts_share_no_first_block() -> None:
    """The warm-up and every request start differently, so none hits another's prefix."""
    firsts = {tuple(pd_pair.prompt(i, 16)) for i in range(-1, 2_000)}
    assert len(firsts) == 2_001
    assert pd_pair.prompt(0, 4) == [7919, 7920, 7921, 7922]
    assert pd_pair.prompt(-1, 3) == [29_999, 0, 1]  # wraps inside the vocabulary
    assert max(max(pd_pair.prompt(i, 4_096)) for i in (-1, 0, 5)) < pd_pair.VOCAB


def test_prompts_fit_a_small_vocabulary() -> None:
    """The real model's 1,024 ids: the same rule, modulo its vocabulary."""
    assert pd_pair.prompt(0, 4, 1024) == [751, 752, 753, 754]  # 7919 = 7 x 1024 + 751
    assert pd_pair.prompt(-1, 2, 1024) == [1023, 0]
    firsts = {pd_pair.prompt(i, 1, 1024)[0] for i in range(-1, 64)}
    assert len(firsts) == 65
    assert max(max(pd_pair.prompt(i, 2048, 1024)) for i in (-1, 0, 5)) < 1024
