"""``kvplane serve prefill|decode|router``: the PD workers and the router as processes.

Wiring only: flags to a :class:`~kvplane.serving.worker_config.WorkerConfig` and a producer,
one JSON announce line on stdout, serve until SIGTERM/SIGINT or ``Shutdown``. Binds 127.0.0.1
unless told otherwise; a secret comes from ``KVPLANE_SECRET`` only. See docs/serving.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

from kvplane.errors import ConfigError
from kvplane.offload import OffloadConfig
from kvplane.pd.timers import Timings
from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.prefix_offload import PrefixSettings
from kvplane.serving.producers.model import DTYPES, ModelDecoder, ModelProducer, ModelSpec
from kvplane.serving.producers.synthetic import SyntheticDecoder, SyntheticProducer, SyntheticSpec
from kvplane.serving.router.router import Router
from kvplane.serving.router.service import RouterService
from kvplane.serving.worker import Worker, WorkerHooks
from kvplane.serving.worker_config import LOOPBACK, WorkerConfig
from kvplane.transfer import OpGrouping

NAME = "serve"
HELP = "Run a PD prefill worker, decode worker or router as a process."


def _worker_flags(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--name", default=role, help="PD peer id (unique per deployment)")
    p.add_argument("--control", default=LOOPBACK, help="order socket address (zmq)")
    p.add_argument("--pd", default=LOOPBACK, help="PD control endpoint address (zmq)")
    p.add_argument("--transport", default="tcp", help="tcp, shm, ... (see transports)")
    p.add_argument("--transport-host", default="127.0.0.1", help="tcp transport listen host")
    p.add_argument(
        "--copy-threads", type=int, default=None,
        help="threads the tcp/shm transport copies bytes with (default: torch's thread count)",
    )  # fmt: skip
    p.add_argument("--layout", default="mla", choices=("mla", "gqa"))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--latent-dim", type=int, default=64)
    p.add_argument("--rope-dim", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sliding-window", type=int, default=None)
    p.add_argument("--state-dim", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="synthetic KV seed / model weights seed")
    p.add_argument("--model", default=None, help="tiny-llama, tiny-deepseek or an HF directory")
    p.add_argument("--model-dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--hash-seed", type=int, default=0, help="block hash seed")
    o = p.add_argument_group("prefix offload (prefill workers)")
    o.add_argument("--offload-host-slots", type=int, default=0, help="host tier chunks (0: off)")
    o.add_argument("--offload-disk", default=None, help="disk tier directory")
    o.add_argument("--offload-disk-slots", type=int, default=256)
    o.add_argument("--blocks-per-chunk", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-slots", type=int, default=64)
    p.add_argument("--head-range", default=None, help="TP KV-head range START:END")
    p.add_argument("--step-size", type=int, default=256, help="prefill step (tokens)")
    p.add_argument("--compute-us-per-token", type=float, default=0.0)
    p.add_argument("--compute-ms-per-step", type=float, default=0.0)
    p.add_argument("--slice-timeout", type=float, default=10.0, help="seconds per slice")
    p.add_argument("--layer-ops", action="store_true", help="one transfer op per layer")
    p.add_argument("--no-pipeline", action="store_true", help="send KV after prefill ends")
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--deadline", type=float, default=30.0, help="PD session deadline (s)")
    p.add_argument("--heartbeat", type=float, default=1.0, help="PD heartbeat (s)")
    p.add_argument("--lease", type=float, default=5.0, help="PD lease (s)")
    p.add_argument("--drain", type=float, default=5.0, help="PD drain bound (s)")
    p.add_argument("--in-doubt", type=float, default=1.0, help="IN_DOUBT release deadline (s)")
    p.add_argument("--retransmit", type=float, default=0.2, help="PD retransmit period (s)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="role", metavar="ROLE")
    for role in ("prefill", "decode"):
        _worker_flags(sub.add_parser(role, help=f"a {role} worker"), role)
    r = sub.add_parser("router", help="pair workers and serve Generate requests")
    r.add_argument("--control", default=LOOPBACK, help="client order socket address (zmq)")
    r.add_argument("--prefill", action="append", default=[], help="prefill order address")
    r.add_argument("--decode", action="append", default=[], help="decode order address")
    r.add_argument("--timeout", type=float, default=30.0, help="per-call timeout (s)")
    r.add_argument(
        "--request-deadline", type=float, default=120.0,
        help="a request still unanswered after this long fails (s)",
    )  # fmt: skip
    r.add_argument(
        "--refresh", type=float, default=1.0,
        help="re-learn workers this often: mark silent ones down, re-pair restarted ones (s)",
    )  # fmt: skip


def _head_range(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--head-range must be START:END, got {text!r}") from None
    return lo, hi


def spec_of(args: argparse.Namespace) -> SyntheticSpec:
    return SyntheticSpec(
        kind=args.layout, num_layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
        latent_dim=args.latent_dim, rope_dim=args.rope_dim, dtype=args.dtype,
        sliding_window=args.sliding_window, state_dim=args.state_dim, seed=args.seed,
        compute_s_per_token=args.compute_us_per_token * 1e-6,
        compute_s_per_step=args.compute_ms_per_step * 1e-3,
    )  # fmt: skip


def config_of(args: argparse.Namespace) -> WorkerConfig:
    secret = os.environ.get("KVPLANE_SECRET")
    timings = Timings(
        deadline_s=args.deadline, retransmit_s=args.retransmit, drain_s=args.drain,
        in_doubt_s=args.in_doubt, heartbeat_s=args.heartbeat, lease_s=args.lease,
    )  # fmt: skip
    return WorkerConfig(
        name=args.name, control_bind=args.control, pd_bind=args.pd, transport=args.transport,
        transport_host=args.transport_host, num_blocks=args.num_blocks,
        block_size=args.block_size, num_slots=args.num_slots,
        head_range=_head_range(args.head_range), step_size=args.step_size,
        slice_timeout_s=args.slice_timeout, timings=timings,
        secret=secret.encode() if secret else None, metrics_port=args.metrics_port,
        grouping=OpGrouping.LAYER if args.layer_ops else OpGrouping.WHOLE,
        pipelined=not args.no_pipeline, hash_seed=args.hash_seed, copy_threads=args.copy_threads,
    )  # fmt: skip


def offload_of(args: argparse.Namespace) -> PrefixSettings | None:
    """The prefill worker's prefix offload, or None (``--offload-host-slots 0``)."""
    if not args.offload_host_slots:
        return None
    disk = Path(args.offload_disk) if args.offload_disk else None
    config = OffloadConfig(
        host_slots=args.offload_host_slots, disk_path=disk, disk_slots=args.offload_disk_slots,
        disk_direct_io=False, pin_memory=False,
    )  # fmt: skip
    return PrefixSettings(config, args.blocks_per_chunk)


