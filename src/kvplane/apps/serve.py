"""``kvplane serve prefill|decode|router|proxy``: the PD workers, the router and the vLLM PD
proxy (:mod:`~kvplane.apps.proxy_command`) as processes.

Wiring only: flags (:mod:`~kvplane.apps.serve_flags`; or ``--config``/``KVPLANE_*``,
:mod:`~kvplane.apps.serve_config`) to a :class:`~kvplane.serving.worker_config.WorkerConfig`
and a producer, checked before anything starts (:mod:`~kvplane.apps.startup`); one JSON
announce line on stdout, serve until SIGTERM/SIGINT or ``Shutdown``. Binds 127.0.0.1 unless
told otherwise; refuses to start without a secret (``KVPLANE_SECRET`` or ``--secret-file``)
unless ``--insecure``. See docs/serving.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from pathlib import Path

import zmq

from kvplane.apps.proxy_command import run_proxy
from kvplane.apps.serve_config import settle
from kvplane.apps.serve_flags import DISK_SLOT_FILE, add_arguments
from kvplane.apps.serve_stop import end_process, wait_for_stop
from kvplane.apps.startup import check_connect_address, check_pool_memory, scrub_secret_env
from kvplane.config import SECRET_ENV, read_secret
from kvplane.errors import ConfigError, InvalidArgumentError
from kvplane.metrics import MetricsRegistry
from kvplane.offload import OffloadConfig
from kvplane.pd.handshake import Placement
from kvplane.pd.timers import Timings
from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.kv_publisher import KVEventSettings
from kvplane.serving.ports import probe_bind, probe_port
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.prefix_offload import PrefixSettings
from kvplane.serving.prefix_waits import check_wait_s
from kvplane.serving.producers.base import KVModel
from kvplane.serving.producers.model import ModelDecoder, ModelProducer, ModelSpec
from kvplane.serving.producers.rank import RankProducer
from kvplane.serving.producers.synthetic import SyntheticDecoder, SyntheticProducer, SyntheticSpec
from kvplane.serving.router.route_policy import RoutePolicy
from kvplane.serving.router.router import Router
from kvplane.serving.router.service import RouterService
from kvplane.serving.worker import INSECURE_HELP, Worker, WorkerHooks
from kvplane.serving.worker_config import WorkerConfig
from kvplane.transfer import OpGrouping

__all__ = [  # add_arguments and DISK_SLOT_FILE are serve_flags', re-exported
    "DISK_SLOT_FILE", "HELP", "NAME", "add_arguments", "build_worker", "config_of",
    "disk_slot_file", "kv_events_of", "offload_of", "placement_of", "run", "secret_of", "spec_of",
]  # fmt: skip

NAME = "serve"
HELP = "Run a PD prefill worker, decode worker or router as a process."
log = logging.getLogger(__name__)
_SECRET = "_serve_secret"
"""The attribute of a parsed namespace holding (the secret, whether from ``KVPLANE_SECRET``)
once read: the variable leaves the environment when read, so a second read would find none."""


def _head_range(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--head-range must be START:END, got {text!r}") from None
    return lo, hi


def spec_of(args: argparse.Namespace) -> SyntheticSpec:
    settle(args)
    return SyntheticSpec(
        kind=args.layout, num_layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
        latent_dim=args.latent_dim, rope_dim=args.rope_dim, dtype=args.dtype,
        sliding_window=args.sliding_window, state_dim=args.state_dim, seed=args.seed,
        compute_s_per_token=args.compute_us_per_token * 1e-6,
        compute_s_per_step=args.compute_ms_per_step * 1e-3,
    )  # fmt: skip


def secret_of(args: argparse.Namespace) -> bytes | None:
    """The secret ``args`` and the environment name; ``ConfigError`` when there is none and
    ``--insecure`` was not given, or when both were. ``KVPLANE_SECRET`` is removed from the
    environment once read (:func:`~kvplane.apps.startup.scrub_secret_env`: no child inherits
    it); the secret, and whether it came from there (:func:`_warn_at_start` says so), stay in
    ``args`` for the next call."""
    if not hasattr(args, _SECRET):
        read = read_secret(args.secret_file, os.environ)
        from_env = scrub_secret_env(os.environ) and args.secret_file is None and read is not None
        setattr(args, _SECRET, (read, from_env))
    secret: bytes | None = getattr(args, _SECRET)[0]
    if secret is None and not args.insecure:
        raise ConfigError(
            f"no secret: set {SECRET_ENV} or --secret-file FILE (e.g. `openssl rand -hex 32`), "
            "or pass --insecure to accept unauthenticated peers"
        )
    if secret is not None and args.insecure:
        raise ConfigError(f"--insecure contradicts the secret given ({SECRET_ENV}/--secret-file)")
    return secret


def config_of(args: argparse.Namespace) -> WorkerConfig:
    settle(args)
    timings = Timings(
        deadline_s=args.deadline, retransmit_s=args.retransmit, drain_s=args.drain,
        in_doubt_s=args.in_doubt, heartbeat_s=args.heartbeat, lease_s=args.lease,
    )  # fmt: skip
    return WorkerConfig(
        name=args.name, control_bind=args.control, pd_bind=args.pd, transport=args.transport,
        transport_host=args.transport_host, num_blocks=args.num_blocks,
        block_size=args.block_size, num_slots=args.num_slots,
        head_range=_head_range(args.head_range), step_size=args.step_size,
        slice_timeout_s=args.slice_timeout, timings=timings, secret=secret_of(args),
        insecure=args.insecure, metrics_port=args.metrics_port,
        grouping=OpGrouping.LAYER if args.layer_ops else OpGrouping.WHOLE,
        pipelined=not args.no_pipeline and args.pipelining != "off",
        auto_pipelining=args.pipelining == "auto" and not args.no_pipeline,
        hash_seed=args.hash_seed, copy_threads=args.copy_threads,
        first_byte_timeout_s=args.first_byte_timeout,
    )  # fmt: skip


_RANK_FLAGS = ("tp-rank", "tp-size", "pp-stage", "pp-size")


def placement_of(args: argparse.Namespace) -> Placement:
    """The prefill rank's place in a TP × PP layout (one process for a decode worker);
    ``ConfigError`` naming the four flags' values and the broken rule of :class:`Placement`."""
    settle(args)
    if args.role != "prefill":
        return Placement()
    given = (args.tp_rank, args.tp_size, args.pp_stage, args.pp_size)
    try:
        return Placement(tp_rank=given[0], tp_size=given[1], pp_stage=given[2], pp_size=given[3])
    except InvalidArgumentError as exc:
        flags = " ".join(f"--{f} {v}" for f, v in zip(_RANK_FLAGS, given, strict=True))
        raise ConfigError(f"{flags}: {exc}") from None


