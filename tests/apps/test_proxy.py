"""``PDProxy`` against two tiny fake vLLM HTTP servers on 127.0.0.1 (test doubles of the vLLM
OpenAI API: the order of calls, the params passed, streaming relay, failures and bounds).
The real servers are in ``test_proxy_vllm.py``."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvplane.apps.proxy import PDProxy, ProxyConfig
from kvplane.cli import main
from kvplane.errors import ConfigError
from kvplane.integrations.vllm.pd_params import prompt_key

PD = "tcp://127.0.0.1:5555"
PARAMS = {"do_remote_prefill": True, "kvplane_session": "s-1", "kvplane_pd": PD, "x": [1, 2]}
ANSWER = {"id": "cmpl-1", "choices": [{"index": 0, "token_ids": [7, 8, 9]}]}
BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}


@dataclass
class Seen:
    body: dict[str, Any]
    at: float
    closed_after: float | None = None  # seconds from arrival until the proxy hung up


Behaviour = Callable[[BaseHTTPRequestHandler, Seen], None]


@dataclass
class Fake:
    """One fake vLLM server: records each POST and answers it with ``behaviour``."""

    behaviour: Behaviour
    seen: list[Seen] = field(default_factory=list)
    arrived: threading.Event = field(default_factory=threading.Event)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"


def _serve(fake: Fake) -> None:
    class H(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            send_json(self, 200, {})

        def do_POST(self) -> None:
            seen = Seen(json.loads(self.rfile.read(int(self.headers["Content-Length"]))), 0.0)
            seen.at = time.monotonic()
            fake.seen.append(seen)
            fake.arrived.set()
            fake.behaviour(self, seen)

    fake.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
    fake.server.daemon_threads = True
    # polled every 50 ms (not 0.5 s): its shutdown at the test's end waits one poll
    threading.Thread(target=fake.server.serve_forever, args=(0.05,), daemon=True).start()


def send_json(h: BaseHTTPRequestHandler, status: int, obj: object) -> None:
    data = json.dumps(obj).encode()
    h.send_response(status)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


def answer(obj: object, status: int = 200) -> Behaviour:
    return lambda h, seen: send_json(h, status, obj)


def hang_until_closed(h: BaseHTTPRequestHandler, seen: Seen) -> None:
    """Never answer; note when the proxy closes the connection (10 s at most)."""
    h.connection.settimeout(10.0)
    try:
        gone = h.connection.recv(1) == b""
    except OSError:
        gone = True
    if gone:
        seen.closed_after = time.monotonic() - seen.at


@pytest.fixture
def make() -> Iterator[Callable[..., tuple[PDProxy, Fake, Fake]]]:
    made: list[Any] = []

    def build(prefill: Behaviour, decode: Behaviour, **config: Any) -> tuple[PDProxy, Fake, Fake]:
        p, d = Fake(prefill), Fake(decode)
        _serve(p)
        _serve(d)
        proxy = PDProxy(ProxyConfig(prefill=p.url, decode=d.url, prefill_pd=PD, **config))
        proxy.start()
        made.extend([p.server, d.server, proxy])
        return proxy, p, d

    yield build
    for thing in reversed(made):
        if isinstance(thing, PDProxy):
            thing.close()
        else:
            thing.shutdown()
            thing.server_close()


def post(url: str, body: object, path: str = "/v1/completions") -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_pull_prefills_one_token_then_decodes_with_the_returned_params_unchanged(make: Any) -> None:
    proxy, p, d = make(answer({"kv_transfer_params": PARAMS}), answer(ANSWER))
    assert post(proxy.address, {**BODY, "stream_options": {"x": 1}, "min_tokens": 2}) == (
        200,
        ANSWER,
    )
    assert [s.body for s in p.seen] == [
        {**BODY, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    ]
    sent = {**BODY, "stream_options": {"x": 1}, "min_tokens": 2, "kv_transfer_params": PARAMS}
    assert [s.body for s in d.seen] == [sent]
    assert p.seen[0].at < d.seen[0].at


def test_pull_without_returned_params_decodes_the_client_request_as_is(make: Any) -> None:
    proxy, _p, d = make(answer({"id": "x"}), answer(ANSWER))
    assert post(proxy.address, BODY) == (200, ANSWER)
    assert d.seen[0].body == BODY


def test_pipelined_sends_the_decode_request_first_and_one_session_to_both(make: Any) -> None:
    order: dict[str, bool] = {}

    def prefill(h: BaseHTTPRequestHandler, seen: Seen) -> None:
        order["decode_first"] = decode.arrived.wait(5.0)
        send_json(h, 200, {"kv_transfer_params": None})

    def decode_answer(h: BaseHTTPRequestHandler, seen: Seen) -> None:
        order["prefill_came"] = pre.arrived.wait(5.0)  # the KV comes from the prefill
        send_json(h, 200, ANSWER)

    proxy, pre, decode = make(prefill, decode_answer, mode="pipelined")
    assert post(proxy.address, BODY) == (200, ANSWER)
    assert order == {"decode_first": True, "prefill_came": True}
    sid = decode.seen[0].body["kv_transfer_params"]["kvplane_session"]
    assert len(sid) == 32 and int(sid, 16) >= 0
    assert decode.seen[0].body == {
        **BODY,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "kvplane_session": sid,
            "kvplane_pd": PD,
            "num_prompt_tokens": 3,
            "prompt_key": prompt_key([1, 2, 3]),
        },
    }
    want = {"do_remote_decode": True, "kvplane_session": sid}
    assert pre.seen[0].body == {
        **BODY,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": want,
    }
    post(proxy.address, BODY)
    assert decode.seen[1].body["kv_transfer_params"]["kvplane_session"] != sid  # one per request


def test_a_stream_is_relayed_chunk_by_chunk_as_it_comes(make: Any) -> None:
    got = [threading.Event() for _ in range(3)]
    chunks = [f'data: {{"i": {i}}}\n\n'.encode() for i in range(3)]

    def stream(h: BaseHTTPRequestHandler, seen: Seen) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.end_headers()
        for chunk, event in zip(chunks, got, strict=True):
            h.wfile.write(chunk)
            h.wfile.flush()
            event.wait(5.0)  # the next chunk only once the client read this one

    for mode in ("pull", "pipelined"):
        for event in got:
            event.clear()
        proxy, _p, d = make(answer({}), stream, mode=mode)
        req = urllib.request.Request(
            proxy.address + "/v1/completions", json.dumps({**BODY, "stream": True}).encode()
        )
        with urllib.request.urlopen(req, timeout=20) as resp:
            assert resp.headers["Content-Type"] == "text/event-stream"
            for chunk, event in zip(chunks, got, strict=True):
                t0 = time.monotonic()
                assert resp.readline() + resp.readline() == chunk
                assert time.monotonic() - t0 < 4.0  # not after the 5 s wait: relayed as it came
                event.set()
            assert resp.read() == b""
        assert d.seen[0].body["stream"] is True


def test_a_failed_prefill_is_a_502_with_one_line_and_no_decode_in_pull_mode(make: Any) -> None:
    proxy, _p, d = make(answer({"error": {"message": "boom\n  at line 3"}}, 500), answer(ANSWER))
    status, body = post(proxy.address, BODY)
    assert status == 502
    assert body["error"]["message"] == f"prefill server {_p.url}: HTTP 500: boom at line 3"
    assert d.seen == []


def test_a_failed_prefill_cancels_the_waiting_decode_call_in_pipelined_mode(make: Any) -> None:
    proxy, p, d = make(answer({"message": "no"}, 503), hang_until_closed, mode="pipelined")
    t0 = time.monotonic()
    status, body = post(proxy.address, BODY)
    assert status == 502
    assert body["error"]["message"] == f"prefill server {p.url}: HTTP 503: no"
    assert time.monotonic() - t0 < 5.0
    assert d.arrived.wait(5.0)  # the fake notes the request on its own thread
    deadline = time.monotonic() + 5.0
    while d.seen[0].closed_after is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert d.seen[0].closed_after is not None and d.seen[0].closed_after < 5.0


def test_an_unreachable_prefill_server_is_a_502_naming_it(make: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    for mode in ("pull", "pipelined"):
        _proxy, _p, d = make(answer({}), hang_until_closed, mode=mode)
        proxy = PDProxy(ProxyConfig(prefill=dead, decode=d.url, prefill_pd=PD, mode=mode))
        proxy.start()
        try:
            status, body = post(proxy.address, BODY)
        finally:
            proxy.close()
        assert status == 502
        assert body["error"]["message"].startswith(f"prefill server {dead}: ")
        assert "Traceback" not in body["error"]["message"]


def test_a_failed_decode_cancels_the_prefill_call_in_pipelined_mode(make: Any) -> None:
    def fail_once_prefilling(h: BaseHTTPRequestHandler, seen: Seen) -> None:
        p.arrived.wait(5.0)
        send_json(h, 500, {"detail": "bad"})

    proxy, p, _d = make(hang_until_closed, fail_once_prefilling, mode="pipelined")
    status, body = post(proxy.address, BODY)
    assert (status, body["error"]["message"]) == (502, f"decode server {_d.url}: HTTP 500: bad")
    deadline = time.monotonic() + 5.0
    while p.seen[0].closed_after is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.seen[0].closed_after is not None and p.seen[0].closed_after < 5.0


def test_a_refused_request_keeps_its_4xx_status(make: Any) -> None:
    proxy, _p, d = make(answer({"kv_transfer_params": PARAMS}), answer({"error": "too long"}, 400))
    status, body = post(proxy.address, BODY)
    assert (status, body["error"]["message"]) == (400, f"decode server {d.url}: HTTP 400: too long")


def test_requests_over_the_concurrency_cap_get_503(make: Any) -> None:
    release = threading.Event()

    def slow(h: BaseHTTPRequestHandler, seen: Seen) -> None:
        release.wait(10.0)
        send_json(h, 200, ANSWER)

    proxy, _p, d = make(answer({}), slow, max_concurrent=2)
    results: list[tuple[int, dict[str, Any]]] = []
    first = [threading.Thread(target=lambda: results.append(post(proxy.address, BODY)))
             for _ in range(2)]  # fmt: skip
    for t in first:
        t.start()
    deadline = time.monotonic() + 5.0
    while len(d.seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    status, body = post(proxy.address, BODY)
    assert (status, body["error"]["message"]) == (503, "busy: 2 requests in flight")
    release.set()
    for t in first:
        t.join(10.0)
    assert results == [(200, ANSWER), (200, ANSWER)]
    assert post(proxy.address, BODY) == (200, ANSWER)  # the slots came back


@pytest.mark.parametrize(
    ("raw", "status", "message"),
    [
        (b"{", 400, "the request body is not JSON"),
        (b"[1]", 400, "the request body must be a JSON object"),
        (json.dumps({**BODY, "prompt": [[1], [2]]}).encode(), 400,
         "one prompt per request: the proxy picks the engines per prompt"),
        (json.dumps({**BODY, "kv_transfer_params": {}}).encode(), 400,
         "'kv_transfer_params' is set by the proxy, not by clients"),
        (b" " * 101, 413, "the body is over 100 bytes"),
    ],
)  # fmt: skip
def test_bad_requests_are_refused_before_any_upstream_call(
    make: Any, raw: bytes, status: int, message: str
) -> None:
    proxy, p, d = make(answer({}), answer(ANSWER), max_body_bytes=100)
    assert post(proxy.address, raw) == (status, {"error": {"message": message, "code": status}})
    assert p.seen == [] and d.seen == []


def test_unknown_routes_are_404_and_chat_is_served(make: Any) -> None:
    proxy, p, d = make(answer({}), answer(ANSWER))
    assert post(proxy.address, BODY, "/v1/embeddings")[0] == 404
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert post(proxy.address, chat, "/v1/chat/completions") == (200, ANSWER)
    assert p.seen[0].body["max_tokens"] == 1 and d.seen[0].body == chat


def test_health_names_the_server_that_is_down(make: Any) -> None:
    proxy, _p, d = make(answer({}), answer({}))
    with urllib.request.urlopen(proxy.address + "/health", timeout=10) as resp:
        assert json.loads(resp.read()) == {"status": "ok", "mode": "pull", "policy": "round-robin"}
    assert d.server is not None
    d.server.shutdown()
    d.server.server_close()
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(proxy.address + "/health", timeout=10)
    assert err.value.code == 503
    assert json.loads(err.value.read())["error"]["message"].startswith(f"decode server {d.url}: ")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"mode": "pipelined", "prefill_pd": None},
         "--mode pipelined needs --prefill-pd tcp://HOST:PORT"),
        ({"mode": "pipelined", "prefill_pd": "zmq://x:1"},
         "--prefill-pd must be tcp://HOST:PORT, one per prefill TP rank in rank order separated "
         "by commas, got 'zmq://x:1'"),
        ({"mode": "pipelined", "prefill_pd": "tcp://x:1,"},
         "--prefill-pd must be tcp://HOST:PORT, one per prefill TP rank in rank order separated "
         "by commas, got 'tcp://x:1,'"),
        ({"mode": "push"}, "--mode must be one of ['pull', 'pipelined', 'direct'], got 'push'"),
        ({"decode": "https://x:1"}, "--decode must be http://HOST:PORT, got 'https://x:1'"),
        ({"max_concurrent": 0}, "--max-concurrent must be a positive int, got 0"),
    ],
)  # fmt: skip
def test_bad_configs_are_refused_naming_the_flag(config: dict[str, Any], message: str) -> None:
    base = {"prefill": "http://127.0.0.1:1", "decode": "http://127.0.0.1:2", "prefill_pd": PD}
    with pytest.raises(ConfigError) as err:
        ProxyConfig(**{**base, **config})
    assert str(err.value) == message


def test_serve_proxy_runs_as_a_process_and_stops_on_sigterm(
    make: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    _proxy, p, d = make(answer({}), answer(ANSWER))
    cmd = [sys.executable, "-m", "kvplane", "serve", "proxy", "--prefill", p.url,
           "--decode", d.url, "--port", "0"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        announce = json.loads(proc.stdout.readline())
        assert announce["role"] == "proxy" and announce["mode"] == "pull"
        assert post(announce["address"], BODY) == (200, ANSWER)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert main([*cmd[3:-2], "--mode", "pipelined"]) == 1  # the same command, in this process
    err = "kvplane: error: --mode pipelined needs --prefill-pd tcp://HOST:PORT\n"
    assert capsys.readouterr().err == err


def test_connections_past_the_cap_are_closed_at_once(make: Any) -> None:
    proxy, _p, _d = make(answer({}), answer(ANSWER), max_concurrent=1)  # 2 * 1 + 8 connections
    port = int(proxy.address.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]
    try:
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port)) as extra:
            extra.settimeout(5.0)
            assert extra.recv(1) == b""  # closed without an answer
    finally:
        for s in idle:
            s.close()
    time.sleep(0.2)
    assert post(proxy.address, BODY) == (200, ANSWER)  # the slots came back


def test_a_config_names_each_prefill_rank_in_order() -> None:
    base: dict[str, Any] = {
        "prefill": "http://127.0.0.1:1", "decode": "http://127.0.0.1:2", "mode": "pipelined",
    }  # fmt: skip
    two = ProxyConfig(**base, prefill_pd="tcp://127.0.0.1:7000,tcp://127.0.0.1:7001")
    assert two.prefill_pd_ranks == ("tcp://127.0.0.1:7000", "tcp://127.0.0.1:7001")
    assert ProxyConfig(**base, prefill_pd=PD).prefill_pd_ranks == (PD,)
