"""Set-up of the codec tests: helpers live in ``codecs_testlib.py`` beside this file."""

from __future__ import annotations

import sys
from pathlib import Path

# importlib mode puts no test directory on sys.path; this one is, for the codec tests only.
sys.path.insert(0, str(Path(__file__).resolve().parent))
