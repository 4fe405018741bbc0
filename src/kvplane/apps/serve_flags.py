"""``kvplane serve``'s flags: one subparser per role, its argument groups and their defaults.

Owns the command line only: each group titled with a config section
(:data:`~kvplane.apps.serve_config.SECTIONS`) is also read from ``--config`` and ``KVPLANE_*``
(:func:`~kvplane.apps.serve_config.sectioned`); turning the values into configs and checking
them is :mod:`~kvplane.apps.serve`'s. The proxy role's flags are
:mod:`~kvplane.apps.proxy_command`'s. See docs/serving.md.
"""

from __future__ import annotations

import argparse

from kvplane.apps.generate import add_attention_flag
from kvplane.apps.proxy_command import HELP as PROXY_HELP
from kvplane.apps.proxy_command import proxy_flags
from kvplane.apps.serve_config import sectioned
from kvplane.config import SECRET_ENV
from kvplane.offload.tiers.shared_server import REMOTE_MODES
from kvplane.pd.timers import DEFAULT_TIMINGS
from kvplane.serving.prefix_waits import PENDING_WAIT_S
from kvplane.serving.producers.model import DTYPES
from kvplane.serving.router.route_policy import RoutePolicy
from kvplane.serving.worker_config import LOOPBACK
from kvplane.transports.bounds import FIRST_BYTE_TIMEOUT_S

DISK_SLOT_FILE = "kvplane-chunks.disk"
"""The disk tier's slot file, inside the ``--offload-disk`` directory."""


def _config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", default=None, metavar="FILE",
        help="TOML file of [section] keys; precedence: flag > KVPLANE_<SECTION>_<FIELD> > file",
    )  # fmt: skip
    s = p.add_argument_group("security (flags only)")
    s.add_argument(
        "--secret-file", default=None, metavar="FILE",
        help=f"file holding the shared secret (else ${SECRET_ENV}; never on the command line)",
    )  # fmt: skip
    s.add_argument(
        "--insecure", action="store_true",
        help="run without a secret: any local process can send orders and read or write KV",
    )  # fmt: skip


