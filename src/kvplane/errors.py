"""The one error hierarchy of kvplane.

Misuse and failure raise a subclass of :class:`KVPlaneError`; expected shortage (no free block,
no evictable slot, a cache miss) is a ``None`` or typed result instead, never an exception.
Errors that reject a bad argument also derive from ``ValueError`` (or ``KeyError`` for unknown
ids) so generic callers can catch them idiomatically. Every message names the offending value.
A failed call leaves the object it was called on unchanged.
"""

from __future__ import annotations

from typing import ClassVar


class KVPlaneError(Exception):
    """Base of every error kvplane raises on purpose."""


class _UnknownKeyError(KeyError):
    """A ``KeyError`` whose message reads as written (``KeyError`` quotes its argument)."""

    unknown: ClassVar[str] = "unknown key"
    """The message when raised without one."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else self.unknown


# -- bad input --------------------------------------------------------------------------------
class InvalidArgumentError(KVPlaneError, ValueError):
    """An argument is out of its documented domain (negative size, empty range, wrong dtype...)."""


class ConfigError(InvalidArgumentError):
    """A configuration value is missing, unknown, of the wrong type or out of range."""


class LayoutError(InvalidArgumentError):
    """A KV layout cannot hold its dimensions, or two layouts are incompatible."""


class ChunkError(InvalidArgumentError):
    """A chunk spec or a token/block/chunk mapping request is invalid."""


# -- block pool misuse ------------------------------------------------------------------------
class BlockError(KVPlaneError):
    """Base for misuse of a block pool or block table."""


class UnknownBlockError(BlockError, _UnknownKeyError):
    """A block id does not belong to the pool."""

    unknown = "unknown block"


class DoubleFreeError(BlockError):
    """A block was freed more times than it was allocated or touched."""


class BlockStateError(BlockError):
    """A block operation does not fit the block's state (e.g. caching a free block)."""


# -- state machines -----------------------------------------------------------------------------
class IllegalTransitionError(KVPlaneError):
    """A state machine was asked for a transition its table does not allow."""


class ProtocolError(KVPlaneError):
    """A PD protocol participant received an event its state does not allow."""


class MalformedMessageError(ProtocolError):
    """A wire frame could not be decoded or validated."""


class IncompatiblePeerError(ProtocolError):
    """A handshake's compatibility fingerprint does not match ours."""


# -- plans and transports --------------------------------------------------------------------------
class PlanError(InvalidArgumentError):
    """A transfer plan is invalid (overlap, length mismatch, out of bounds, uncovered bytes)."""


class TransportError(KVPlaneError):
    """A transport failed to register memory, connect or move bytes."""


class RemoteDisconnectError(TransportError):
    """The peer went away (process death, closed connection) while work was outstanding."""


class TransferTimeoutError(TransportError):
    """A transfer or wait passed its deadline."""


class UnsupportedError(KVPlaneError):
    """An optional engine or feature is not available here; the message says how to get it."""


# -- offload --------------------------------------------------------------------------------------
class OffloadError(KVPlaneError):
    """An offload tier or job failed (I/O error, store unreachable)."""


class CorruptChunkError(OffloadError):
    """A stored chunk failed its header or checksum validation."""


# -- attention -----------------------------------------------------------------------------------
class BackendError(KVPlaneError):
    """An attention backend was misused (run without a plan, shape mismatch...)."""


class UnknownChunkError(OffloadError, _UnknownKeyError):
    """A chunk key is not held by the offload tier it was named to."""

    unknown = "unknown chunk"


# -- models --------------------------------------------------------------------------------------
class CheckpointError(InvalidArgumentError):
    """A model checkpoint (``config.json`` + ``*.safetensors``) is unreadable, of an unsupported
    architecture, or has missing, unexpected or mis-shaped tensors."""


# -- transports (appended) --------------------------------------------------------------------
class UnknownPeerError(TransportError, _UnknownKeyError):
    """A transfer names a peer this transport never connected to (or has forgotten)."""

    unknown = "unknown peer"


class HandshakeError(TransportError):
    """A stream connection's handshake failed: a peer did not prove the shared secret for this
    connection, was not the one meant, or closed unanswered."""


# -- integrations (appended) ------------------------------------------------------------------
class IntegrationError(KVPlaneError):
    """A run of a third-party engine with kvplane inside it (e.g. vLLM) failed."""


# -- runtime (appended) -----------------------------------------------------------------------
class WorkerDiedError(KVPlaneError):
    """A worker process exited while the runtime (e.g. ``kvplane demo``) still needed it."""
