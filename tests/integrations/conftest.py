"""Shared setup for the integration tests.

Helpers live in ``vllm_testlib.py`` beside this file (importlib mode puts no test directory on
``sys.path``; this one is, for these tests only).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
