"""In-process PD clusters and worker processes for tests and benches, and their integrity checks.

An in-process :class:`Cluster` runs the real worker classes on threads (fast); :class:`Proc`
runs ``python -m kvplane serve ...`` as a subprocess and reads its announce line. Both end with
:func:`check_balanced`: pools hold nothing, every pool and ledger passes its integrity check.
Both are authenticated with :data:`TEST_SECRET` unless a test asks for insecure mode.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import numpy as np

from kvplane.config import SECRET_ENV
from kvplane.pd.timers import Timings
from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.messages import RequestResult, WorkerStats
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.producers.synthetic import SyntheticDecoder, SyntheticProducer, SyntheticSpec
from kvplane.serving.router.router import Router
from kvplane.serving.worker_config import WorkerConfig

FAST = Timings(
    deadline_s=8.0,
    verdict_grace_s=2.0,
    retransmit_s=0.05,
    drain_s=0.5,
    in_doubt_s=0.2,
    heartbeat_s=0.1,
    lease_s=0.6,
)
"""Short protocol timings for tests (lease + heartbeat well under a second)."""

TEST_SECRET = secrets.token_hex(32).encode()
"""The shared secret of every cluster this test process starts (in-process workers and
:class:`Proc` children alike): generated at import, never written down."""

MLA = SyntheticSpec(kind="mla", num_layers=2, latent_dim=32, rope_dim=16)
GQA = SyntheticSpec(kind="gqa", num_layers=2, kv_heads=4, head_dim=16, dtype="float16")


@dataclass
class Cluster:
    """One prefill and one decode worker (threads, real sockets) plus a router."""

    prefill: PrefillWorker
    decode: DecodeWorker
    router: Router
    extra: list[object] = field(default_factory=list)

    def close(self) -> None:
        self.router.close()
        self.prefill.close()
        self.decode.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def base_config(**overrides: object) -> WorkerConfig:
    """The tests' worker config (a prefill worker named "prefill": 64 blocks of 16 tokens,
    16 slots, steps of 32, :data:`FAST` timings, 5 s slices, tcp, :data:`TEST_SECRET`) with
    ``overrides`` (``secret=None, insecure=True``: unauthenticated)."""
    fields: dict[str, object] = {
        "name": "prefill", "num_blocks": 64, "block_size": 16, "num_slots": 16,
        "step_size": 32, "timings": FAST, "slice_timeout_s": 5.0, "secret": TEST_SECRET,
    }  # fmt: skip
    fields.update(overrides)
    return WorkerConfig(**fields)  # type: ignore[arg-type]


INSECURE: dict[str, object] = {"secret": None, "insecure": True}
"""``base_config``/``cluster`` overrides of a test about insecure mode (or a transport that
cannot authenticate: nixl, mooncake)."""


def cluster(
    spec: SyntheticSpec = MLA,
    *,
    decode_spec: SyntheticSpec | None = None,
    transport: str = "tcp",
    prefill: dict[str, object] | None = None,
    decode: dict[str, object] | None = None,
    timings: Timings = FAST,
    insecure: bool = False,
) -> Cluster:
    """A started :class:`Cluster`; ``insecure`` runs it without a secret (:data:`INSECURE`)."""
    base = base_config(transport=transport, timings=timings, **(INSECURE if insecure else {}))
    pcfg = replace(base, **(prefill or {}))  # type: ignore[arg-type]
    dcfg = replace(base, name="decode", **(decode or {}))  # type: ignore[arg-type]
    p = PrefillWorker(pcfg, SyntheticProducer(spec))
    d = DecodeWorker(dcfg, SyntheticDecoder(decode_spec or spec))
    p.start()
    d.start()
    r = Router([p.address], [d.address], timeout_s=20.0, secret=pcfg.secret)
    r.connect()
    return Cluster(p, d, r)


def start_slow(
    c: Cluster, request_id: str = "orig", *, on: Sequence[str] = ("prefill", "decode")
) -> Future[RequestResult]:
    """Submit a 200-token request in steps of 32 (slow when the cluster's producer computes
    slowly, e.g. ``compute_s_per_step=0.05``) and wait until every worker role in ``on`` holds
    it; its future."""
    fut = c.router.submit(request_id, prompt(np.random.default_rng(0), 200), step_size=32)
    workers: dict[str, PrefillWorker | DecodeWorker] = {"prefill": c.prefill, "decode": c.decode}
    wait_for(
        lambda: all(request_id in workers[role]._requests for role in on),
        what=f"{request_id} on {', '.join(on)}",
    )
    return fut


def prompt(rng: np.random.Generator, n: int, vocab: int = 30000) -> list[int]:
    return [int(x) for x in rng.integers(0, vocab, size=n)]


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def idle(stats: WorkerStats) -> bool:
    return (stats.used_blocks, stats.used_slots, stats.sessions_live, stats.requests_live) == (
        0,
        0,
        0,
        0,
    )


def check_balanced(router: Router, timeout_s: float = 10.0) -> dict[str, WorkerStats]:
    """Wait until every worker holds nothing, then assert integrity everywhere."""
    end = time.monotonic() + timeout_s
    while True:
        stats = router.stats()
        if all(idle(s) for s in stats.values()) or time.monotonic() > end:
            break
        time.sleep(0.02)
    for name, s in stats.items():
        assert s.integrity == "", f"{name}: {s.integrity}"
        assert idle(s), f"{name} still holds memory or sessions: {s}"
    return stats


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(secret: bytes | None = TEST_SECRET) -> dict[str, str]:
    """This process's environment for a ``kvplane serve`` child: unbuffered, one thread, and
    ``KVPLANE_SECRET`` set to ``secret`` (removed when ``None``)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop(SECRET_ENV, None)
    if secret is not None:
        env[SECRET_ENV] = secret.decode()
    return env


class Proc:
    """``python -m ENTRY ROLE ...`` as a subprocess; ``info`` is its announce line.

    ``entry`` is ``kvplane serve`` by default; chaos runs use ``kvplane.testing.chaos_serve``.
    The child gets ``secret`` in ``KVPLANE_SECRET`` (``None``: no secret; the test then says
    ``--insecure`` in ``args``) and ``env`` on top of this process's environment.
    """

    def __init__(
        self,
        role: str,
        args: Sequence[str],
        timeout_s: float = 30.0,
        entry: Sequence[str] = ("kvplane", "serve"),
        *,
        secret: bytes | None = TEST_SECRET,
        env: dict[str, str] | None = None,
    ) -> None:
        env = {**child_env(secret), **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *entry, role, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"serve {role} died at start: {err[-2000:]}")
        self.info: dict[str, object] = json.loads(line)

    @property
    def control(self) -> str:
        return str(self.info["control"])

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)
