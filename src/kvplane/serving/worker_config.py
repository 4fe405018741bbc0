"""``WorkerConfig``: everything a prefill or decode worker is started with (CLI flags map 1:1)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvplane.config import require_finite_positive
from kvplane.errors import ConfigError
from kvplane.pd.events import check_id
from kvplane.pd.timers import Timings
from kvplane.transfer import OpGrouping

LOOPBACK = "tcp://127.0.0.1:0"


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"WorkerConfig.{name} must be a positive int, got {value!r}")


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
    ``pipelined`` False sends a request's KV only after its prefill ends (the baseline).
    ``copy_threads`` is how many threads a ``tcp``/``shm`` transport copies bytes with (None:
    torch's thread count)."""

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
    copy_threads: int | None = None

    def __post_init__(self) -> None:
        try:
            check_id("WorkerConfig", "name", self.name)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for name in ("num_blocks", "block_size", "num_slots", "step_size", "max_inflight_ops"):
            _positive_int(name, getattr(self, name))
        if self.copy_threads is not None:
            _positive_int("copy_threads", self.copy_threads)
        for name in ("control_bind", "pd_bind"):
            value = getattr(self, name)
            if not isinstance(value, str) or "://" not in value:
                raise ConfigError(f"WorkerConfig.{name} must be a zmq address, got {value!r}")
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
        require_finite_positive("WorkerConfig.slice_timeout_s", self.slice_timeout_s)
        if not isinstance(self.timings, Timings):
            raise ConfigError(f"WorkerConfig.timings must be Timings, got {self.timings!r}")
        if self.secret is not None and (not isinstance(self.secret, bytes) or not self.secret):
            raise ConfigError("WorkerConfig.secret must be non-empty bytes or None")
        for name in ("metrics_port", "hash_seed", "incarnation"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"WorkerConfig.{name} must be an int >= 0, got {value!r}")
        if self.metrics_port > 65535:
            raise ConfigError(
                f"WorkerConfig.metrics_port must be <= 65535, got {self.metrics_port}"
            )
        if not isinstance(self.pipelined, bool):
            raise ConfigError(f"WorkerConfig.pipelined must be a bool, got {self.pipelined!r}")
        # CHUNK grouping is the offload copier's (one op per stored chunk): a PD slice ends
        # where a prefill step ends, not on a chunk boundary, and is planned with no chunk spec
        if not isinstance(self.grouping, OpGrouping) or self.grouping is OpGrouping.CHUNK:
            raise ConfigError(
                f"WorkerConfig.grouping must be WHOLE or LAYER, got {self.grouping!r}"
            )
