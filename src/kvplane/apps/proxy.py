"""``PDProxy``: an OpenAI-compatible front that runs each request on vLLM servers (with
``KVPlaneConnector``): a prefill and a decode server as the PD mode needs, or one engine.

Owns the config, the flows and ``/health``: *pull*, prefill then decode with the params the
prefill returned; *pipelined*, decode first, prefill concurrently in a thread, one session id,
and whichever call fails first (before the decode answer is relayed) cancels the other, so the
client gets a one-line 502; *direct*, the client's request as is on one engine. The prefill
server (or engine) is the :class:`~kvplane.apps.proxy_routing.EnginePicker`'s pick, decode
servers take turns. Routes, bounds and relaying are :mod:`~kvplane.apps.proxy_http`'s. It
moves no KV: HTTP to the servers and, cache-aware, their connectors' KV events.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvplane.apps.proxy_http import ROUTES, Front, Handler, Limits, error_body
from kvplane.apps.proxy_requests import (
    MODES,
    ClientRequest,
    new_session_id,
    pipelined_decode_body,
    prefill_body,
    pull_decode_body,
)
from kvplane.apps.proxy_routing import EnginePicker, RoutingConfig, prompt_token_ids, split_list
from kvplane.apps.proxy_upstream import Call, Upstream, UpstreamError
from kvplane.errors import ConfigError, InvalidArgumentError
from kvplane.integrations.vllm.pd_params import SESSION_KEY, address_params, parse_params
from kvplane.validators import require_finite_positive, require_int, require_size

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """The proxy: its servers (``http://HOST:PORT``, several comma-separated): ``prefill`` and
    ``decode`` in the PD modes, ``engines`` in ``direct``; in pipelined mode each prefill
    server's PD endpoints (``tcp://HOST:PORT``, one per TP rank in rank order, comma-separated;
    the servers' groups in ``--prefill`` order separated by ``;``); where to listen, its bounds,
    and how it picks a prefill server or engine (``routing``)."""

    prefill: str = ""
    decode: str = ""
    prefill_pd: str | None = None
    mode: str = "pull"
    host: str = "127.0.0.1"
    port: int = 0
    max_concurrent: int = 64
    max_body_bytes: int = 8 << 20
    timeout_s: float = 300.0
    client_timeout_s: float = 60.0
    engines: str = ""
    routing: RoutingConfig = field(default_factory=RoutingConfig)

    @property
    def prefill_pd_groups(self) -> tuple[tuple[str, ...], ...]:
        """Each prefill server's PD endpoints, per rank (empty without ``prefill_pd``)."""
        groups = self.prefill_pd.split(";") if self.prefill_pd else []
        return tuple(tuple(g.split(",")) for g in groups)

    @property
    def prefill_pd_ranks(self) -> tuple[str, ...]:
        """The first prefill server's PD endpoints, per rank (empty without ``prefill_pd``)."""
        groups = self.prefill_pd_groups
        return groups[0] if groups else ()

    @property
    def routed(self) -> tuple[str, ...]:
        """The servers the routing policy picks among: the engines, or the prefill servers."""
        return split_list(self.engines if self.mode == "direct" else self.prefill)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"--mode must be one of {list(MODES)}, got {self.mode!r}")
        if self.mode == "direct":
            if self.prefill or self.decode or self.prefill_pd:
                raise ConfigError("--mode direct takes --engines, not --prefill/--decode/"
                                  "--prefill-pd")  # fmt: skip
            self._check_urls("engines", "engine")
        else:
            if self.engines:
                raise ConfigError(f"--engines is for --mode direct, not {self.mode}")
            self._check_urls("prefill", "prefill")
            self._check_urls("decode", "decode")
        if self.mode == "pipelined":
            self._check_pd()
        require_int("--port", self.port, min=0, max=65535, error=ConfigError)
        require_int("--max-concurrent", self.max_concurrent, min=1, error=ConfigError)
        require_size("--max-body-bytes", self.max_body_bytes, min=1, error=ConfigError)
        require_finite_positive("--timeout", self.timeout_s)
        require_finite_positive("--client-timeout", self.client_timeout_s)
        what = "engine" if self.mode == "direct" else "prefill server"
        self.routing.check_engines(len(self.routed), what)

    def _check_urls(self, field_name: str, role: str) -> None:
        flag = f"--{field_name}"
        urls = split_list(getattr(self, field_name))
        if not urls:
            raise ConfigError(f"--mode {self.mode} needs {flag} http://HOST:PORT[,...]")
        for url in urls:
            Upstream.from_url(field_name, url, self.timeout_s)
        if len(set(urls)) != len(urls):
            raise ConfigError(f"{flag} names a {role} server twice: {list(urls)}")

    def _check_pd(self) -> None:
        if self.prefill_pd is None:
            raise ConfigError("--mode pipelined needs --prefill-pd tcp://HOST:PORT")
        groups, servers = self.prefill_pd_groups, len(split_list(self.prefill))
        if len(groups) != servers:
            raise ConfigError(
                f"--prefill-pd names {len(groups)} prefill server(s)' endpoints for {servers} "
                "--prefill server(s): one group each, in order, separated by ';'"
            )
        for addresses in groups:
            probe = {"do_remote_prefill": True, SESSION_KEY: "x", **address_params(addresses)}
            try:
                parse_params(probe)  # the decode engine's own check of the addresses
            except InvalidArgumentError:
                raise ConfigError(
                    "--prefill-pd must be tcp://HOST:PORT, one per prefill TP rank in rank "
                    f"order separated by commas, got {self.prefill_pd!r:.80}"
                ) from None


