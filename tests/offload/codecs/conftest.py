"""Set-up of the codec tests: helpers live in ``codecs_testlib.py`` and ``parity_testlib.py``
beside this file; the trained tiny Llama is built once per session."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

# importlib mode puts no test directory on sys.path; this one is, for the codec tests only.
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def trained_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """``(TrainedLlama, its transformers model)``, trained once per session (seconds)."""
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    pytest.importorskip("pydoc_data.topics")
    from kvplane.testing.trained import train_tiny_llama

    return train_tiny_llama(tmp_path_factory.mktemp("trained-llama"))
