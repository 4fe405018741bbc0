"""``TransportProxy``: a :class:`~kvplane.transports.base.Transport` that forwards every call.

The base of transport wrappers (the slice driver's completion tap, fault injection): a subclass
overrides only the calls it changes, and around ``submit`` the two hooks :meth:`_before_submit`
and :meth:`_submitted`. It owns no memory, regions or batches of its own.
"""

from __future__ import annotations

import torch

from kvplane.ids import PeerId, RegionId
from kvplane.transports.base import (
    DescriptorList,
    Handle,
    Peer,
    Poll,
    Region,
    Transport,
    XferKind,
)


class TransportProxy:
    """Every :class:`~kvplane.transports.base.Transport` call, forwarded to ``inner``."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.name = inner.name

    def register(self, buffer: torch.Tensor) -> Region:
        return self.inner.register(buffer)

    def deregister(self, region_id: RegionId) -> None:
        self.inner.deregister(region_id)

    def metadata(self) -> bytes:
        return self.inner.metadata()

    def connect(self, peer_metadata: bytes) -> Peer:
        return self.inner.connect(peer_metadata)

    def submit(
        self,
        kind: XferKind,
        src: DescriptorList,
        dst: DescriptorList,
        peer: Peer,
        *,
        notify: bytes | None = None,
        deadline_s: float = 30.0,
    ) -> Handle:
        token = self._before_submit()
        handle = self.inner.submit(kind, src, dst, peer, notify=notify, deadline_s=deadline_s)
        self._submitted(handle, token)
        return handle

    def _before_submit(self) -> object:
        """Runs before each submit reaches ``inner`` (it may raise to refuse it); what it
        returns is handed to :meth:`_submitted`."""
        return None

    def _submitted(self, handle: Handle, token: object) -> None:
        """Runs once ``inner`` accepted a batch, with :meth:`_before_submit`'s ``token``."""

    def poll(self, handle: Handle) -> Poll:
        return self.inner.poll(handle)

    def cancel(self, handle: Handle) -> None:
        self.inner.cancel(handle)

    def notifications(self) -> list[tuple[PeerId, bytes]]:
        return self.inner.notifications()

    def close(self) -> None:
        self.inner.close()
