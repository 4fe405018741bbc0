"""Shared set-up of the models tests: helpers live in ``models_testlib.py`` beside this file
(torch runs single-threaded for the whole suite; see ``tests/conftest.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

# importlib mode puts no test directory on sys.path; this one is, for the models tests only.
sys.path.insert(0, str(Path(__file__).resolve().parent))