class _Pair:
    """The two calls of one pipelined request, and which came first: a failure (which cancels
    every call) or the commitment to relay the decode answer (after which failures are moot)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[Call] = []
        self.failure: UpstreamError | None = None
        self._committed = False

    def add(self, call: Call) -> None:
        with self._lock:
            self._calls.append(call)
            if self.failure is not None:
                call.cancel()

    def fail(self, error: UpstreamError) -> None:
        with self._lock:
            if self._committed or self.failure is not None:
                return
            self.failure = error
            calls = list(self._calls)
        for call in calls:
            call.cancel()

    def commit(self) -> None:
        """Relay the decode answer from now on; the failure that came first, if one did."""
        with self._lock:
            if self.failure is not None:
                raise self.failure
            self._committed = True


class PDProxy:
    """See the module docstring. :meth:`start` serves in a thread; :meth:`close` stops.
    ``env``: where the KV events' secret is read (``KVPLANE_SECRET``; default
    ``os.environ``); ``ConfigError`` before anything binds for no secret and no
    ``kv_events_insecure`` under cache-aware routing."""

    def __init__(self, config: ProxyConfig, env: Mapping[str, str] | None = None) -> None:
        self.config = config
        routing = config.routing
        secret = routing.secret(os.environ if env is None else env) if routing.cache_aware else None
        t = config.timeout_s
        self.prefill = [Upstream.from_url("prefill", u, t) for u in split_list(config.prefill)]
        self.decode = [Upstream.from_url("decode", u, t) for u in split_list(config.decode)]
        self.engines = [Upstream.from_url("engine", u, t) for u in split_list(config.engines)]
        self.routed = self.engines if config.mode == "direct" else self.prefill
        self.picker = EnginePicker(self.routed, routing, secret)
        self._decoders = EnginePicker(self.decode, RoutingConfig(), None) if self.decode else None
        limits = Limits(config.max_concurrent, config.max_body_bytes, config.client_timeout_s)
        try:
            self._front = Front((config.host, config.port), self, limits)
        except BaseException:
            self.picker.close()
            raise
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """``http://HOST:PORT`` the proxy listens on (the port chosen when 0 was asked)."""
        return self._front.url

    def start(self) -> None:
        self._thread = threading.Thread(  # polls its shutdown flag every 50 ms: close is prompt
            target=self._front.serve_forever, args=(0.05,), name="kvplane-proxy", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._front.shutdown()
            self._thread.join()
        self._front.server_close()
        self.picker.close()

    def health(self) -> tuple[int, dict[str, Any]]:
        """200 when every server answers ``/health`` with 200, else 503 naming each one down."""
        down = []
        for up in (*self.routed, *self.decode):
            try:
                status, _ = up.get("/health", min(5.0, self.config.timeout_s))
            except UpstreamError as exc:
                down.append(str(exc))
                continue
            if status != 200:
                down.append(f"{up.name} server {up.url}: /health answered {status}")
        if down:
            return 503, error_body(503, "; ".join(down))
        return 200, {"status": "ok", "mode": self.config.mode, "policy": self.config.routing.policy}

    def models(self) -> tuple[int, bytes]:
        """The first decode server's (or engine's) ``/v1/models`` answer."""
        return (self.decode or self.engines)[0].get("/v1/models", self.config.timeout_s)

    # -- the flows -----------------------------------------------------------------------------
    def serve(self, h: Handler, path: str, req: ClientRequest) -> None:
        """Run ``req`` on the servers the routing picks and relay the answer to ``h``'s
        client (the decode server's, or the engine's)."""
        ids = None
        if self.picker.cache is not None:
            ids = prompt_token_ids(req, ROUTES[path], self.routed)
        whole = req.body if self._decoders is None else None  # direct: its decode counts too
        with self.picker.pick(ids, whole) as lease:
            server = self.routed[lease.index]
            if self._decoders is None:  # direct
                with Call(server, path, dict(req.body), _auth(h)) as call:
                    call.send()
                    h.relay(call, req.stream, call.response(), lambda: None)
                return
            with self._decoders.pick(None) as turn:
                decode = self.decode[turn.index]
                if self.config.mode == "pull":
                    self._pull(h, path, req, (server, decode))
                else:
                    ranks = self.config.prefill_pd_groups[lease.index]
                    self._pipelined(h, path, req, (server, decode), ranks)

    def _pull(
        self, h: Handler, path: str, req: ClientRequest, servers: tuple[Upstream, Upstream]
    ) -> None:
        prefill, decode = servers
        auth = _auth(h)
        with Call(prefill, path, prefill_body(req), auth) as first:
            first.send()
            params = first.answer().get("kv_transfer_params")
        if params is not None and not isinstance(params, dict):
            raise prefill.fail(f"kv_transfer_params is not an object: {params!r:.80}")
        with Call(decode, path, pull_decode_body(req, params), auth) as call:
            call.send()
            h.relay(call, req.stream, call.response(), lambda: None)

    def _pipelined(
        self, h: Handler, path: str, req: ClientRequest, servers: tuple[Upstream, Upstream],
        ranks: tuple[str, ...],
    ) -> None:  # fmt: skip
        prefill_server, decode_server = servers
        auth = _auth(h)
        sid, pair = new_session_id(), _Pair()
        decode = Call(decode_server, path, pipelined_decode_body(req, sid, ranks), auth)
        pair.add(decode)
        worker: threading.Thread | None = None
        try:
            decode.send()  # first: its receive opens the session before the prefill starts
            prefill = Call(prefill_server, path, prefill_body(req, sid), auth)
            pair.add(prefill)
            worker = threading.Thread(target=_prefill, args=(prefill, pair), daemon=True)
            worker.start()
            h.relay(decode, req.stream, decode.response(), pair.commit)
        except UpstreamError as exc:
            pair.fail(exc)  # a failed decode call cancels the prefill (vLLM frees its blocks)
            raise pair.failure or exc from None
        finally:
            decode.close()
            if worker is not None:
                worker.join(self.config.timeout_s)


def _auth(h: Handler) -> dict[str, str]:
    """The client's ``Authorization`` header, passed on to every upstream call."""
    return {k: v for k, v in h.headers.items() if k.lower() == "authorization"}


def _prefill(call: Call, pair: _Pair) -> None:
    """Pipelined mode's prefill call (a thread): its failure fails the pair."""
    try:
        with call:
            call.send()
            call.answer()
    except UpstreamError as exc:
        if not call.cancelled:
            log.warning("kvplane proxy: %s", exc)
        pair.fail(exc)
