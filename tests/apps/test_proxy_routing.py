"""The proxy's engine pick: round-robin, and cache-aware from real KV events.

Each engine's events come from kvplane's own ``KVEventPublisher`` (the one the vLLM connector
starts) over real zmq with CURVE (the cluster secret), read by the proxy's real subscribers;
the chunk keys are the connector's scheme (seed 0, a fixed key root, blocks of 4 tokens, 2
blocks per chunk: 8 tokens per chunk), which the publishers describe to the proxy. The HTTP
side runs against small fake vLLM servers (``Engine``: ``/tokenize`` and completions)
recording what they were sent.
"""

from __future__ import annotations

import contextlib
import json
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
from kvplane.apps.proxy_routing import (
    DEFAULT_MAX_TOKENS,
    EnginePicker,
    RoutingConfig,
    decode_tokens,
)
from kvplane.apps.proxy_schemes import chunk_keys
from kvplane.apps.proxy_upstream import Upstream
from kvplane.config import SECRET_ENV
from kvplane.errors import ConfigError
from kvplane.ids import ChunkKey
from kvplane.offload.events import TierChange
from kvplane.serving.kv_describe import KeyScheme
from kvplane.serving.kv_publisher import KVEventPublisher, KVEventSettings
from kvplane.serving.router.route_policy import rendezvous
from kvplane.testing.cluster import TEST_SECRET, wait_for
from ports_testlib import free_ports

ROOT = "00112233445566778899aabbccddeeff"
ENV = {SECRET_ENV: TEST_SECRET.decode()}
P = [100 + t for t in range(30)]  # 3 full chunks (24 tokens) + 6
SCHEME = KeyScheme(0, bytes.fromhex(ROOT), 4, 2)
KEYS = chunk_keys(SCHEME)
ANSWER = {"id": "cmpl-1", "choices": [{"index": 0, "token_ids": [7, 8, 9]}]}


def routing(events: list[KVEventPublisher], **overrides: Any) -> RoutingConfig:
    """Cache-aware over ``events``' engines: only their addresses (and ``overrides``)."""
    kv_events = ",".join(p.address for p in events)
    return RoutingConfig(policy="cache-aware", kv_events=kv_events, **overrides)


