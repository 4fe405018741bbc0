"""The vllm-offload bench's engine processes: start offload-harness engines, give them turns,
collect their results.

Each engine is one process of the vLLM environment (``python -m
kvplane.integrations.vllm.offload_harness``) under ``taskset -c`` on the cores given, logging
to a file. Two engines can take turns (the harness's :class:`Turns` files): one round each,
the first alternating, so both see the same load drift. Owns no figure and no workload.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from kvplane.errors import IntegrationError, UnsupportedError
from kvplane.integrations.vllm.env import pinned, vllm_python, vllm_support

HARNESS = "kvplane.integrations.vllm.offload_harness"
ENGINE_TIMEOUT_S = 600.0
"""Seconds an engine may take for its whole spec, and any one wait for it."""


class Engine:
    """One running harness process: ``name``, its spec and result files under ``root``; with
    ``turns`` it waits for :meth:`go` before each round and each phase after the first."""

    def __init__(
        self, name: str, spec: dict[str, Any], cpus: Sequence[int], root: Path, turns: bool = True
    ) -> None:
        python = vllm_python()
        if python is None:
            raise UnsupportedError(vllm_support() or "no vLLM environment")
        self.name, self.root = name, root
        self.out, self.log_path = root / f"{name}.out.json", root / f"{name}.log"
        spec_path = root / f"{name}.spec.json"
        gates = {"dir": str(root), "name": name} if turns else {}
        spec_path.write_text(json.dumps(spec | {"turns": gates}))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
        cmd = [*pinned(cpus), str(python), "-m", HARNESS, str(spec_path), str(self.out)]
        self._log: IO[str] = self.log_path.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def go(self, label: str) -> None:
        """Let the engine run its step ``label``."""
        (self.root / f"{self.name}.{label}.go").write_text("")

    def wait_done(self, label: str) -> None:
        """Return once step ``label`` is done; :class:`IntegrationError` (with the log's tail)
        when the process exits first or :data:`ENGINE_TIMEOUT_S` passes."""
        done = self.root / f"{self.name}.{label}.done"
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while not done.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise IntegrationError(f"engine {self.name} gave no {label}:\n{self.tail()}")
            time.sleep(0.002)

    def result(self) -> dict[str, Any]:
        """Wait for the process to exit; its result. :class:`IntegrationError` when it failed
        or ran past :data:`ENGINE_TIMEOUT_S`."""
        try:
            code = self.proc.wait(timeout=ENGINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        self.stop()
        if code != 0 or not self.out.exists():
            raise IntegrationError(f"engine {self.name} exited with {code}:\n{self.tail()}")
        found: dict[str, Any] = json.loads(self.out.read_text())
        return found

    def stop(self) -> None:
        """Kill the process if it still runs, reap it, close its log; idempotent."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()

    def tail(self) -> str:
        """The last 4,000 characters of the engine's output, vLLM's warnings left out."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        text = "\n".join(ln for ln in lines if " WARNING " not in ln)
        return text[-4000:]


def run_alone(name: str, spec: dict[str, Any], cpus: Sequence[int], root: Path) -> dict[str, Any]:
    """Run one engine's whole spec (no turns to wait for); its result."""
    return Engine(name, spec, cpus, root, turns=False).result()


def run_turns(
    first: tuple[str, dict[str, Any]], then: tuple[str, dict[str, Any]], rounds: int,
    cpus: Sequence[int], root: Path,
) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """Start both engines together; they take turns for ``rounds`` rounds (``round<i>``: one
    engine's round, then the other's; ``first`` goes first in even rounds). Then ``first``
    exits before ``then`` runs its later phases (``phase1``, ...) alone. Both results."""
    engines = [Engine(name, spec, cpus, root) for name, spec in (first, then)]
    try:
        for i in range(rounds):
            for engine in engines if i % 2 == 0 else engines[::-1]:
                engine.go(f"round{i}")
                engine.wait_done(f"round{i}")
        a = engines[0].result()
        for k in range(1, len(then[1]["phases"])):
            engines[1].go(f"phase{k}")
        return a, engines[1].result()
    finally:
        for engine in engines:
            engine.stop()
