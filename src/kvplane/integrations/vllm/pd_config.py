"""The connector's PD settings: the ``pd_*`` keys of ``kv_connector_extra_config``.

Owns :class:`PDConfig` (the ``[pd]`` section, resolved like every kvplane section: extra-config
key > ``KVPLANE_PD_<FIELD>`` > default) and :class:`PDSettings`, the checked result with the
secret read. Secure by default: a PD transport without a secret is refused unless ``pd_insecure``
says so. Plain data; opens no socket.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvplane.config import resolve, secret_or_insecure
from kvplane.errors import ConfigError
from kvplane.pd.timers import DEFAULT_TIMINGS, Timings, check_heartbeat
from kvplane.validators import require_finite_positive

PD_TRANSPORTS = ("tcp", "shm", "nixl", "mooncake")
"""Transports a PD connector can move KV with (``local`` is in-process only)."""


@dataclass(frozen=True, slots=True)
class PDConfig:
    """The ``[pd]`` section. ``transport`` empty: PD is off (offload only). ``check_prompt``
    False lets a decode request take KV computed for another prompt of its length (the control
    experiment that shows the decode engine reads the transferred KV; never in production).
    ``connect_timeout_s`` bounds a decode engine's handshake with a prefill engine."""

    transport: str = ""
    bind: str = "tcp://127.0.0.1:0"
    host: str = "127.0.0.1"
    name: str = ""
    secret_file: str = ""
    insecure: bool = False
    check_prompt: bool = True
    deadline_s: float = 120.0
    slice_timeout_s: float = 30.0
    pull_timeout_s: float = 120.0
    connect_timeout_s: float = 30.0
    lease_s: float = DEFAULT_TIMINGS.lease_s
    heartbeat_s: float = DEFAULT_TIMINGS.heartbeat_s

    def __post_init__(self) -> None:
        if self.transport and self.transport not in PD_TRANSPORTS:
            raise ConfigError(f"pd_transport {self.transport!r} is not one of {PD_TRANSPORTS}")
        for what in (
            "deadline_s", "slice_timeout_s", "pull_timeout_s", "connect_timeout_s", "lease_s",
            "heartbeat_s",
        ):  # fmt: skip
            require_finite_positive(f"pd_{what}", getattr(self, what))
        check_heartbeat(self.heartbeat_s, self.lease_s, "pd_")


@dataclass(frozen=True, slots=True)
class PDSettings:
    """What the PD worker side runs with (see :func:`pd_settings`)."""

    transport: str
    bind: str
    host: str
    name: str
    secret: bytes | None
    check_prompt: bool
    slice_timeout_s: float
    pull_timeout_s: float
    connect_timeout_s: float
    timings: Timings


def pd_config(extra: Mapping[str, Any], env: Mapping[str, str]) -> PDConfig:
    """The ``[pd]`` section from the extra config's ``pd_*`` keys (and ``KVPLANE_PD_*``)."""
    flags = {k[3:]: v for k, v in extra.items() if k.startswith("pd_")}
    config, _ = resolve(PDConfig, "pd", flags=flags, env=dict(env))
    return config


def pd_settings(config: PDConfig, env: Mapping[str, str]) -> PDSettings | None:
    """The settings, or None when PD is off. ``ConfigError`` for a missing or short secret
    (unless ``insecure``), a secret with a transport that cannot authenticate, or both."""
    if not config.transport:
        return None
    secret = secret_or_insecure(
        config.secret_file, env, prefix="pd", insecure=config.insecure, needs="PD needs",
        so_that="no other process can read or overwrite KV", otherwise="to run without one",
    )  # fmt: skip
    if secret is not None and config.transport not in ("tcp", "shm"):
        raise ConfigError(f"pd_transport {config.transport!r} cannot authenticate its data plane")
    timings = Timings(
        deadline_s=config.deadline_s, lease_s=config.lease_s, heartbeat_s=config.heartbeat_s
    )
    return PDSettings(
        transport=config.transport,
        bind=config.bind,
        host=config.host,
        name=config.name or f"vllm-{os.getpid()}",
        secret=secret,
        check_prompt=config.check_prompt,
        slice_timeout_s=config.slice_timeout_s,
        pull_timeout_s=config.pull_timeout_s,
        connect_timeout_s=config.connect_timeout_s,
        timings=timings,
    )