def _producer(
    args: argparse.Namespace, model: ModelSpec, metrics: MetricsRegistry
) -> ModelProducer:
    """The prefill worker's real-model producer: one process, or the rank of ``--tp-*/--pp-*``
    (:class:`RankProducer`: simulated TP/PP compute)."""
    placement = placement_of(args)
    if placement == Placement():
        return ModelProducer.from_spec(model, metrics)
    return RankProducer.for_rank(model, placement, metrics)


def disk_slot_file(directory: str) -> Path:
    """The disk tier's slot file inside ``directory`` (created); ``ConfigError`` when the path
    is not a directory or cannot be made one."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--offload-disk must be a directory, got the file {directory!r}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"--offload-disk {directory!r} cannot be created: {exc.strerror}"
        ) from None
    return path / DISK_SLOT_FILE


def offload_of(args: argparse.Namespace) -> PrefixSettings | None:
    """The prefill worker's prefix offload, or None (``--offload-host-slots 0``)."""
    settle(args)
    wait_s = check_wait_s("--offload-pending-wait", args.offload_pending_wait, error=ConfigError)
    if not args.offload_host_slots:
        return None
    disk = disk_slot_file(args.offload_disk) if args.offload_disk else None
    config = OffloadConfig(
        host_slots=args.offload_host_slots, disk_path=disk, disk_slots=args.offload_disk_slots,
        disk_direct_io=False, pin_memory=False, remote_url=args.offload_remote_url,
        remote_mode=args.offload_remote_mode, remote_namespace=args.offload_remote_namespace,
        remote_slots=args.offload_remote_slots, remote_replicas=args.offload_remote_replicas,
        disk_codec=args.offload_disk_codec, remote_codec=args.offload_remote_codec,
    )  # fmt: skip
    tuned = getattr(args, "tune_chunks", None)
    return PrefixSettings(config, args.blocks_per_chunk, tuned, pending_wait_s=wait_s)


