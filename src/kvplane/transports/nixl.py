"""``nixl``: adapter over NVIDIA NIXL (``pip install nixl``; UCX backend, DRAM here).

Batches are posted and polled on one poster thread, so ``submit`` never waits for a copy. NIXL
is imported only here. See docs/transports.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvplane.errors import IncompatiblePeerError, TransportError
from kvplane.ids import PeerId, RegionId
from kvplane.metrics import MetricsRegistry
from kvplane.transports import pointers
from kvplane.transports.base import (
    DescriptorList,
    FailureKind,
    Int64Array,
    Peer,
    XferKind,
    XferState,
)
from kvplane.transports.batches import Batch, Job
from kvplane.transports.copier import coalesce
from kvplane.transports.core import TransportCore
from kvplane.transports.regions import RegionEntry
from kvplane.transports.registry import engine_missing, import_engine
from kvplane.transports.wire import WIRE_VERSION, Metadata, decode_metadata, encode
from kvplane.transports.workers import JobThread

log = logging.getLogger(__name__)

INSTALL_HINT = "NIXL is not installed: pip install torch==2.13.0 && pip install nixl"
_TAG = b"K"
"""Prefix of kvplane notifications (an empty notify is still a non-empty NIXL message)."""
POLL_MIN_S = 50e-6
POLL_MAX_S = 1e-3
"""The poster's polling interval while requests run: doubles from the first to the second
while no request changes state."""


def _logs_to_stderr() -> None:
    """NIXL configures its logger to print on stdout; move it to stderr so that a program's
    stdout (``--json`` output, pipes) stays clean."""
    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def probe() -> str | None:
    """None if NIXL can be imported here, else why not and how to install it."""
    why = engine_missing("nixl._api", INSTALL_HINT)  # ImportError, or a broken native library
    if why is None:
        _logs_to_stderr()
    return why


def _failure(exc: BaseException) -> FailureKind:
    name = type(exc).__name__
    return (
        FailureKind.REMOTE_DISCONNECT if "RemoteDisconnect" in name else FailureKind.BACKEND_ERROR
    )


def addresses(bases: dict[RegionId, int], descs: DescriptorList) -> np.ndarray[Any, Any]:
    """``(N, 3)`` uint64 rows ``(base[region] + offset, length, device 0)``, vectorised. A
    region missing from ``bases`` is a ``TransportError``, never a neighbour's base."""
    addr = pointers.addresses(bases, descs, "NIXL")
    rows = np.stack([addr, descs.lengths, np.zeros_like(addr)], axis=1)
    return rows.astype(np.uint64)


PROGRESS_DELAY_US = 100
"""How long NIXL's progress thread waits for events between rounds. NIXL's Python wrapper sets 0,
and its progress thread then spins: a full core per agent, idle or not (two idle agents took
1.99 cores; 0.06 with 10-1000 us). On a small host that core is taken from the copies: a 64 MiB
write between two processes took 25 ms with spinning agents, 13 ms with this delay."""


def _sync_mode(api: Any) -> Any:
    """The thread-sync mode for an agent driven from several threads: RW, else STRICT."""
    modes = api.nixl_thread_sync_t
    return getattr(modes, "NIXL_THREAD_SYNC_RW", None) or modes.NIXL_THREAD_SYNC_STRICT


def make_agent(api: Any, name: str, backends: Sequence[str]) -> tuple[Any, bool]:
    """A NIXL agent (``api`` is ``nixl._api``) that may be driven from several threads and whose
    progress thread waits :data:`PROGRESS_DELAY_US` between rounds instead of spinning; and
    whether that delay could be set. The wrapper offers no such option, so its engine object
    (``agent``) is replaced, before any backend exists, by one built with the full config; a
    wrapper without those names gets its own configuration (progress thread spinning)."""
    mode = _sync_mode(api)
    try:
        bind = api.nixlBind
        config = bind.nixlAgentConfig()
        config.useProgThread = True
        config.useListenThread = False
        config.syncMode = mode.value
        config.pthrDelay = PROGRESS_DELAY_US
        config.captureTelemetry = False
        shell = api.nixl_agent(
            name, api.nixl_agent_config(enable_prog_thread=False, backends=[], sync_mode=mode)
        )
        shell.agent = bind.nixlAgent(name, config)
    except AttributeError:
        return api.nixl_agent(name, api.nixl_agent_config(backends=list(backends),
                                                          sync_mode=mode)), False  # fmt: skip
    for backend in backends:
        shell.create_backend(backend, {})
    return shell, True


