"""Where the vLLM environment is, and running the engine harness in it from any Python.

vLLM lives in its own virtual environment (``.venv-vllm`` at the repository root, made by
``scripts/vllm-venv.sh``) so the main environment stays lean. Tests and the bench run the real
engine as a subprocess of that environment's interpreter via :func:`run_harness`; this module
itself never imports vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvplane.errors import IntegrationError, UnsupportedError

ENV_PYTHON = "KVPLANE_VLLM_PYTHON"
"""Environment variable naming the vLLM environment's interpreter (overrides the default)."""

HARNESS = "kvplane.integrations.vllm.harness"


def repo_root() -> Path:
    """The repository root of this (editable) kvplane checkout."""
    return Path(__file__).resolve().parents[4]


def vllm_python(env: Mapping[str, str] | None = None) -> Path | None:
    """The interpreter of the vLLM environment, or ``None`` when there is none."""
    environ = os.environ if env is None else env
    given = environ.get(ENV_PYTHON)
    path = Path(given) if given else repo_root() / ".venv-vllm" / "bin" / "python"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def vllm_support(env: Mapping[str, str] | None = None) -> str | None:
    """``None`` when the vLLM environment exists, else why not and how to make it."""
    if vllm_python(env) is None:
        return (
            f"no vLLM environment: run scripts/vllm-venv.sh (creates {repo_root() / '.venv-vllm'})"
            f" or set {ENV_PYTHON} to its python"
        )
    return None


def _run(python: Path, args: list[str], timeout: float, what: str) -> None:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        proc = subprocess.run(
            [str(python), "-m", HARNESS, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise IntegrationError(f"{what}: no result within {timeout:.0f} s") from exc
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise IntegrationError(f"{what} exited with {proc.returncode}:\n{tail}")


def _python() -> Path:
    python = vllm_python()
    if python is None:
        raise UnsupportedError(vllm_support() or "no vLLM environment")
    return python


def save_tiny_llama(path: Path, shape: Mapping[str, int], timeout: float = 300.0) -> None:
    """Save a random-init Llama checkpoint into ``path`` (with the vLLM environment's
    transformers; see :func:`kvplane.integrations.vllm.harness.save_tiny_llama`)."""
    _run(_python(), ["--tiny-llama", str(path), json.dumps(dict(shape))], timeout, "saving model")


def run_harness(spec: Mapping[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    """Run one harness spec in a fresh vLLM-environment process; returns its result mapping.

    Raises :class:`UnsupportedError` without a vLLM environment and :class:`IntegrationError`
    (with the output's tail) when the run fails or times out.
    """
    python = _python()
    with tempfile.TemporaryDirectory(prefix="kvplane-vllm-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(dict(spec)))
        _run(python, [str(spec_path), str(out_path)], timeout, "vLLM harness")
        result: dict[str, Any] = json.loads(out_path.read_text())
    return result
