"""``PDProxy``: an OpenAI-compatible front that runs each request on a prefill and a decode
vLLM server (both with ``KVPlaneConnector``), in the order the PD mode needs.

Owns the config, the two flows and ``/health``: *pull*, prefill then decode with the params the
prefill returned; *pipelined*, decode first, prefill concurrently in a thread, one session id,
and whichever call fails first (before the decode answer is relayed) cancels the other, so the
client gets a one-line 502. Routes, request bounds and relaying are the HTTP front's
(:mod:`~kvplane.apps.proxy_http`). It moves no KV and holds no secret: HTTP to two servers only.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from kvplane.apps.proxy_http import Front, Handler, Limits, error_body
from kvplane.apps.proxy_requests import (
    MODES,
    ClientRequest,
    new_session_id,
    pipelined_decode_body,
    prefill_body,
    pull_decode_body,
)
from kvplane.apps.proxy_upstream import Call, Upstream, UpstreamError
from kvplane.errors import ConfigError, InvalidArgumentError
from kvplane.integrations.vllm.pd_params import SESSION_KEY, address_params, parse_params
from kvplane.validators import require_finite_positive, require_int, require_size

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """The proxy: the two servers (``http://HOST:PORT``), the prefill engine's PD endpoints
    (``tcp://HOST:PORT``, one per TP rank in rank order, comma-separated; pipelined mode
    only), where to listen, and its bounds."""

    prefill: str
    decode: str
    prefill_pd: str | None = None
    mode: str = "pull"
    host: str = "127.0.0.1"
    port: int = 0
    max_concurrent: int = 64
    max_body_bytes: int = 8 << 20
    timeout_s: float = 300.0
    client_timeout_s: float = 60.0

    @property
    def prefill_pd_ranks(self) -> tuple[str, ...]:
        """``prefill_pd`` split into its per-rank addresses (empty without one)."""
        return tuple(self.prefill_pd.split(",")) if self.prefill_pd else ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"--mode must be one of {list(MODES)}, got {self.mode!r}")
        if self.mode == "pipelined":
            if self.prefill_pd is None:
                raise ConfigError("--mode pipelined needs --prefill-pd tcp://HOST:PORT")
            addresses = self.prefill_pd_ranks
            probe = {"do_remote_prefill": True, SESSION_KEY: "x", **address_params(addresses)}
            try:
                parse_params(probe)  # the decode engine's own check of the addresses
            except InvalidArgumentError:
                raise ConfigError(
                    "--prefill-pd must be tcp://HOST:PORT, one per prefill TP rank in rank "
                    f"order separated by commas, got {self.prefill_pd!r:.80}"
                ) from None
        require_int("--port", self.port, min=0, max=65535, error=ConfigError)
        require_int("--max-concurrent", self.max_concurrent, min=1, error=ConfigError)
        require_size("--max-body-bytes", self.max_body_bytes, min=1, error=ConfigError)
        require_finite_positive("--timeout", self.timeout_s)
        require_finite_positive("--client-timeout", self.client_timeout_s)
        Upstream.from_url("prefill", self.prefill, self.timeout_s)
        Upstream.from_url("decode", self.decode, self.timeout_s)


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
    """See the module docstring. :meth:`start` serves in a thread; :meth:`close` stops."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefill = Upstream.from_url("prefill", config.prefill, config.timeout_s)
        self.decode = Upstream.from_url("decode", config.decode, config.timeout_s)
        limits = Limits(config.max_concurrent, config.max_body_bytes, config.client_timeout_s)
        self._front = Front((config.host, config.port), self, limits)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """``http://HOST:PORT`` the proxy listens on (the port chosen when 0 was asked)."""
        return self._front.url

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._front.serve_forever, name="kvplane-proxy", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._front.shutdown()
            self._thread.join()
        self._front.server_close()

    def health(self) -> tuple[int, dict[str, Any]]:
        """200 when both servers answer ``/health`` with 200, else 503 naming each one down."""
        down = []
        for up in (self.prefill, self.decode):
            try:
                status, _ = up.get("/health", min(5.0, self.config.timeout_s))
            except UpstreamError as exc:
                down.append(str(exc))
                continue
            if status != 200:
                down.append(f"{up.name} server {up.url}: /health answered {status}")
        if down:
            return 503, error_body(503, "; ".join(down))
        return 200, {"status": "ok", "mode": self.config.mode}

    def models(self) -> tuple[int, bytes]:
        """The decode server's ``/v1/models`` answer."""
        return self.decode.get("/v1/models", self.config.timeout_s)

    # -- the flows -----------------------------------------------------------------------------
    def serve(self, h: Handler, path: str, req: ClientRequest) -> None:
        """Run ``req`` on both servers and relay the decode answer to ``h``'s client."""
        auth = {k: v for k, v in h.headers.items() if k.lower() == "authorization"}
        if self.config.mode == "pull":
            with Call(self.prefill, path, prefill_body(req), auth) as first:
                first.send()
                params = first.answer().get("kv_transfer_params")
            if params is not None and not isinstance(params, dict):
                raise self.prefill.fail(f"kv_transfer_params is not an object: {params!r:.80}")
            with Call(self.decode, path, pull_decode_body(req, params), auth) as call:
                call.send()
                h.relay(call, req.stream, call.response(), lambda: None)
            return
        sid, pair = new_session_id(), _Pair()
        body = pipelined_decode_body(req, sid, self.config.prefill_pd_ranks)
        decode = Call(self.decode, path, body, auth)
        pair.add(decode)
        worker: threading.Thread | None = None
        try:
            decode.send()  # first: its receive opens the session before the prefill starts
            prefill = Call(self.prefill, path, prefill_body(req, sid), auth)
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
