"""``kvplane serve proxy``: the PD proxy's flags, checks, announce line and life as a process.

Wiring only: the ``[proxy]`` flag group (also ``--config`` and ``KVPLANE_PROXY_*``, through
:mod:`~kvplane.apps.serve_config`) to a :class:`~kvplane.apps.proxy.ProxyConfig`, checked
before the socket opens; one JSON line on stdout (``role``, ``address``, ``mode``); serve until
SIGTERM/SIGINT. The proxy takes no secret: it moves no KV and opens no kvplane socket, only
HTTP to the two vLLM servers (whose PD endpoints authenticate each other), and binds 127.0.0.1
unless ``--host`` says otherwise (then it warns: it has no authentication of its own).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading

from kvplane.apps.proxy import PDProxy, ProxyConfig
from kvplane.apps.proxy_requests import MODES
from kvplane.apps.serve_config import sectioned, settle
from kvplane.errors import ConfigError
from kvplane.serving.ports import probe_port

log = logging.getLogger(__name__)
HELP = "an OpenAI-compatible front for a prefill and a decode vLLM server (PD)"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def proxy_flags(p: argparse.ArgumentParser) -> None:
    """Add the proxy's flags to ``p`` (the ``serve proxy`` parser)."""
    p.add_argument(
        "--config", default=None, metavar="FILE",
        help="TOML file with a [proxy] section; precedence: flag > KVPLANE_PROXY_<FIELD> > file",
    )  # fmt: skip
    g = p.add_argument_group("proxy", "the PD proxy ([proxy], KVPLANE_PROXY_*); no secret")
    g.add_argument("--prefill", default=None, help="prefill vLLM server, http://HOST:PORT")
    g.add_argument("--decode", default=None, help="decode vLLM server, http://HOST:PORT")
    g.add_argument(
        "--prefill-pd", default=None, metavar="tcp://HOST:PORT[,...]",
        help="the prefill engine's PD endpoints (its pd_bind; at TP > 1 one per rank, in rank "
        "order, comma-separated); needed by --mode pipelined",
    )  # fmt: skip
    g.add_argument(
        "--mode", default="pull", choices=MODES,
        help="pull: prefill, then decode; pipelined: decode first, KV moves per prefill step",
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
    return ProxyConfig(
        prefill=args.prefill, decode=args.decode, prefill_pd=args.prefill_pd, mode=args.mode,
        host=args.host, port=args.port, max_concurrent=args.max_concurrent,
        max_body_bytes=args.max_body_bytes, timeout_s=args.timeout,
        client_timeout_s=args.client_timeout,
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
            "reaches it can run requests on both vLLM servers",
            config.host,
        )
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        proxy.start()
        print(json.dumps({"role": "proxy", "address": proxy.address, "mode": config.mode}),
              flush=True)  # fmt: skip
        while not stop.wait(0.2):
            pass
    finally:
        proxy.close()
    return 0