def publisher(name: str, scheme: KeyScheme | None = SCHEME) -> KVEventPublisher:
    """A started engine publisher with the cluster secret, describing ``scheme``."""
    port = free_ports(2)  # its PUB and replay ports
    settings = KVEventSettings(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    pub = KVEventPublisher(name, 1, settings, secret=TEST_SECRET, block_size=8, scheme=scheme)
    pub.start()
    return pub


@pytest.fixture
def publishers() -> Iterator[list[KVEventPublisher]]:
    """Two engines' publishers (``vllm-a``, ``vllm-b``) of :data:`SCHEME`."""
    made = [publisher("vllm-a"), publisher("vllm-b")]
    yield made
    for pub in made:
        pub.close()


def store(pub: KVEventPublisher, keys: list[ChunkKey], tier: str = "host") -> None:
    for key in keys:
        pub.record(TierChange(tier, key, True))


def engines(n: int) -> list[Upstream]:
    return [Upstream.from_url("engine", f"http://127.0.0.1:{9001 + i}", 5.0) for i in range(n)]


def test_round_robin_takes_the_engines_in_turn_and_keeps_no_queue() -> None:
    picker = EnginePicker(engines(3), RoutingConfig(), None)
    got = []
    for _ in range(4):
        with picker.pick(None) as lease:
            got.append(lease.index)
    assert got == [0, 1, 2, 0]
    assert picker.queued() == {} and picker.subscribers == []


def test_cache_aware_follows_the_events_then_load_and_frees_the_queue(
    publishers: list[KVEventPublisher],
) -> None:
    config = routing(publishers)
    ups = engines(2)
    names = [u.url for u in ups]
    keys = KEYS.keys(P)
    assert len(keys) == 3
    # the engine the prefix would go to without events (ties: the first key's rendezvous)
    fresh = max(range(2), key=lambda i: rendezvous(keys[0], names[i]))
    holder = 1 - fresh
    picker = EnginePicker(ups, config, TEST_SECRET)
    try:
        with pytest.raises(RuntimeError), picker.pick(P) as lease:  # failed: nothing expected
            assert lease.index == fresh  # nobody holds it yet
            raise RuntimeError("the engine failed the request")
        store(publishers[holder], keys)
        wait_for(lambda: names[holder] in picker.matches(P), what="the holder's events")
        match = picker.matches(P)[names[holder]]
        assert (match.any_tier, dict(match.by_tier), match.pending) == (3, {"host": 3}, 0)
        assert list(picker.matches(P)) == [names[holder]]
        long = P[:24] + list(range(1000, 1100))  # 124 tokens: 3 chunks held, 100 to compute
        with picker.pick(long) as busy:
            assert busy.index == holder
            assert picker.queued() == {names[holder]: 100}
            # 40 tokens, 24 of them held by a worker 100 tokens busy: the idle one wins
            with pytest.raises(RuntimeError), picker.pick(P + [7] * 10) as other:
                assert other.index == fresh
                assert picker.queued() == {names[holder]: 100, names[fresh]: 40}
                raise RuntimeError("failed: its chunks are not expected there after")
        assert picker.queued() == {}
        with picker.pick(P + [7] * 10) as lease:  # idle again: the prefix decides
            assert lease.index == holder
            assert picker.queued() == {names[holder]: 16}
        assert picker.picked == {names[fresh]: 2, names[holder]: 2}
        sub = picker.snapshot()["kv_events"][names[holder]]
        assert sub["feed_applied"] >= 1 and sub.get("dropped_frames", 0) == 0
    finally:
        picker.close()


def test_a_requests_decode_budget() -> None:
    assert DEFAULT_MAX_TOKENS == 16
    assert decode_tokens({"max_tokens": 7}) == 7
    assert decode_tokens({"model": "m"}) == 16  # vLLM's completions default
    assert decode_tokens({"max_completion_tokens": 5, "max_tokens": 9}) == 5  # a chat's first
    assert decode_tokens({"max_completion_tokens": None, "max_tokens": 9}) == 9
    for bad in (None, True, -1, "8", 2.5):  # the engine refuses these: the default counts
        assert decode_tokens({"max_tokens": bad}) == 16, bad


def test_cache_aware_counts_a_whole_requests_decode_until_it_ends(
    publishers: list[KVEventPublisher],
) -> None:
    """An engine's load: each request's uncached prompt tokens, plus its decode budget when the
    engine runs it whole. The decode ahead outweighs the holder's cached prefix (counting the
    prompt alone, the holder would win: (16 + 7) tokens ahead of 40 on the idle engine)."""
    ups = engines(2)
    names = [u.url for u in ups]
    picker = EnginePicker(ups, routing(publishers), TEST_SECRET)
    try:
        store(publishers[0], KEYS.keys(P))
        wait_for(lambda: names[0] in picker.matches(P), what="the holder's events")
        short = P[:24] + [5] * 7  # 31 tokens, 24 cached on engine 0: 7 to compute there
        with picker.pick(short) as prefill:  # no body (PD modes): the prompt alone
            assert prefill.index == 0 and picker.queued() == {names[0]: 7}
        assert picker.queued() == {}
        with picker.pick(short, {"model": "m", "max_tokens": 60}) as first:
            assert first.index == 0 and first.queued == 7 + 60
            with picker.pick(P + [7] * 10, {"model": "m"}) as second:  # 16 cached on engine 0
                assert second.index == 1 and second.queued == 40 + DEFAULT_MAX_TOKENS
                assert picker.queued() == {names[0]: 67, names[1]: 56}
            assert picker.queued() == {names[0]: 67}
        assert picker.queued() == {} and picker.picked == {names[0]: 2, names[1]: 1}
    finally:
        picker.close()


def test_a_picked_prompt_is_pending_on_its_engine_until_its_request_fails(
    publishers: list[KVEventPublisher],
) -> None:
    config = routing(publishers)
    picker = EnginePicker(engines(2), config, TEST_SECRET)
    try:  # no event yet: the engines' ids are known from their describe answers
        assert [picker.schemes and picker.schemes.worker(i) for i in (0, 1)] == ["vllm-a", "vllm-b"]
        keys = KEYS.keys(P)
        winner = picker.names[max(range(2), key=lambda i: rendezvous(keys[0], picker.names[i]))]
        with pytest.raises(RuntimeError), picker.pick(P):  # the request fails
            pending = picker.matches(P, now=time.monotonic())
            assert {w: (m.any_tier, m.pending) for w, m in pending.items()} == {winner: (3, 3)}
            assert picker.matches(P) == {}  # confirmed holdings only: none
            raise RuntimeError("the engine failed the request")
        assert picker.matches(P, now=time.monotonic()) == {}  # dropped at once
    finally:
        picker.close()


def test_a_removed_chunk_shortens_the_match(publishers: list[KVEventPublisher]) -> None:
    config = routing(publishers)
    keys = KEYS.keys(P)
    picker = EnginePicker(engines(2), config, TEST_SECRET)
    try:
        store(publishers[0], keys)
        url = picker.names[0]
        wait_for(lambda: url in picker.matches(P), what="stored events")
        publishers[0].record(TierChange("host", keys[1], False))
        wait_for(lambda: picker.matches(P)[url].any_tier == 1, what="the removed event")
    finally:
        picker.close()


def test_events_with_another_secret_are_never_believed(
    publishers: list[KVEventPublisher],
) -> None:
    config = routing(publishers)
    picker = EnginePicker(engines(2), config, b"another-secret-0123456789abcdef!", describe_s=0.2)
    try:
        store(publishers[0], KEYS.keys(P))
        store(publishers[1], KEYS.keys(P))
        # the good subscriber of test_cache_aware hears within ms; give these 1 s of replays
        with contextlib.suppress(AssertionError):
            wait_for(lambda: bool(picker.matches(P)), timeout_s=1.0)
        assert picker.matches(P) == {}
    finally:
        picker.close()


def test_scheme_flags_that_agree_are_taken_and_one_that_disagrees_is_refused(
    publishers: list[KVEventPublisher],
) -> None:
    agree = routing(publishers, key_root=ROOT, hash_seed=0, block_size=4, blocks_per_chunk=2)
    picker = EnginePicker(engines(2), agree, TEST_SECRET)
    try:
        assert picker.schemes is not None and picker.schemes.scheme == SCHEME
    finally:
        picker.close()
    with pytest.raises(ConfigError) as err:
        EnginePicker(engines(2), routing(publishers, block_size=8), TEST_SECRET)
    assert str(err.value) == (
        "--block-size 8 disagrees with engine http://127.0.0.1:9001, whose KV events say "
        "block_size 4"
    )


def test_engines_announcing_different_schemes_are_refused_at_start() -> None:
    made = [publisher("vllm-a"), publisher("vllm-b", KeyScheme(5, bytes.fromhex(ROOT), 4, 2))]
    try:
        with pytest.raises(ConfigError) as err:
            EnginePicker(engines(2), routing(made), TEST_SECRET)
        assert str(err.value) == (
            "engines http://127.0.0.1:9001 and http://127.0.0.1:9002 announce different chunk "
            "key schemes (hash_seed 0 vs 5)"
        )
    finally:
        for pub in made:
            pub.close()


def test_an_engine_that_tells_its_scheme_late_is_asked_again() -> None:
    made = [publisher("vllm-a", None)]  # a connector before its workers' handshake
    picker = EnginePicker(engines(1), routing(made), TEST_SECRET)
    try:
        assert picker.schemes is not None
        assert (picker.schemes.scheme, picker.schemes.worker(0)) == (None, "vllm-a")
        with picker.pick(P) as lease:  # no scheme yet: by load only, nothing expected
            assert (lease.index, lease.queued) == (0, 30)
        made[0].describe_as(SCHEME)
        wait_for(lambda: picker.schemes is not None and picker.schemes.scheme == SCHEME,
                 what="the late scheme")  # fmt: skip
        store(made[0], KEYS.keys(P))
        wait_for(lambda: picker.names[0] in picker.matches(P), what="the engine's events")
        assert picker.matches(P)[picker.names[0]].any_tier == 3
    finally:
        picker.close()
        made[0].close()


def test_an_engine_restarted_with_another_scheme_is_asked_again_and_left_out() -> None:
    first = publisher("vllm-a")
    live = [first]
    picker = EnginePicker(engines(1), routing([first]), TEST_SECRET)
    try:
        assert picker.schemes is not None and picker.schemes.refused == [False]
        live.pop().close()
        other = KeyScheme(5, bytes.fromhex(ROOT), 4, 2)
        again = KVEventPublisher("vllm-a", 2, first.settings, secret=TEST_SECRET, scheme=other)
        live.append(again)
        again.start()
        store(again, KEYS.keys(P))  # even chunks keyed alike would not be believed now
        wait_for(lambda: picker.schemes is not None and picker.schemes.refused == [True],
                 what="the restarted engine's answer")  # fmt: skip
        assert picker.schemes.scheme == SCHEME and picker.schemes.counters["refused"] == 1
        assert picker.matches(P) == {}
    finally:
        picker.close()
        for pub in live:
            pub.close()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"policy": "nearest"}, "--policy: route policy must be one of round-robin, "
         "cache-aware, got 'nearest'"),
        ({"kv_events": "tcp://127.0.0.1:5000"},
         "--kv-events: read only with --policy cache-aware"),
        ({"policy": "cache-aware", "key_root": ROOT, "block_size": 4},
         "--policy cache-aware needs --kv-events tcp://HOST:PORT[,...]"),
        ({"policy": "cache-aware", "kv_events": "tcp://127.0.0.1:65535", "key_root": ROOT,
          "block_size": 4}, "--kv-events must be tcp://HOST:PORT (PORT < 65535), got "
         "'tcp://127.0.0.1:65535'"),
        ({"policy": "cache-aware", "kv_events": "tcp://127.0.0.1:5000", "key_root": "xyz"},
         "--key-root must be lowercase hex, got 'xyz'"),
        ({"policy": "cache-aware", "kv_events": "tcp://127.0.0.1:5000", "block_size": 0},
         "--block-size must be a positive int, got 0"),
        ({"hash_seed": 3}, "--hash-seed: read only with --policy cache-aware"),
    ],
)  # fmt: skip
def test_bad_routing_configs_are_refused_naming_the_flag(
    config: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        RoutingConfig(**config)
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"prefill": "http://h:1,http://h:1"},
         "--prefill names a prefill server twice: ['http://h:1', 'http://h:1']"),
        ({"mode": "direct"}, "--mode direct takes --engines, not --prefill/--decode/--prefill-pd"),
        ({"engines": "http://h:3"}, "--engines is for --mode direct, not pull"),
        ({"mode": "pipelined", "prefill": "http://h:1,http://h:2", "prefill_pd": "tcp://h:7"},
         "--prefill-pd names 1 prefill server(s)' endpoints for 2 --prefill server(s): one "
         "group each, in order, separated by ';'"),
        ({"routing": RoutingConfig(policy="cache-aware", kv_events="tcp://h:5000,tcp://h:5002",
                                   key_root=ROOT, block_size=4)},
         "--kv-events names 2 publisher(s) for 1 prefill server(s): one each, in order"),
    ],
)  # fmt: skip
def test_bad_upstream_lists_are_refused_naming_the_flag(
    config: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        ProxyConfig(**{"prefill": "http://h:1", "decode": "http://h:2", **config})
    assert str(err.value) == message


def test_cache_aware_without_a_secret_or_with_both_is_refused_before_binding(
    publishers: list[KVEventPublisher],
) -> None:
    config = ProxyConfig(engines="http://127.0.0.1:9001,http://127.0.0.1:9002", mode="direct",
                         routing=routing(publishers))  # fmt: skip
    needs = r"^--policy cache-aware reads the engines' KV events and needs a secret \(kv_events_"
    with pytest.raises(ConfigError, match=needs):
        PDProxy(config, env={})
    both = ProxyConfig(
        engines=config.engines, mode="direct",
        routing=RoutingConfig(**{**_fields(config.routing), "kv_events_insecure": True}),
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"^kv_events_insecure with a secret: choose one$"):
        PDProxy(both, env=ENV)


def _fields(c: RoutingConfig) -> dict[str, Any]:
    return {f: getattr(c, f) for f in c.__dataclass_fields__}


# -- through HTTP ----------------------------------------------------------------------------
Reply = Callable[[str, dict[str, Any]], tuple[int, dict[str, Any]]]


@dataclass
class Fake:
    """A fake vLLM server: records each POST ``(path, body)`` and answers it by ``reply``."""

    reply: Reply
    seen: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> Fake:
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.seen.append((self.path, body))
                status, obj = fake.reply(self.path, body)
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        return self


def engine(tokens: list[int] | None, status: int = 200, extra: Any = None) -> Reply:
    """A fake engine: ``/tokenize`` answers ``tokens`` (None: ``status`` and an error, as an
    engine without a tokenizer), a completion :data:`ANSWER` (with ``kv_transfer_params``
    ``extra`` when given)."""

    def reply(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if path != "/tokenize":
            return 200, ANSWER if extra is None else {**ANSWER, "kv_transfer_params": extra}
        if tokens is None:
            return status, {"error": {"message": "no tokenizer"}}
        return 200, {"count": len(tokens), "tokens": tokens}

    return reply


def post(url: str, body: object) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def fakes() -> Iterator[Callable[..., list[Fake]]]:
    made: list[Fake] = []

    def build(*replies: Reply) -> list[Fake]:
        got = [Fake(r).start() for r in replies]
        made.extend(got)
        return got

    yield build
    for f in made:
        assert f.server is not None
        f.server.shutdown()
        f.server.server_close()


def paths(f: Fake) -> list[str]:
    return [path for path, _ in f.seen]


def test_direct_mode_routes_text_by_the_engines_tokenizer_to_the_holder(
    publishers: list[KVEventPublisher], fakes: Any
) -> None:
    a, b = fakes(engine(P), engine(P))
    config = ProxyConfig(mode="direct", engines=f"{a.url},{b.url}", routing=routing(publishers))
    keys = KEYS.keys(P)
    holder = min(range(2), key=lambda i: rendezvous(keys[0], [a.url, b.url][i]))  # not the tie's
    store(publishers[holder], keys)
    proxy = PDProxy(config, env=ENV)
    proxy.start()
    try:
        wait_for(lambda: bool(proxy.picker.matches(P)), what="the holder's events")
        body = {"model": "m", "prompt": "thirty tokens of text", "max_tokens": 4}
        assert post(proxy.address, body) == (200, ANSWER)
        tokenizer, routed = (a, b)[0], (a, b)[holder]
        assert paths(tokenizer)[0] == "/tokenize"
        assert tokenizer.seen[0][1] == {"prompt": "thirty tokens of text", "model": "m"}
        assert paths(routed)[-1] == "/v1/completions"
        assert routed.seen[-1][1] == body
        assert proxy.picker.picked == {routed.url: 1}
        # token ids: taken as they are, no /tokenize call
        n = len(a.seen) + len(b.seen)
        assert post(proxy.address, {"model": "m", "prompt": [*P, 1, 2]})[0] == 200
        assert len(a.seen) + len(b.seen) == n + 1 and paths(routed)[-1] == "/v1/completions"
    finally:
        proxy.close()


def test_direct_mode_holds_each_requests_prompt_and_decode_on_its_engine(
    publishers: list[KVEventPublisher], fakes: Any
) -> None:
    seen: list[dict[str, int]] = []
    proxy: PDProxy | None = None

    def reply(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        assert proxy is not None
        seen.append(proxy.picker.queued())  # while the engine runs the request
        return 200, ANSWER

    a, b = fakes(reply, reply)
    urls = [a.url, b.url]
    config = ProxyConfig(mode="direct", engines=",".join(urls), routing=routing(publishers))
    proxy = PDProxy(config, env=ENV)
    proxy.start()
    try:
        short = [200 + t for t in range(12)]  # one chunk: no engine holds it
        for prompt, extra, load in ((P, {"max_tokens": 20}, 30 + 20), (short, {}, 12 + 16)):
            first = KEYS.keys(prompt)[0]
            winner = urls[max(range(2), key=lambda i: rendezvous(first, urls[i]))]
            assert post(proxy.address, {"model": "m", "prompt": prompt, **extra}) == (200, ANSWER)
            assert seen[-1] == {winner: load}
            # released once the answer is relayed (the client may read it a moment before)
            wait_for(lambda: proxy is not None and proxy.picker.queued() == {}, what="release")
    finally:
        proxy.close()


@pytest.mark.parametrize(
    ("status", "want", "tried"),
    [  # 5xx: the next engine is tried, then a 502; a 4xx refusal is the client's, as it is
        (500, "502 cache-aware routing cannot tokenize the prompt: engine server {b}: HTTP 500: "
         "no tokenizer", ["/tokenize"]),
        (400, "400 cache-aware routing: /tokenize: engine server {a}: HTTP 400: no tokenizer", []),
    ],
)  # fmt: skip
def test_a_prompt_that_cannot_be_tokenized_fails_in_one_line_naming_tokenize(
    publishers: list[KVEventPublisher], fakes: Any, status: int, want: str, tried: list[str]
) -> None:
    a, b = fakes(engine(None, status), engine(None, status))
    config = ProxyConfig(mode="direct", engines=f"{a.url},{b.url}", routing=routing(publishers))
    proxy = PDProxy(config, env=ENV)
    proxy.start()
    try:
        got, body = post(proxy.address, {"model": "m", "prompt": "text"})
        assert f"{got} {body['error']['message']}" == want.format(a=a.url, b=b.url)
        assert (paths(a), paths(b)) == (["/tokenize"], tried)  # no completion sent
    finally:
        proxy.close()


def test_pd_modes_route_the_prefill_to_the_holder_and_take_decode_turns(
    publishers: list[KVEventPublisher], fakes: Any
) -> None:
    params = {"do_remote_prefill": True, "remote": "x"}
    p0, p1, d0, d1 = fakes(engine([], extra=params), engine([], extra=params), engine([]),
                           engine([]))  # fmt: skip
    pd = "tcp://127.0.0.1:7000;tcp://127.0.0.1:7100,tcp://127.0.0.1:7101"
    for mode in ("pull", "pipelined"):
        config = ProxyConfig(
            prefill=f"{p0.url},{p1.url}", decode=f"{d0.url},{d1.url}", prefill_pd=pd, mode=mode,
            routing=routing(publishers),
        )  # fmt: skip
        store(publishers[1], KEYS.keys(P))
        proxy = PDProxy(config, env=ENV)
        proxy.start()
        try:
            wait_for(lambda: p1.url in proxy.picker.matches(P), what="events")  # noqa: B023
            for _ in range(2):
                assert post(proxy.address, {"model": "m", "prompt": [*P, 5]}) == (200, ANSWER)
        finally:
            proxy.close()
        assert proxy.picker.picked == {p1.url: 2}
        assert [len(d0.seen), len(d1.seen)] == ([1, 1] if mode == "pull" else [2, 2])
    assert p0.seen == []
    pipelined = d0.seen[-1][1]["kv_transfer_params"]
    assert pipelined["kvplane_pd"] == "tcp://127.0.0.1:7100"  # the chosen server's ranks
    assert pipelined["kvplane_pd_ranks"] == ["tcp://127.0.0.1:7100", "tcp://127.0.0.1:7101"]
    assert d0.seen[0][1]["kv_transfer_params"] == params  # pull: the prefill's, unchanged
