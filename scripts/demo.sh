#!/usr/bin/env bash
# The main job: set up .venv and run `kvplane demo` (extra arguments go to it).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
exec .venv/bin/kvplane demo "$@"
