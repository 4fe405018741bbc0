"""Set-up of the simulator tests: helpers live in ``simulate_testlib.py`` beside this file."""

from __future__ import annotations

import sys
from pathlib import Path

# importlib mode puts no test directory on sys.path; this one is, for the simulator tests only.
sys.path.insert(0, str(Path(__file__).resolve().parent))
