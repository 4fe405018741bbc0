"""``nixl``: adapter over NVIDIA NIXL (``pip install nixl``; UCX backend, DRAM here).

Theory of operation
-------------------
One NIXL agent per transport, named after our agent. ``register`` registers the tensor's bytes
with the agent; ``metadata`` wraps the agent's own metadata blob together with our region table
(ids, lengths, base addresses); ``connect`` loads the peer's blob (``add_remote_agent``, which
also refreshes it) and keeps the peer's base addresses. ``submit`` coalesces the pairs, turns
them into two ``(address, length, device)`` arrays -- vectorised, no loop per descriptor -- and
posts one NIXL transfer whose notification (tagged, so it is told apart from foreign ones)
NIXL delivers to the peer after the data. ``poll`` asks NIXL for the state. NIXL has no
deadline of its own: past ours we try to release (cancel) the request; if NIXL cannot yet, the
request is kept and reaped later, and the batch's regions stay pinned until it is. NIXL raising
its remote-disconnect error maps to REMOTE_DISCONNECT. NIXL is imported here only; without it
the constructor raises ``UnsupportedError`` with the install hint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sys
from typing import Any

import numpy as np
import torch

from kvplane.errors import IncompatiblePeerError, TransportError, UnsupportedError
from kvplane.ids import PeerId, RegionId
from kvplane.metrics import MetricsRegistry
from kvplane.transports.base import (
    DescriptorList,
    FailureKind,
    Handle,
    Int64Array,
    Peer,
    Poll,
    XferKind,
    XferState,
)
from kvplane.transports.batches import Batch
from kvplane.transports.copier import coalesce
from kvplane.transports.core import TransportCore
from kvplane.transports.regions import RegionEntry
from kvplane.transports.wire import WIRE_VERSION, Metadata, RegionInfo, decode_metadata, encode

INSTALL_HINT = "NIXL is not installed: pip install torch==2.13.0 && pip install nixl"
_TAG = b"K"
"""Prefix of kvplane notifications (an empty notify is still a non-empty NIXL message)."""


def _logs_to_stderr() -> None:
    """NIXL configures its logger to print on stdout; move it to stderr so that a program's
    stdout (``--json`` output, pipes) stays clean."""
    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def probe() -> str | None:
    """None if NIXL can be imported here, else why not and how to install it."""
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception as exc:  # ImportError, or a broken native library
        return f"{INSTALL_HINT} ({type(exc).__name__}: {exc})"
    _logs_to_stderr()
    return None


def _failure(exc: BaseException) -> FailureKind:
    name = type(exc).__name__
    return (
        FailureKind.REMOTE_DISCONNECT if "RemoteDisconnect" in name else FailureKind.BACKEND_ERROR
    )


def addresses(bases: dict[RegionId, int], descs: DescriptorList) -> np.ndarray[Any, Any]:
    """``(N, 3)`` uint64 rows ``(base[region] + offset, length, device 0)``, vectorised."""
    ids = np.array(sorted(bases), dtype=np.int64)
    base = np.array([bases[RegionId(int(i))] for i in ids], dtype=np.int64)
    addr = base[np.searchsorted(ids, descs.regions)] + descs.offsets
    rows = np.stack([addr, descs.lengths, np.zeros_like(addr)], axis=1)
    return rows.astype(np.uint64)


class NixlTransport(TransportCore):
    """NIXL agent as a kvplane transport (CPU memory; ``backends`` defaults to UCX)."""

    name = "nixl"
    _spin_wait = True  # NIXL completes (and sends notifications) as it is polled

    def __init__(
        self,
        *,
        agent: str | None = None,
        metrics: MetricsRegistry | None = None,
        backends: tuple[str, ...] = ("UCX",),
        history: int = 100_000,
    ) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except Exception as exc:
            raise UnsupportedError(f"{INSTALL_HINT} ({type(exc).__name__}: {exc})") from None
        _logs_to_stderr()
        super().__init__(agent=agent, metrics=metrics, history=history)
        try:
            self._agent: Any = nixl_agent(self.agent, nixl_agent_config(backends=list(backends)))
        except Exception as exc:
            raise TransportError(f"cannot create NIXL agent {self.agent!r}: {exc!r}") from None
        self._bases: dict[PeerId, dict[RegionId, int]] = {}
        self._zombies: list[Batch] = []

    # -- memory and metadata -------------------------------------------------------------------
    def _exported(self, view: Any) -> tuple[bool, object]:
        if view.device.type != "cpu":
            raise TransportError(f"the nixl adapter registers CPU memory, got {view.device}")
        return True, None

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

    def _local_bases(self) -> dict[RegionId, int]:
        return {e.region.region_id: e.region.base for e in self._regions.entries()}

    def metadata(self) -> bytes:
        self._check_open()
        regions = [RegionInfo(int(e.region.region_id), e.region.length, e.region.base)
                   for e in self._regions.entries()]  # fmt: skip
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
        peer_id = PeerId(meta.agent)
        with self._lock:
            self._bases[peer_id] = {RegionId(r.region_id): r.base for r in meta.regions}
        return Peer(peer_id, {RegionId(r.region_id): r.length for r in meta.regions})

    # -- transfers -----------------------------------------------------------------------------
    def _start(
        self, batch: Batch, src: DescriptorList, dst: DescriptorList, peer: Peer,
        notify: bytes | None,
    ) -> None:  # fmt: skip
        self._reap()
        message = b"" if notify is None else _TAG + notify
        if not len(src):
            if notify is not None:
                self._agent.send_notif(peer.peer_id, message)
            self._settle(batch, "DONE")
            return
        src, dst = coalesce(src, dst, min_gain=1.0)  # fewer NIXL descriptors
        local, remote = (src, dst) if batch.kind is XferKind.WRITE else (dst, src)
        with self._lock:
            remote_bases = self._bases[peer.peer_id]
        agent = self._agent
        local_d = agent.get_xfer_descs(addresses(self._local_bases(), local), "DRAM")
        remote_d = agent.get_xfer_descs(addresses(remote_bases, remote), "DRAM")
        op = "WRITE" if batch.kind is XferKind.WRITE else "READ"
        batch.job = agent.initialize_xfer(op, local_d, remote_d, peer.peer_id, message)
        self._batches.begin(batch)
        try:
            state = agent.transfer(batch.job)
        except Exception as exc:
            self._settle(batch, "ERR", exc)
            return
        self._settle(batch, state)

    def _settle(self, batch: Batch, state: str, exc: BaseException | None = None) -> None:
        if state == "PROC":
            return
        if state == "DONE":
            self._batches.finish(batch, XferState.DONE)
        else:
            failure = FailureKind.BACKEND_ERROR if exc is None else _failure(exc)
            self._batches.finish(batch, XferState.FAILED, failure, f"NIXL: {exc or state}")
        self._release(batch)

    def _release(self, batch: Batch) -> bool:
        """Free the NIXL request (cancelling it if active); quiesce on success."""
        if batch.job is not None:
            try:
                self._agent.release_xfer_handle(batch.job)
            except Exception:  # still active and not cancellable yet: reap later
                return False
            batch.job = None
        self._batches.quiesce(batch)
        return True

    def _progress(self, batch: Batch) -> None:
        try:
            state = self._agent.check_xfer_state(batch.job)
        except Exception as exc:
            self._settle(batch, "ERR", exc)
            return
        self._settle(batch, state)

    def _abort(self, batch: Batch) -> None:
        if not self._release(batch):
            with self._lock:
                self._zombies.append(batch)

    def _reap(self) -> None:
        with self._lock:
            zombies, self._zombies = self._zombies, []
        for batch in zombies:
            with contextlib.suppress(Exception):
                if self._agent.check_xfer_state(batch.job) == "PROC":
                    with self._lock:
                        self._zombies.append(batch)
                    continue
            if not self._release(batch):
                with self._lock:
                    self._zombies.append(batch)

    def poll(self, handle: Handle) -> Poll:
        self._reap()
        return super().poll(handle)

    def notifications(self) -> list[tuple[PeerId, bytes]]:
        for name, messages in self._agent.get_new_notifs().items():
            for msg in messages:
                if msg.startswith(_TAG):
                    self._deliver(PeerId(str(name)), bytes(msg[len(_TAG) :]))
        return super().notifications()

    def _close(self) -> None:
        for batch in self._batches.live():
            if batch.job is not None:
                with contextlib.suppress(Exception):
                    self._agent.release_xfer_handle(batch.job)
                batch.job = None
        with self._lock:
            peers = list(self._bases)
            self._bases.clear()
        for peer in peers:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(peer)


class RawNixlWriter:
    """The raw NIXL API with nothing of kvplane in between: the bench's limit for the adapter.

    Registers ``buffer`` with a fresh agent, loads the peer from kvplane metadata, and
    :meth:`write` posts one NIXL WRITE of the given runs and busy-polls it to completion.
    """

    def __init__(self, peer_metadata: bytes, buffer: torch.Tensor) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        _logs_to_stderr()
        meta = decode_metadata(peer_metadata, "nixl")
        self._agent: Any = nixl_agent(f"raw-{os.getpid()}-{secrets.token_hex(4)}",
                                      nixl_agent_config(backends=["UCX"]))  # fmt: skip
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
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        if state != "DONE":
            raise TransportError(f"raw NIXL write ended {state}")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._agent.deregister_memory(self._reg)
            self._agent.remove_remote_agent(self._peer)