def kv_events_of(args: argparse.Namespace) -> KVEventSettings | None:
    """The prefill worker's KV event settings, or None (no ``--kv-events``); ``ConfigError``
    without an offload tier to publish, or for an address that cannot be bound here."""
    settle(args)
    if not getattr(args, "kv_events", False):
        return None
    if not args.offload_host_slots:
        raise ConfigError("--kv-events needs --offload-host-slots > 0: the offload tiers are "
                          "what it publishes")  # fmt: skip
    probe_bind("--kv-events-pub", args.kv_events_pub)
    probe_bind("--kv-events-replay", args.kv_events_replay)
    return KVEventSettings(pub_bind=args.kv_events_pub, replay_bind=args.kv_events_replay)


def _check_memory(config: WorkerConfig, model: KVModel) -> None:
    """Refuse pools this host cannot hold, before any is allocated."""
    kv = model.kv_layout(config.num_blocks, config.block_size, config.head_range)
    state = model.state_layout(config.num_slots)
    total = kv.pool_bytes + (state.pool_bytes if state is not None else 0)
    if isinstance(model, RankProducer):  # simulated TP/PP compute keeps a full shadow pool
        total += model.shadow_bytes(config.num_blocks, config.block_size, config.num_slots)
    check_pool_memory(f"--num-blocks {config.num_blocks} --num-slots {config.num_slots}", total)


def build_worker(args: argparse.Namespace, hooks: WorkerHooks | None = None) -> Worker:
    """The worker ``args`` describe; ``hooks`` (a harness's seams) go to its constructor.
    Every value is checked (``ConfigError``) before a socket opens or memory is allocated."""
    config = config_of(args)
    probe_bind("--control", config.control_bind)
    probe_bind("--pd", config.pd_bind)
    probe_port("--metrics-port", config.metrics_port)
    offload = offload_of(args) if args.role == "prefill" else None
    events = kv_events_of(args) if args.role == "prefill" else None
    metrics = MetricsRegistry()  # the worker's and its model's: one /metrics
    if args.model is not None:
        groups = args.kv_groups == "on"
        model = ModelSpec(args.model, args.seed, args.model_dtype, args.attention, groups)
        if args.role == "prefill":
            producer = _producer(args, model, metrics)
            _check_memory(config, producer)
            return PrefillWorker(
                config, producer, metrics=metrics, hooks=hooks, offload=offload, kv_events=events
            )
        decoder = ModelDecoder.from_spec(model, metrics)
        _check_memory(config, decoder)
        return DecodeWorker(config, decoder, metrics=metrics, hooks=hooks)
    if placement_of(args) != Placement():
        raise ConfigError("--tp-size/--pp-size above 1 need --model (a synthetic producer has no "
                          "ranks; give it --head-range instead)")  # fmt: skip
    spec = spec_of(args)
    if args.role == "prefill":
        synthetic = SyntheticProducer(spec)
        _check_memory(config, synthetic)
        return PrefillWorker(
            config, synthetic, metrics=metrics, hooks=hooks, offload=offload, kv_events=events
        )
    receiver = SyntheticDecoder(spec)
    _check_memory(config, receiver)
    return DecodeWorker(config, receiver, metrics=metrics, hooks=hooks)


