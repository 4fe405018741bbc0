"""The processes ``kvplane bench windows`` measures: a prefill and a decode ``kvplane serve``
worker of one mixed-window checkpoint, KV cache groups on or off, the prefill with prefix offload
to a host tier, each worker's ``/metrics`` on a port of its own (:class:`WindowPair`), and what
the bench reads of them: per-request PD bytes from the prefill's timeline, the offload counters
from its stats, and each paged pool's allocated blocks from ``/metrics``.

Owns the processes it starts (stopped on :meth:`WindowPair.close`); derives nothing from what
it reads (:mod:`.windows` does). Its flags follow :class:`~.pd_pair.Pair`'s, which takes one
flag list for both roles and so cannot give each its own metrics port.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvplane.apps.bench.pd_pair import START_TIMEOUT_S, connect_router
from kvplane.apps.bench.windows_model import BLOCK_SIZE, BLOCKS_PER_CHUNK, DTYPE
from kvplane.apps.demo_procs import SCRAPE_TIMEOUT_S, Child, ProcessGroup, free_port, new_secret
from kvplane.errors import KVPlaneError, TransferTimeoutError
from kvplane.serving.router.router import Router
from kvplane.serving.worker_config import SECRET_TRANSPORTS

ROLES = ("prefill", "decode")
ALLOCATED = "kvplane_block_pool_allocated_blocks"
PEAK_USED = "kvplane_block_pool_peak_used_blocks"
"""The pools' allocation counter family (``BlockPool``: blocks handed out, by ``pool``)."""
STORE_COUNTERS = ("offload_chunks_stored", "offload_group1_chunks_stored")
"""The prefill's stats counters of chunks stored: group 0's (or the one pool's), group 1's."""
IDLE_TIMEOUT_S = 60.0
IDLE_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class WindowPairSpec:
    """One pair's settings: the checkpoint, ``--kv-groups``, the transport, the prefill step
    (tokens), blocks per pool and the prefill's host-tier chunk slots."""

    checkpoint: Path
    groups: bool
    transport: str
    step: int
    num_blocks: int
    host_slots: int


@dataclass(frozen=True, slots=True)
class Served:
    """One request: its TTFT (submit to first token ready on the decode side, ms) and tokens."""

    ttft_ms: float
    tokens: tuple[int, ...]


