"""``WorkerConfig``: everything a prefill or decode worker is started with (CLI flags map 1:1).

Owns the rules a worker's start-up values obey: a secret unless ``insecure`` is explicit, a
data plane that can prove that secret, zmq addresses with ports in range. Must not open sockets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvplane.errors import ConfigError
from kvplane.pd.events import check_id
from kvplane.pd.timers import Timings
from kvplane.transfer import OpGrouping
from kvplane.transports.bounds import FIRST_BYTE_TIMEOUT_S
from kvplane.transports.registry import CROSS_PROCESS
from kvplane.validators import require_bool, require_finite_positive, require_int

LOOPBACK = "tcp://127.0.0.1:0"
SECRET_TRANSPORTS: frozenset[str] = frozenset({"tcp", "shm"})
"""Data planes that take the shared secret and prove it on every connection; of the other
cross-process ones (nixl, mooncake) none can authenticate its peers."""
MAX_PORT = 65535


def check_transport_secret(transport: str, has_secret: bool) -> None:
    """Refuse (``ConfigError``) a secret with a data plane that cannot authenticate: it would
    run open while the operator believes it is closed."""
    if has_secret and transport in CROSS_PROCESS - SECRET_TRANSPORTS:
        raise ConfigError(
            f"transport {transport!r} cannot authenticate its data plane; run with --insecure "
            "(WorkerConfig.insecure=True, no secret) to accept that"
        )


def check_port(what: str, value: object) -> int:
    """``value`` as a TCP port: an int in [1, 65535], or 0 (any free port to bind, or a
    listener that is off); else ``ConfigError`` naming ``what``."""
    return require_int(what, value, min=0, max=MAX_PORT, error=ConfigError)


def split_address(what: str, address: object) -> tuple[str, int] | None:
    """``(host, port)`` of a ``tcp://HOST:PORT`` zmq address (``*`` and port ``0`` allowed: any
    interface, any free port); ``None`` for another scheme (``ipc://``, ``inproc://``).
    ``ConfigError`` naming ``what`` for anything else, or a port outside [0, 65535]."""
    if not isinstance(address, str) or "://" not in address:
        raise ConfigError(
            f"{what} must be a zmq address like tcp://127.0.0.1:5555, got {address!r}"
        )
    scheme, _, rest = address.partition("://")
    if scheme != "tcp":
        if scheme in ("ipc", "inproc") and rest:
            return None
        raise ConfigError(f"{what} must be a tcp://, ipc:// or inproc:// address, got {address!r}")
    host, sep, port = rest.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not (port.isascii() and port.isdigit()):
        raise ConfigError(f"{what} must be tcp://HOST:PORT, got {address!r}")
    if len(port) > 5:  # also spares int() a number of thousands of digits
        raise ConfigError(f"{what}'s port must be an int in [0, {MAX_PORT}], got {port[:20]!r}")
    return host, check_port(f"{what}'s port", int(port))


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One worker. ``name`` is its PD peer id (unique in a deployment). ``control_bind`` is the
    runtime order socket, ``pd_bind`` the PD control endpoint (both 127.0.0.1 unless told
    otherwise); ``transport`` names the byte mover (``tcp``, ``shm``, ``local``...).
    ``num_blocks``/``block_size`` size the KV pool, ``num_slots`` bounds requests holding
    memory at once, ``head_range`` is the rank's TP range of KV heads (None: all).
    ``step_size`` is the default prefill step (tokens); ``slice_timeout_s`` bounds every slice
    transfer; ``timings`` are the PD protocol's; ``metrics_port`` > 0 serves ``/metrics``;
    ``incarnation`` 0 derives one from the clock (a restarted worker must use a larger one).
    ``pipelined`` False sends a request's KV only after its prefill ends (the baseline);
    ``auto_pipelining`` decides that and the slice size per request from the simulator's cost
    model (:func:`kvplane.simulate.timing.choose_pipelining`), ``pipelined`` then ignored.
    ``copy_threads`` is how many threads a ``tcp``/``shm`` transport copies bytes with (None:
    torch's thread count). ``first_byte_timeout_s``: a connection a ``tcp``/``shm`` data plane
    accepted that sends nothing this long is dropped. ``secret`` authenticates the PD endpoint,
    the order socket and the data plane; without one, ``insecure`` must say so explicitly (and
    is refused with one)."""

    name: str
    control_bind: str = LOOPBACK
    pd_bind: str = LOOPBACK
    transport: str = "tcp"
    transport_host: str = "127.0.0.1"
    num_blocks: int = 512
    block_size: int = 16
    num_slots: int = 64
    head_range: tuple[int, int] | None = None
    step_size: int = 256
    slice_timeout_s: float = 10.0
    timings: Timings = field(default_factory=Timings)
    secret: bytes | None = None
    metrics_port: int = 0
    hash_seed: int = 0
    incarnation: int = 0
    grouping: OpGrouping = OpGrouping.WHOLE
    max_inflight_ops: int = 8
    pipelined: bool = True
    auto_pipelining: bool = False
    copy_threads: int | None = None
    first_byte_timeout_s: float = FIRST_BYTE_TIMEOUT_S
    insecure: bool = False

    def __post_init__(self) -> None:
        try:
            check_id("WorkerConfig", "name", self.name)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for name in ("num_blocks", "block_size", "num_slots", "step_size", "max_inflight_ops"):
            require_int(f"WorkerConfig.{name}", getattr(self, name), min=1, error=ConfigError)
        if self.copy_threads is not None:
            require_int("WorkerConfig.copy_threads", self.copy_threads, min=1, error=ConfigError)
        for name in ("control_bind", "pd_bind"):
            split_address(f"WorkerConfig.{name}", getattr(self, name))
        if not isinstance(self.transport, str) or not self.transport:
            raise ConfigError(
                f"WorkerConfig.transport must name a transport, got {self.transport!r}"
            )
        if self.head_range is not None and (
            len(self.head_range) != 2 or not 0 <= self.head_range[0] < self.head_range[1]
        ):
            raise ConfigError(
                f"WorkerConfig.head_range must be (start, end), got {self.head_range}"
            )
        for name in ("slice_timeout_s", "first_byte_timeout_s"):
            require_finite_positive(f"WorkerConfig.{name}", getattr(self, name))
        if not isinstance(self.timings, Timings):
            raise ConfigError(f"WorkerConfig.timings must be Timings, got {self.timings!r}")
        if self.secret is not None and (not isinstance(self.secret, bytes) or not self.secret):
            raise ConfigError("WorkerConfig.secret must be non-empty bytes or None")
        for name in ("hash_seed", "incarnation"):
            require_int(f"WorkerConfig.{name}", getattr(self, name), min=0, error=ConfigError)
        check_port("WorkerConfig.metrics_port", self.metrics_port)
        require_bool("WorkerConfig.pipelined", self.pipelined, error=ConfigError)
        require_bool("WorkerConfig.auto_pipelining", self.auto_pipelining, error=ConfigError)
        # CHUNK grouping is the offload copier's (one op per stored chunk): a PD slice ends
        # where a prefill step ends, not on a chunk boundary, and is planned with no chunk spec
        if not isinstance(self.grouping, OpGrouping) or self.grouping is OpGrouping.CHUNK:
            raise ConfigError(
                f"WorkerConfig.grouping must be WHOLE or LAYER, got {self.grouping!r}"
            )
        self._check_security()

    def _check_security(self) -> None:
        """A secret, or ``insecure`` said explicitly; never both; a data plane that proves it."""
        require_bool("WorkerConfig.insecure", self.insecure, error=ConfigError)
        if self.secret is None and not self.insecure:
            raise ConfigError(
                "WorkerConfig.secret is required (KVPLANE_SECRET or --secret-file); "
                "set insecure=True (--insecure) to run unauthenticated"
            )
        if self.secret is not None and self.insecure:
            raise ConfigError(
                "WorkerConfig.insecure=True contradicts a secret: give one or the other"
            )
        check_transport_secret(self.transport, self.secret is not None)
