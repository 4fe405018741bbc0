"""Shared set-up of the models tests: helpers live in ``models_testlib.py`` beside this file,
and torch runs single-threaded here (tiny matmuls only lose to thread hand-offs, and the test
machine's two cores are shared)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# importlib mode puts no test directory on sys.path; this one is, for the models tests only.
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