def _worker_flags(p: argparse.ArgumentParser, role: str) -> None:
    _config_flags(p)
    w = p.add_argument_group("worker", "the process ([worker], KVPLANE_WORKER_*)")
    w.add_argument("--name", default=role, help="PD peer id (unique per deployment)")
    w.add_argument("--control", default=LOOPBACK, help="order socket address (zmq)")
    w.add_argument("--pd", default=LOOPBACK, help="PD control endpoint address (zmq)")
    w.add_argument("--transport", default="tcp", help="tcp, shm, ... (see transports)")
    w.add_argument("--transport-host", default="127.0.0.1", help="tcp transport listen host")
    w.add_argument(
        "--copy-threads", type=int, default=None,
        help="threads the tcp/shm transport copies bytes with (default: torch's thread count)",
    )  # fmt: skip
    w.add_argument(
        "--first-byte-timeout", type=float, default=FIRST_BYTE_TIMEOUT_S,
        help="drop a tcp/shm data-plane connection that sends nothing this long once accepted (s)",
    )  # fmt: skip
    w.add_argument("--num-slots", type=int, default=64)
    w.add_argument("--head-range", default=None, help="TP KV-head range START:END")
    w.add_argument("--step-size", type=int, default=256, help="prefill step (tokens)")
    w.add_argument("--slice-timeout", type=float, default=10.0, help="seconds per slice")
    w.add_argument("--layer-ops", action="store_true", help="one transfer op per layer")
    w.add_argument("--no-pipeline", action="store_true", help="send KV after prefill ends")
    w.add_argument(
        "--pipelining", choices=("on", "off", "auto"), default="auto",
        help="slices sent as computed, KV after prefill, or (default) per request from the "
        "simulator's calibrated cost model",
    )  # fmt: skip
    w.add_argument("--metrics-port", type=int, default=0, help="serve /metrics here (0: off)")
    if role == "prefill":
        w.add_argument("--tp-rank", type=int, default=0, help="this rank's TP rank (--model)")
        w.add_argument("--tp-size", type=int, default=1, help="TP ranks of the prefill layout")
        w.add_argument("--pp-stage", type=int, default=0, help="this rank's pipeline stage")
        w.add_argument("--pp-size", type=int, default=1, help="pipeline stages of the prefill")
    m = p.add_argument_group("model", "a real model ([model], KVPLANE_MODEL_*)")
    m.add_argument("--model", default=None, help="tiny-llama, tiny-deepseek or an HF directory")
    m.add_argument("--model-dtype", default="float32", choices=sorted(DTYPES))
    add_attention_flag(m)
    m.add_argument(
        "--kv-groups", choices=("on", "off"), default="on",  # ModelSpec's default
        help="a model mixing windows: one paged pool per KV cache group, or one of all layers",
    )  # fmt: skip
    m.add_argument("--seed", type=int, default=0, help="synthetic KV seed / model weights seed")
    y = p.add_argument_group("synthetic", "the synthetic producer ([synthetic], ...)")
    y.add_argument("--layout", default="mla", choices=("mla", "gqa"))
    y.add_argument("--layers", type=int, default=2)
    y.add_argument("--kv-heads", type=int, default=4)
    y.add_argument("--head-dim", type=int, default=32)
    y.add_argument("--latent-dim", type=int, default=64)
    y.add_argument("--rope-dim", type=int, default=16)
    y.add_argument("--dtype", default="bfloat16")
    y.add_argument("--sliding-window", type=int, default=None)
    y.add_argument("--state-dim", type=int, default=0)
    y.add_argument("--compute-us-per-token", type=float, default=0.0)
    y.add_argument("--compute-ms-per-step", type=float, default=0.0)
    h = p.add_argument_group("hash", "block hashing ([hash], KVPLANE_HASH_*)")
    h.add_argument("--hash-seed", type=int, default=0, help="block hash seed")
    o = p.add_argument_group("offload", "prefix offload of prefill workers ([offload], ...)")
    o.add_argument("--offload-host-slots", type=int, default=0, help="host tier chunks (0: off)")
    o.add_argument(
        "--offload-disk", default=None, metavar="DIR",
        help=f"disk tier directory (created; its slot file is DIR/{DISK_SLOT_FILE})",
    )  # fmt: skip
    o.add_argument("--offload-disk-slots", type=int, default=256)
    o.add_argument("--offload-remote-url", default="", help="Redis tier redis:// URL ('': off)")
    o.add_argument(
        "--offload-remote-mode", default="private", choices=REMOTE_MODES,
        help="private: one worker's leased namespace; shared: one store for many workers",
    )  # fmt: skip
    o.add_argument("--offload-remote-namespace", default="kvplane", help="Redis key namespace")
    o.add_argument("--offload-remote-slots", type=int, default=256)
    o.add_argument("--offload-remote-replicas", default="", help="shared: more URLs, comma-sep.")
    for tier in ("disk", "remote"):
        o.add_argument(
            f"--offload-{tier}-codec", default="raw", metavar="CODEC",
            help=f"{tier} tier codec: raw, lossless lz4/zstd, lossy fp8/fp8-chunk/int8, or auto",
        )  # fmt: skip
    o.add_argument(
        "--offload-pending-wait", type=float, default=PENDING_WAIT_S, metavar="S",
        help="longest a request waits for this worker's own in-flight store of its prefix "
        "before computing it (0: never waits)",
    )  # fmt: skip
    if role == "prefill":
        _kv_event_flags(p)
    c = p.add_argument_group("chunk", "offload chunks ([chunk], KVPLANE_CHUNK_*)")
    c.add_argument("--blocks-per-chunk", type=int, default=2)
    b = p.add_argument_group("pool", "the KV pool ([pool], KVPLANE_POOL_*)")
    b.add_argument("--num-blocks", type=int, default=512)
    b.add_argument("--block-size", type=int, default=16)
    t = p.add_argument_group("pd", "PD protocol timings, seconds ([pd], KVPLANE_PD_*)")
    d = DEFAULT_TIMINGS
    for flag, default, what in (
        ("--deadline", d.deadline_s, "PD session deadline"),
        ("--heartbeat", d.heartbeat_s, "PD heartbeat"),
        ("--lease", d.lease_s, "PD lease"),
        ("--drain", d.drain_s, "PD drain bound"),
        ("--in-doubt", d.in_doubt_s, "IN_DOUBT release deadline"),
        ("--retransmit", d.retransmit_s, "PD retransmit period"),
    ):
        t.add_argument(flag, type=float, default=default, help=f"{what} (s)")
    sectioned(p)


def _kv_event_flags(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("kv_events", "KV events of the offload tiers ([kv_events], ...)")
    e.add_argument(
        "--kv-events", action="store_true",
        help="publish the offload tiers' chunk changes (needs --offload-host-slots; CURVE with "
        "the secret, plain only under --insecure); the router subscribes by itself",
    )  # fmt: skip
    e.add_argument("--kv-events-pub", default=LOOPBACK, help="events PUB socket address (zmq)")
    e.add_argument(
        "--kv-events-replay", default=LOOPBACK, help="replay ROUTER socket address (zmq)"
    )  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="role", metavar="ROLE")
    for role in ("prefill", "decode"):
        _worker_flags(sub.add_parser(role, help=f"a {role} worker"), role)
    rp = sub.add_parser("router", help="pair workers and serve Generate requests")
    _config_flags(rp)
    r = rp.add_argument_group("router", "the router ([router], KVPLANE_ROUTER_*)")
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
    r.add_argument("--metrics-port", type=int, default=0, help="serve /metrics here (0: off)")
    r.add_argument(
        "--policy", default=RoutePolicy.ROUND_ROBIN.value, choices=[p.value for p in RoutePolicy],
        help="prefill pick: round-robin, or cache-aware (least predicted TTFT from KV events)",
    )  # fmt: skip
    sectioned(rp)
    proxy_flags(sub.add_parser("proxy", help=PROXY_HELP))
