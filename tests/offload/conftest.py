"""Set-up of the offload tests: helpers live in ``offload_testlib.py`` beside this file.

The Redis fixtures (``redis_url``, ``redis_namespace``) are suite-wide, in ``tests/conftest.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# importlib mode puts no test directory on sys.path; this one is, for the offload tests only.
sys.path.insert(0, str(Path(__file__).resolve().parent))