class WindowPair:
    """A prefill and a decode worker process and a router (module docstring). Both processes
    start at once; the pair is usable after :meth:`connect`, so several pairs start together."""

    def __init__(self, work: Path, spec: WindowPairSpec) -> None:
        work.mkdir(parents=True, exist_ok=True)
        secure = spec.transport in SECRET_TRANSPORTS
        self.group = ProcessGroup(work, new_secret() if secure else None)
        self.ports = {role: free_port() for role in ROLES}
        self.router: Router | None = None
        common = [
            "--transport", spec.transport, "--block-size", str(BLOCK_SIZE),
            "--num-blocks", str(spec.num_blocks), "--num-slots", "4",
            "--step-size", str(spec.step), "--pipelining", "on",
            "--model", str(spec.checkpoint), "--model-dtype", DTYPE,
            "--kv-groups", "on" if spec.groups else "off",
            "--blocks-per-chunk", str(BLOCKS_PER_CHUNK),
            "--slice-timeout", "60", "--deadline", "120", "--heartbeat", "1", "--lease", "10",
            *([] if secure else ["--insecure"]),
        ]  # fmt: skip
        offload = ["--offload-host-slots", str(spec.host_slots)]
        try:
            for role in ROLES:
                flags = ["--name", role, "--metrics-port", str(self.ports[role]), *common]
                flags += offload if role == "prefill" else []
                self.group.children[role] = Child(role, flags, work, self.group.secret)
        except BaseException:
            self.group.stop()
            raise

    def connect(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait for both announce lines (at most ``timeout_s``), then connect the router; the
        group is stopped when that fails."""
        self.router = connect_router(self.group, timeout_s)

    def _routed(self) -> Router:
        if self.router is None:
            raise KVPlaneError("bench windows pair used before connect()")
        return self.router

    def run(self, rid: str, tokens: list[int], step: int, new: int) -> Served:
        """Serve one request of ``new`` tokens; :class:`KVPlaneError` when it did not succeed."""
        self.group.check(f"serving {rid}")
        t0 = time.monotonic()
        res = self._routed().generate(rid, tokens, step_size=step, max_new_tokens=new)
        if res.state != "success" or res.mismatches not in (None, 0):
            raise KVPlaneError(f"bench request {rid} ended {res.state} ({res.reason})")
        return Served((res.ready_at - t0) * 1e3, tuple(res.tokens))

    def wait_idle(self, timeout_s: float = IDLE_TIMEOUT_S) -> dict[str, int]:
        """Wait until both workers hold no block, session or request (the prefill's prefix
        store fences blocks until it ends), then the prefill's :data:`STORE_COUNTERS` and
        ``pd_logical_bytes`` (what its plans say the decode side needs);
        :class:`TransferTimeoutError` after ``timeout_s``, :class:`KVPlaneError` for a worker
        reporting broken integrity."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self._routed().stats()
            for w in stats.values():
                if w.integrity:
                    raise KVPlaneError(f"worker {w.peer_id}: {w.integrity}")
            busy = [w for w in stats.values() if w.used_blocks or w.sessions_live or
                    w.requests_live]  # fmt: skip
            if not busy:
                c = stats["prefill"].counters
                keys = (*STORE_COUNTERS, "pd_logical_bytes")
                return {k: int(c.get(k, 0)) for k in keys}
            if time.monotonic() > deadline:
                raise TransferTimeoutError(f"bench windows: {busy[0].peer_id} stayed busy")
            time.sleep(IDLE_POLL_S)

    def slice_bytes(self, rids: Sequence[str]) -> dict[str, int]:
        """Per request of ``rids``, the bytes its slices moved (the prefill's ``slice_done``
        events); :class:`KVPlaneError` when the timeline left events out."""
        stats = self._routed().stats(timeline=True)["prefill"]
        if stats.timeline_truncated:
            raise KVPlaneError(f"prefill timeline left {stats.timeline_truncated} events out")
        out = dict.fromkeys(rids, 0)
        for ev in stats.timeline:
            rid = str(ev.get("request_id"))
            if ev.get("mark") == "slice_done" and rid in out:
                out[rid] += int(ev.get("nbytes", 0))
        return out

    def allocated(self, role: str) -> dict[int, int]:
        """Blocks each paged pool of ``role`` has handed out since it started (pool ``g`` is
        ``<role>_kv`` for 0, ``<role>_kv<g>`` after), from its ``/metrics``."""
        return self._per_pool(role, ALLOCATED, "_total")

    def peak_used(self, role: str) -> dict[int, int]:
        """The most blocks each paged pool of ``role`` held at once since it started."""
        return self._per_pool(role, PEAK_USED, "")

    def _per_pool(self, role: str, family_name: str, suffix: str) -> dict[int, int]:
        """Metric ``family_name`` (sample ``family_name + suffix``) of each paged pool of
        ``role``, by pool index, from the worker's ``/metrics``."""
        url = f"http://127.0.0.1:{self.ports[role]}/metrics"
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as reply:
            text = reply.read().decode()
        out: dict[int, int] = {}
        for family in text_string_to_metric_families(text):
            if family.name != family_name:
                continue
            for sample in family.samples:
                pool = sample.labels.get("pool", "")
                if sample.name == family_name + suffix and pool.startswith(f"{role}_kv"):
                    index = pool.removeprefix(f"{role}_kv")
                    out[int(index or 0)] = int(sample.value)
        return out

    def close(self) -> None:
        if self.router is not None:
            self.router.close()
        self.group.stop()