def _announce(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def _warn_at_start(args: argparse.Namespace) -> None:
    """One line on stderr once the checks passed: insecure mode, or a secret taken from
    ``KVPLANE_SECRET`` (same-user processes could read it in ``/proc/PID/environ``)."""
    if args.insecure:
        log.warning(
            "kvplane serve %s: --insecure: no secret; any local process can send orders to "
            "this process and read or write its KV (kvplane_insecure 1 in /metrics)",
            args.role,
        )
    elif getattr(args, _SECRET, (None, False))[1]:
        log.warning(
            "kvplane serve %s: the secret came from $%s, which this user's other processes "
            "may read; prefer --secret-file FILE (mode 0600). Removed from the environment.",
            args.role, SECRET_ENV,
        )  # fmt: skip


def _run_router(args: argparse.Namespace) -> int:
    settle(args)
    secret = secret_of(args)
    for i, address in enumerate([*args.prefill, *args.decode]):
        check_connect_address("--prefill" if i < len(args.prefill) else "--decode", address)
    probe_bind("--control", args.control)
    probe_port("--metrics-port", args.metrics_port)
    router = Router(
        args.prefill, args.decode, timeout_s=args.timeout,
        deadline_s=args.request_deadline, refresh_s=args.refresh, secret=secret,
        policy=RoutePolicy.parse(args.policy),
    )  # fmt: skip
    router.metrics.gauge("insecure", INSECURE_HELP).set(0 if secret is not None else 1)
    _warn_at_start(args)
    service: RouterService | None = None
    try:
        try:  # what the probes could not foresee (a port taken since) is still one line
            service = RouterService(router, args.control, metrics_port=args.metrics_port)
            router.connect()
            service.start()
        except (OSError, zmq.ZMQError) as exc:
            raise ConfigError(f"kvplane serve router cannot start: {exc}") from None
        _announce(role="router", name="router", control=service.address, pd="",
                  incarnation=0)  # fmt: skip
        signalled = wait_for_stop(threading.Event())
    finally:
        router.close()  # first: fails what a service helper waits for, so both close at once
        if service is not None:
            service.close()
    if signalled:
        end_process(0)
    return 0


def run(args: argparse.Namespace, hooks: WorkerHooks | None = None) -> int:
    """Serve ``args.role`` until told to stop; 2 without a role. Bad values and addresses
    raise ``ConfigError`` before anything starts (``kvplane: error: ...``, exit 1). Stopped by
    SIGTERM/SIGINT, the process ends with 0 once closed (:func:`end_process`): no return."""
    role = getattr(args, "role", None)
    if role is None:
        print("usage: kvplane serve {prefill,decode,router,proxy} [flags]", file=sys.stderr)
        return 2
    if role == "router":
        return _run_router(args)
    if role == "proxy":
        return run_proxy(args)
    try:
        worker = build_worker(args, hooks)
    except (OSError, zmq.ZMQError, MemoryError) as exc:  # what the probes could not foresee
        raise ConfigError(f"kvplane serve {role} cannot start: {exc}") from None
    _warn_at_start(args)
    try:
        try:
            worker.start()
        except (OSError, zmq.ZMQError) as exc:
            raise ConfigError(f"kvplane serve {role} cannot start: {exc}") from None
        info = worker.info()
        _announce(role=role, name=info.peer_id, control=worker.address, pd=info.pd_address,
                  incarnation=info.incarnation, kv_events=info.kv_events_address,
                  kv_replay=info.kv_replay_address)  # fmt: skip
        signalled = wait_for_stop(worker.exit_requested)
    finally:
        worker.close()
    if signalled:  # closed in order: the process ends now (see serve_stop)
        end_process(0)
    return 0
