"""``kvplane serve proxy``: the vLLM proxy's flags, checks, announce line and life as a process.

Wiring only: the ``[proxy]`` flag group (also ``--config`` and ``KVPLANE_PROXY_*``, through
:mod:`~kvplane.apps.serve_config`) to a :class:`~kvplane.apps.proxy.ProxyConfig` and its
:class:`~kvplane.apps.proxy_routing.RoutingConfig`, checked before the socket opens; one JSON
line on stdout (``role``, ``address``, ``mode``, ``policy``); serve until SIGTERM/SIGINT. The
proxy moves no KV and accepts no kvplane socket: HTTP to the vLLM servers (whose PD endpoints
authenticate each other) and, cache-aware, a subscription to their KV events (CURVE with the
cluster secret unless ``--kv-events-insecure``). It binds 127.0.0.1 unless ``--host`` says
otherwise (then it warns: it has no authentication of its own).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading

from kvplane.apps.proxy import PDProxy, ProxyConfig
from kvplane.apps.proxy_requests import MODES
from kvplane.apps.proxy_routing import RoutingConfig
from kvplane.apps.serve_config import sectioned, settle
from kvplane.config import SECRET_ENV
from kvplane.errors import ConfigError
from kvplane.serving.ports import probe_port
from kvplane.serving.router.route_policy import RoutePolicy

log = logging.getLogger(__name__)
HELP = "an OpenAI-compatible front for vLLM servers: PD pairs or engines, routed"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def proxy_flags(p: argparse.ArgumentParser) -> None:
    """Add the proxy's flags to ``p`` (the ``serve proxy`` parser)."""
    p.add_argument(
        "--config", default=None, metavar="FILE",
        help="TOML file with a [proxy] section; precedence: flag > KVPLANE_PROXY_<FIELD> > file",
    )  # fmt: skip
    g = p.add_argument_group("proxy", "the vLLM proxy ([proxy], KVPLANE_PROXY_*)")
    g.add_argument("--prefill", default=None, help="prefill vLLM servers, http://HOST:PORT[,...]")
    g.add_argument("--decode", default=None, help="decode vLLM servers, http://HOST:PORT[,...]")
    g.add_argument(
        "--engines", default=None, metavar="http://HOST:PORT[,...]",
        help="--mode direct's vLLM servers (each runs whole requests)",
    )  # fmt: skip
    g.add_argument(
        "--prefill-pd", default=None, metavar="tcp://HOST:PORT[,...][;...]",
        help="the prefill engines' PD endpoints (each one's pd_bind; at TP > 1 one per rank, in "
        "rank order, comma-separated; the servers' groups in --prefill order, ';'-separated); "
        "needed by --mode pipelined",
    )  # fmt: skip
    g.add_argument(
        "--mode", default="pull", choices=MODES,
        help="pull: prefill, then decode; pipelined: decode first, KV moves per prefill step; "
        "direct: no PD, each request on one of --engines",
    )  # fmt: skip
    g.add_argument(
        "--policy", default=RoutePolicy.ROUND_ROBIN.value, choices=[p.value for p in RoutePolicy],
        help="which prefill server (direct: engine) runs a request: round-robin, or cache-aware "
        "(the longest cached prefix by the engines' KV events, against their load)",
    )  # fmt: skip
    g.add_argument(
        "--kv-events", default=None, metavar="tcp://HOST:PORT[,...]",
        help="cache-aware: each routed engine's kv_events_port, in their order (replays: +1)",
    )  # fmt: skip
    g.add_argument(
        "--kv-events-secret-file", default=None, metavar="FILE",
        help=f"cache-aware: the events' cluster secret (else ${SECRET_ENV})",
    )  # fmt: skip
    g.add_argument(
        "--kv-events-insecure", action="store_true",
        help="cache-aware: read the KV events without a secret (plain zmq)",
    )  # fmt: skip
    g.add_argument(
        "--key-root", default=None, metavar="HEX",
        help="cache-aware: optional; must agree with the key root the engines' KV events describe",
    )  # fmt: skip
    for flag, what in (("--hash-seed", "hash_seed"), ("--block-size", "vLLM block size"),
                       ("--blocks-per-chunk", "blocks per chunk")):  # fmt: skip
        g.add_argument(
            flag, type=int, default=None,
            help=f"cache-aware: optional; must agree with the engines' {what}",
        )  # fmt: skip
    g.add_argument("--host", default="127.0.0.1", help="listen host (no authentication!)")
    g.add_argument("--port", type=int, default=8000, help="listen port (0: any free one)")
    g.add_argument(
        "--max-concurrent", type=int, default=64, help="requests in flight (more: 503)"
    )  # fmt: skip
    g.add_argument("--max-body-bytes", type=int, default=8 << 20, help="request cap (413)")
    g.add_argument("--timeout", type=float, default=300.0, help="upstream socket timeout (s)")
    g.add_argument("--client-timeout", type=float, default=60.0, help="client socket timeout")
    sectioned(p)


def config_of(args: argparse.Namespace) -> ProxyConfig:
    """The proxy ``args`` describe (flag > environment > ``--config`` file > default);
    ``ConfigError`` for a bad value."""
    settle(args)
    routing = RoutingConfig(
        policy=args.policy, kv_events=args.kv_events,
        kv_events_secret_file=args.kv_events_secret_file,
        kv_events_insecure=args.kv_events_insecure, key_root=args.key_root,
        hash_seed=args.hash_seed, block_size=args.block_size,
        blocks_per_chunk=args.blocks_per_chunk,
    )  # fmt: skip
    return ProxyConfig(
        prefill=args.prefill or "", decode=args.decode or "", prefill_pd=args.prefill_pd,
        mode=args.mode, host=args.host, port=args.port, max_concurrent=args.max_concurrent,
        max_body_bytes=args.max_body_bytes, timeout_s=args.timeout,
        client_timeout_s=args.client_timeout, engines=args.engines or "", routing=routing,
    )  # fmt: skip


def run_proxy(args: argparse.Namespace) -> int:
    """Serve the proxy until SIGTERM/SIGINT; ``ConfigError`` before start for bad flags or a
    port that cannot be bound."""
    config = config_of(args)
    probe_port("--port", config.port, config.host)
    try:
        proxy = PDProxy(config)
    except OSError as exc:  # what the probe could not foresee (the port taken since)
        raise ConfigError(f"kvplane serve proxy cannot start: {exc}") from None
    if config.host not in _LOOPBACK:
        log.warning(
            "kvplane serve proxy: listening on %s: the proxy has no authentication; anyone who "
            "reaches it can run requests on every vLLM server behind it",
            config.host,
        )
    if config.routing.cache_aware and config.routing.kv_events_insecure:
        log.warning(
            "kvplane serve proxy: --kv-events-insecure: KV events are read without a secret; "
            "anyone who can publish on those ports can steer the routing"
        )
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        proxy.start()
        announce = {"role": "proxy", "address": proxy.address, "mode": config.mode,
                    "policy": config.routing.policy}  # fmt: skip
        print(json.dumps(announce), flush=True)
        while not stop.wait(0.2):
            pass
    finally:
        proxy.close()
    return 0