_Posted = tuple[Job, dict[RegionId, int]]
"""A batch for the poster, with the peer's base addresses it was checked against at submit (a
later ``connect`` may refresh the peer's table before the poster gets to it)."""

CLOSE_RELEASE_S = 5.0
"""How long ``close`` keeps asking NIXL to let go of a request still active."""
CLOSE_JOIN_S = 60.0
"""How long ``close`` waits for the poster thread to stop (it may be inside a NIXL call)."""


class NixlTransport(TransportCore):
    """NIXL agent as a kvplane transport (CPU memory; ``backends`` defaults to UCX)."""

    name = "nixl"
    _cpu_only = True

    def __init__(
        self,
        *,
        agent: str | None = None,
        metrics: MetricsRegistry | None = None,
        backends: tuple[str, ...] = ("UCX",),
        history: int = 100_000,
    ) -> None:
        _api = import_engine("nixl._api", INSTALL_HINT)
        _logs_to_stderr()
        super().__init__(agent=agent, metrics=metrics, history=history)
        try:
            self._agent: Any
            self._agent, self.progress_delay_set = make_agent(_api, self.agent, backends)
        except Exception as exc:
            raise TransportError(f"cannot create NIXL agent {self.agent!r}: {exc!r}") from None
        self._bases: dict[PeerId, dict[RegionId, int]] = {}
        self._poster = JobThread(f"kvplane-nixl-{self.agent}-post", self._post_loop)

    # -- memory and metadata -------------------------------------------------------------------
    def _on_register(self, entry: RegionEntry) -> None:
        r = entry.region
        try:
            entry.extra = self._agent.register_memory([(r.base, r.length, 0, "")], "DRAM")
        except Exception as exc:
            raise TransportError(
                f"NIXL refused to register region {r.region_id}: {exc!r}"
            ) from None

    def _on_deregister(self, entry: RegionEntry) -> None:
        if entry.extra is not None:
            self._agent.deregister_memory(entry.extra)

    def metadata(self) -> bytes:
        self._check_open()
        regions = pointers.region_infos(self._regions.entries())
        blob = bytes(self._agent.get_agent_metadata())
        return encode(Metadata(WIRE_VERSION, self.name, self.agent, regions=regions, engine=blob))

    def _connect(self, peer_metadata: bytes) -> Peer:
        meta = decode_metadata(peer_metadata, self.name)
        if meta.agent == self.agent:
            name = meta.agent  # loopback: NIXL addresses its own agent without loading metadata
        else:
            try:
                loaded = self._agent.add_remote_agent(meta.engine)
            except Exception as exc:
                raise TransportError(f"NIXL could not load {meta.agent!r}: {exc!r}") from None
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if name != meta.agent:
            raise IncompatiblePeerError(f"NIXL metadata names {name!r}, ours says {meta.agent!r}")
        peer, bases = pointers.peer_tables(meta)
        with self._lock:
            self._bases[peer.peer_id] = bases
        return peer

    # -- transfers: the caller's side ----------------------------------------------------------
    def _start(self, job: Job) -> None:
        with self._lock:
            bases = self._bases.get(job.peer.peer_id)
        if bases is None:
            raise TransportError(f"no NIXL metadata for peer {job.peer.peer_id}")
        self._poster.put((job, bases))

    def _abort(self, batch: Batch) -> None:
        """Nothing here: the poster sees the batch ended and releases its NIXL request."""

    def _close(self) -> None:
        if not self._poster.stop(CLOSE_JOIN_S):  # stuck in a NIXL call: its memory may be used
            log.error("NIXL poster of %s did not stop within %s s of close", self.agent,
                      CLOSE_JOIN_S)  # fmt: skip
        with self._lock:
            peers = list(self._bases)
            self._bases.clear()
        for peer in peers:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(peer)

    def notifications(self) -> list[tuple[PeerId, bytes]]:
        for name, messages in self._agent.get_new_notifs().items():
            for msg in messages:
                if msg.startswith(_TAG):
                    self._deliver(PeerId(str(name)), bytes(msg[len(_TAG) :]))
        return super().notifications()

    # -- transfers: the poster thread ----------------------------------------------------------
    def _post_loop(self, jobs: queue.SimpleQueue[_Posted | None]) -> None:
        """The poster thread; ``None`` (queued by ``close``): release what it holds and exit."""
        running: list[Batch] = []
        idle = 0
        while True:
            items = self._take(jobs, min(POLL_MAX_S, POLL_MIN_S * 2**idle) if running else None)
            for item in items:
                if item is None:
                    self._release_all(running)
                    return
                try:
                    self._post(item, running)
                except Exception as exc:  # a bug must not stop the poster: fail this batch
                    if not self._poster_error(item[0].batch, exc):
                        running.append(item[0].batch)
            before = len(running)
            running[:] = [b for b in running if not self._advanced(b)]
            idle = 0 if items or len(running) < before else min(idle + 1, 5)

    def _advanced(self, batch: Batch) -> bool:
        """:meth:`_advance`, with a bug failing that batch instead of the poster."""
        try:
            return self._advance(batch)
        except Exception as exc:
            return self._poster_error(batch, exc)

    def _poster_error(self, batch: Batch, exc: Exception) -> bool:
        """Fail a batch the poster broke on; True once its request is released."""
        log.exception("NIXL poster error (the poster keeps running)")
        self._batches.finish(batch, XferState.FAILED, FailureKind.LOCAL_ERROR,
                             f"NIXL poster error: {exc!r}", doubt_if_started=True)  # fmt: skip
        return self._release(batch)

    def _release_all(self, running: list[Batch]) -> None:
        """Closing: cancel and release every running request, asking again for up to
        :data:`CLOSE_RELEASE_S` while NIXL keeps one active (the core fails the batches and
        deregisters their memory next)."""
        end = time.monotonic() + CLOSE_RELEASE_S
        while running:
            running[:] = [b for b in running if not self._release(b)]
            if running and time.monotonic() > end:
                log.error("NIXL kept %d request(s) active past close", len(running))
                return
            if running:
                time.sleep(POLL_MAX_S)

    @staticmethod
    def _take(
        jobs: queue.SimpleQueue[_Posted | None], timeout_s: float | None
    ) -> list[_Posted | None]:
        """Every queued item, waiting up to ``timeout_s`` (None: until one comes) for the first."""
        try:
            items = [jobs.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(jobs.get_nowait())
            except queue.Empty:
                return items

    def _post(self, item: _Posted, running: list[Batch]) -> None:
        """Post one queued batch to NIXL; add it to ``running`` unless it has ended and its
        request is released."""
        job, remote_bases = item
        batch, peer_id = job.batch, job.peer.peer_id
        if not self._batches.begin(batch):  # cancelled, timed out or closed while queued
            self._batches.quiesce(batch)
            return
        agent = self._agent
        message = b"" if job.notify is None else _TAG + job.notify
        try:
            if not len(job.src):
                if job.notify is not None:
                    agent.send_notif(peer_id, message)
                self._end(batch, "DONE")
                return
            src, dst = coalesce(job.src, job.dst, min_gain=1.0)  # fewer NIXL descriptors
            local, remote = (src, dst) if batch.kind is XferKind.WRITE else (dst, src)
            local_d = agent.get_xfer_descs(
                addresses(pointers.local_bases(self._regions.entries()), local), "DRAM"
            )
            remote_d = agent.get_xfer_descs(addresses(remote_bases, remote), "DRAM")
            op = "WRITE" if batch.kind is XferKind.WRITE else "READ"
            batch.job = agent.initialize_xfer(op, local_d, remote_d, peer_id, message)
            state = agent.transfer(batch.job)
            self._batches.commit(batch)  # posted: an early end now leaves the bytes in doubt
        except Exception as exc:
            if not self._end(batch, "ERR", exc):
                running.append(batch)
            return
        if state == "PROC" or not self._end(batch, state):
            running.append(batch)

    def _advance(self, batch: Batch) -> bool:
        """Poll one running request; True once it has ended and been released. NIXL's state
        is read before the deadline is judged: a request that finished while the poster was
        busy elsewhere ends DONE, not timed out."""
        if batch.terminal:  # cancelled or timed out: release (cancel) the NIXL request
            return self._release(batch)
        try:
            state = self._agent.check_xfer_state(batch.job)
        except Exception as exc:
            return self._end(batch, "ERR", exc)
        if state != "PROC":
            return self._end(batch, state)
        if time.monotonic() > batch.deadline:
            self._end_early(batch, FailureKind.TIMEOUT, "deadline passed")
            return self._release(batch)
        return False

    def _end(self, batch: Batch, state: str, exc: BaseException | None = None) -> bool:
        """End a batch whose request NIXL reports ended: release the request first, so that a
        caller who sees the batch end sees its regions unpinned. False if NIXL still holds the
        request (the poster retries the release; the regions stay pinned until then)."""
        released = self._release(batch)
        if state == "DONE":
            if released:  # else it stays running: a DONE batch is already released
                self._batches.finish(batch, XferState.DONE)
        else:
            failure = FailureKind.BACKEND_ERROR if exc is None else _failure(exc)
            self._batches.finish(batch, XferState.FAILED, failure, f"NIXL: {exc or state}")
        return released

    def _release(self, batch: Batch) -> bool:
        """Free the NIXL request (cancelling it if active); quiesce on success."""
        if batch.job is not None:
            try:
                self._agent.release_xfer_handle(batch.job)
            except Exception:  # still active and not cancellable yet: retried by the poster
                return False
            batch.job = None
        self._batches.quiesce(batch)
        return True


class RawNixlWriter:
    """The raw NIXL API with nothing of kvplane in between: the bench's limit for the adapter.

    Registers ``buffer`` with a fresh agent (configured as the adapter's, :func:`make_agent`: a
    raw user would not leave a core spinning either), loads the peer from kvplane metadata, and
    :meth:`write` posts one NIXL WRITE of the given runs and polls it to completion with the
    adapter's poster policy (sleeping ``POLL_MIN_S`` doubling to ``POLL_MAX_S``): a busy-polling
    limit would take a core from the receiving peer on a small host and measure *less* than
    the adapter.
    """

    def __init__(self, peer_metadata: bytes, buffer: torch.Tensor) -> None:
        from nixl import _api

        _logs_to_stderr()
        meta = decode_metadata(peer_metadata, "nixl")
        self._agent: Any
        self._agent, _ = make_agent(_api, f"raw-{os.getpid()}-{secrets.token_hex(4)}", ["UCX"])
        self._reg = self._agent.register_memory(buffer)
        self._peer = self._agent.add_remote_agent(meta.engine)
        self._base = buffer.data_ptr()
        self._bases = {r.region_id: r.base for r in meta.regions}

    def write(self, src_offsets: Int64Array, region: int, dst_offsets: Int64Array,
              lengths: Int64Array) -> None:  # fmt: skip
        zeros = np.zeros_like(lengths)
        local = np.stack([self._base + src_offsets, lengths, zeros], axis=1).astype(np.uint64)
        remote = np.stack([self._bases[region] + dst_offsets, lengths, zeros], axis=1)
        agent = self._agent
        handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, "DRAM"),
                                       agent.get_xfer_descs(remote.astype(np.uint64), "DRAM"),
                                       self._peer)  # fmt: skip
        state = agent.transfer(handle)
        idle = 0
        while state == "PROC":
            time.sleep(min(POLL_MAX_S, POLL_MIN_S * 2**idle))
            idle += 1
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        if state != "DONE":
            raise TransportError(f"raw NIXL write ended {state}")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._agent.deregister_memory(self._reg)
            self._agent.remove_remote_agent(self._peer)
