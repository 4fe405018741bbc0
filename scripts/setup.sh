#!/usr/bin/env bash
# Create .venv at the repo root when missing and install kvplane (editable) with its test tools.
# Idempotent: a re-run on a ready .venv only checks a stamp and returns in about a second.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$py" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
# torch first, pinned: this machine carries a local CPU wheel; an unpinned torch pulls CUDA builds.
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" install "torch==2.13.0"
stamp=".venv/.kvplane-stamp"
want="$(cat pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # libibverbs1: the Mooncake Transfer Engine wheel links it (Debian package; root only here).
  if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq libibverbs1) >/dev/null 2>&1 \
      || echo "warning: libibverbs1 not installed; the mooncake transport will be unsupported"
  fi
  "${pip[@]}" install -e ".[test,redis,hf,plot,nixl,mooncake,codecs]"
  echo "$want" > "$stamp"
fi
