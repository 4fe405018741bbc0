"""Where the vLLM environment is, and running the engine harness in it from any Python.

vLLM lives in its own virtual environment (``.venv-vllm`` at the repository root, made by
``scripts/vllm-venv.sh``) so the main environment stays lean. Tests and the bench run the real
engine as a subprocess of that environment's interpreter via :func:`run_harness`; this module
itself never imports vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvplane.errors import ConfigError, IntegrationError, UnsupportedError

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


def nixl_support(timeout: float = 120.0) -> str | None:
    """``None`` when vLLM's ``NixlConnector`` can load NIXL in the vLLM environment, else why
    not (no environment, or the import's error)."""
    python = vllm_python()
    if python is None:
        return vllm_support()
    probe = "from nixl._api import nixl_agent, nixl_agent_config"
    try:
        proc = subprocess.run(
            [str(python), "-c", probe], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return f"importing nixl in {python} took over {timeout:.0f} s"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"nixl does not import in {python} (scripts/vllm-venv.sh installs it): {last}"
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
    result: dict[str, Any] = _harness(dict(spec), timeout)
    return result


def run_harness_engines(
    specs: Sequence[Mapping[str, Any]], timeout: float = 600.0
) -> list[dict[str, Any]]:
    """Run harness specs one engine after the other in one fresh vLLM-environment process (one
    import of vLLM for all; each engine shut down before the next starts); their results in
    order. Errors as :func:`run_harness`."""
    results: list[dict[str, Any]] = _harness([dict(s) for s in specs], timeout)
    return results


def _harness(spec: dict[str, Any] | list[dict[str, Any]], timeout: float) -> Any:
    python = _python()
    with tempfile.TemporaryDirectory(prefix="kvplane-vllm-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        _run(python, [str(spec_path), str(out_path)], timeout, "vLLM harness")
        return json.loads(out_path.read_text())


PD_HARNESS = "kvplane.integrations.vllm.pd_harness"


def pinned(cpus: Sequence[int] | None) -> list[str]:
    """The command prefix starting a process on ``cpus`` (``taskset -c``; every thread it
    starts inherits them); nothing for None. :class:`UnsupportedError` without ``taskset``,
    :class:`ConfigError` for an empty list or a core this process may not use."""
    if cpus is None:
        return []
    allowed = os.sched_getaffinity(0)
    if not cpus or any(int(c) not in allowed for c in cpus):
        raise ConfigError(f"cpus {list(cpus)} not a non-empty subset of {sorted(allowed)}")
    taskset = shutil.which("taskset")
    if taskset is None:
        raise UnsupportedError("pinning an engine to cores needs taskset (util-linux)")
    return [taskset, "-c", ",".join(str(int(c)) for c in cpus)]


def run_pd_pair(
    prefill: Mapping[str, Any],
    decode: Mapping[str, Any],
    timeout: float = 600.0,
    env: Mapping[str, str] | None = None,
    kill_decode_on: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Run a prefill and a decode engine (:mod:`.pd_harness` specs, ``role`` and
    ``rendezvous`` filled in here) as two concurrent vLLM-environment processes; their results.

    ``env`` adds variables to both (a secret, say). A spec's ``cpus`` (a list of core ids)
    starts its engine under ``taskset -c`` (see :func:`pinned`). ``kill_decode_on`` names a
    rendezvous file: once it appears the decode engine is SIGKILLed (its result is then None)
    and ``killed`` is written with the kill's ``time.monotonic()``. :class:`IntegrationError`
    with the outputs' tails when a process fails or times out.
    """
    python = _python()
    with tempfile.TemporaryDirectory(prefix="kvplane-vllm-pd-") as tmp:
        root = Path(tmp)
        (root / "meet").mkdir()
        child = dict(os.environ)
        child.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        child.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        child.update(env or {})
        procs = []
        for role, spec in (("prefill", prefill), ("decode", decode)):
            full = {**spec, "role": role, "rendezvous": str(root / "meet")}
            (root / f"{role}.json").write_text(json.dumps(full))
            log = (root / f"{role}.log").open("w")
            cmd = [
                *pinned(spec.get("cpus")),
                str(python),
                "-m",
                PD_HARNESS,
                str(root / f"{role}.json"),
                str(root / f"{role}.out"),
            ]
            procs.append(
                (role, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child))
            )
        deadline = time.monotonic() + timeout
        killed = False
        while any(p.poll() is None for _r, p in procs) and time.monotonic() < deadline:
            if kill_decode_on and not killed and (root / "meet" / kill_decode_on).exists():
                procs[1][1].kill()
                procs[1][1].wait()
                (root / "meet" / "killed").write_text(f"{time.monotonic()}\n")
                killed = True
            elif any(p.poll() not in (None, 0) for _r, p in procs) and not killed:
                break  # one failed: the other would wait for it until its own timeout
            time.sleep(0.01)
        why_killed = {}
        for role, proc in procs:
            if proc.poll() is None:
                late = time.monotonic() >= deadline
                why_killed[role] = f"no result within {timeout:.0f} s" if late else "other failed"
                proc.kill()
            proc.wait()
        failed = [
            f"{role} exited with {p.returncode}"
            + (f" (killed here: {why_killed[role]})" if role in why_killed else "")
            + f":\n{(root / f'{role}.log').read_text()[-3000:]}"
            for role, p in procs
            if p.returncode != 0 and not (killed and role == "decode")
        ]
        if failed:
            raise IntegrationError("PD pair failed: " + "\n".join(failed))
        first = json.loads((root / "prefill.out").read_text())
        second = None if killed else json.loads((root / "decode.out").read_text())
    return first, second