def build_worker(args: argparse.Namespace, hooks: WorkerHooks | None = None) -> Worker:
    """The worker ``args`` describe; ``hooks`` (a harness's seams) go to its constructor."""
    config = config_of(args)
    if args.model is not None:
        model = ModelSpec(args.model, args.seed, args.model_dtype)
        if args.role == "prefill":
            producer = ModelProducer.from_spec(model)
            return PrefillWorker(config, producer, hooks=hooks, offload=offload_of(args))
        return DecodeWorker(config, ModelDecoder.from_spec(model), hooks=hooks)
    spec = spec_of(args)
    if args.role == "prefill":
        return PrefillWorker(config, SyntheticProducer(spec), hooks=hooks, offload=offload_of(args))
    return DecodeWorker(config, SyntheticDecoder(spec), hooks=hooks)


def _wait(stop: threading.Event) -> None:
    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop.wait(0.2):
        pass


def _announce(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def run(args: argparse.Namespace, hooks: WorkerHooks | None = None) -> int:
    role = getattr(args, "role", None)
    if role is None:
        print("usage: kvplane serve {prefill,decode,router} [flags]", file=sys.stderr)
        return 2
    if role == "router":
        router = Router(
            args.prefill, args.decode, timeout_s=args.timeout,
            deadline_s=args.request_deadline, refresh_s=args.refresh,
        )  # fmt: skip
        service = RouterService(router, args.control)
        try:
            router.connect()
            service.start()
            _announce(role="router", name="router", control=service.address, pd="",
                      incarnation=0)  # fmt: skip
            _wait(threading.Event())
        finally:
            service.close()
            router.close()
        return 0
    worker = build_worker(args, hooks)
    try:
        worker.start()
        info = worker.info()
        _announce(role=role, name=info.peer_id, control=worker.address, pd=info.pd_address,
                  incarnation=info.incarnation)  # fmt: skip
        _wait(worker.exit_requested)
    finally:
        worker.close()
    return 0
