"""``PDProxy`` in front of two real vLLM OpenAI servers with ``KVPlaneConnector``: token-exact.

Two ``vllm.entrypoints.openai.api_server`` processes of the vLLM environment, started once for
the module: a prefill server (``kv_producer``, PD endpoint on a known port) and a decode server
(``kv_consumer``); the tiny random-init Llama (block size 32, head_dim 32), 128-token prefill
steps, greedy, token-id prompts, a secret in ``KVPLANE_SECRET``. The reference tokens are the
prefill server's own, asked afterwards without PD: one engine decoding from the KV it computed
itself (tokens against vLLM without the connector: tests/integrations). The decode server's
connector metrics show every decode request was a PD receive and none failed (a failed one would
be recomputed, token-exact still: the tokens alone cannot tell). ``slow``: the same at TP 2,
a second pair of servers with two ranks each (rank r to rank r over tcp), checked against the
TP 2 prefill server alone and vLLM's own ``/metrics``. Skips without ``.venv-vllm`` (fails with
``KVPLANE_REQUIRE_VLLM=1``).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvplane.apps.proxy import PDProxy, ProxyConfig
from kvplane.apps.proxy_routing import RoutingConfig
from kvplane.integrations.vllm.env import vllm_python, vllm_support
from kvplane.integrations.vllm.harness import cpu_binds
from kvplane.serving.router.route_policy import rendezvous
from kvplane.testing.cluster import wait_for
from ports_testlib import free_port, free_ports

SHAPE = {"vocab": 512, "hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 256}
SECRET = "kvplane-proxy-test-secret-0123456789"
MAX_TOKENS = 8
LENGTHS = (300, 97, 64, 33)  # several slices; 3 blocks + the recomputed token; 2 blocks; 1 + 1
START_S = 600.0
pytestmark = pytest.mark.timeout(1500)


def require_vllm() -> None:
    """Skip (saying why) without the vLLM environment; fail with ``KVPLANE_REQUIRE_VLLM=1``."""
    reason = vllm_support()
    if reason is None:
        return
    if os.environ.get("KVPLANE_REQUIRE_VLLM") == "1":
        pytest.fail(f"KVPLANE_REQUIRE_VLLM=1 but {reason}")
    pytest.skip(reason)


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    metrics: int  # the connector's scheduler-side /metrics port (0: no connector)
    events: int = 0  # the connector's kv_events_port (0: none; replays on the next port)


@dataclass
class Servers:
    prefill: Server
    decode: Server
    prefill_pd: str


def _start(
    model: Path, root: Path, name: str, role: str | None, pd_port: int, *, tp: int = 1
) -> Server:
    """Start one OpenAI server of the vLLM environment (``tp`` ranks; at TP > 1 float32, each
    rank on its own core, rank r's PD endpoint on ``pd_port + r`` and no private metrics port:
    every rank's worker would bind the same one). At TP 1 its connector publishes KV events
    (with the secret), whose publisher describes its chunk key scheme."""
    port, metrics, events = free_port(), 0, 0
    cmd = [
        str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "tiny", "--skip-tokenizer-init", "--block-size", "32",
        "--max-model-len", "1024", "--max-num-batched-tokens", "128", "--enforce-eager",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    env = {**os.environ, "KVPLANE_SECRET": SECRET, "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_LOGGING_LEVEL": "WARNING"}  # fmt: skip
    if tp > 1:
        cmd += ["--tensor-parallel-size", str(tp), "--dtype", "float32"]
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binds(tp, sorted(os.sched_getaffinity(0)))
    if role is not None:
        extra: dict[str, Any] = {"pd_transport": "tcp", "pd_bind": f"tcp://127.0.0.1:{pd_port}"}
        if tp == 1:
            metrics, events = free_port(), free_ports(2)
            extra["metrics_port"] = metrics - 1
            extra["kv_events_port"] = events
        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "KVPlaneConnector",
            "kv_connector_module_path": "kvplane.integrations.vllm.connector",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        })]  # fmt: skip
    log = root / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return Server(proc, f"http://127.0.0.1:{port}", log, metrics, events)


def _wait_healthy(server: Server, deadline: float) -> None:
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"{server.log.name} exited:\n{server.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    pytest.fail(f"{server.log.name} not healthy within {START_S:.0f} s")


def _signal(server: Server, sig: signal.Signals) -> None:
    """Send ``sig`` to the server and its engine processes (its session), if it still runs."""
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, sig)


def _stop(server: Server) -> None:
    _signal(server, signal.SIGTERM)
    try:
        server.proc.wait(30)
    except subprocess.TimeoutExpired:
        _signal(server, signal.SIGKILL)
        server.proc.wait()


def _serve_pair(root: Path, model: Path, tp: int) -> Iterator[Servers]:
    """A prefill and a decode server of ``tp`` ranks each, healthy; both stopped after."""
    pd_port = free_ports(tp)
    prefill = _start(model, root, "prefill", "kv_producer", pd_port, tp=tp)
    decode = _start(model, root, "decode", "kv_consumer", free_ports(tp), tp=tp)
    started = [prefill, decode]
    try:
        deadline = time.monotonic() + START_S
        for server in started:
            _wait_healthy(server, deadline)
        yield Servers(
            prefill, decode, ",".join(f"tcp://127.0.0.1:{pd_port + r}" for r in range(tp))
        )
    finally:
        for server in started:  # both shut down at once
            _signal(server, signal.SIGTERM)
        for server in started:
            _stop(server)


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama: Callable[[Mapping[str, int]], Path]
) -> Iterator[Servers]:
    require_vllm()
    yield from _serve_pair(tmp_path_factory.mktemp("proxy-vllm"), tiny_llama(SHAPE), 1)


def post(url: str, body: dict[str, Any]) -> bytes:
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        data: bytes = resp.read()
        return data


def tokens(url: str, prompt: list[int], stream: bool = False) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream}  # fmt: skip
    raw = post(url, body)
    if not stream:
        ids: list[int] = json.loads(raw)["choices"][0]["token_ids"]
        return ids
    out: list[int] = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[6:])
            assert "choices" in event, f"the stream says {line[:300]}"
            out += event["choices"][0]["token_ids"] or []
    return out


def engine_lines(log: Path) -> str:
    """The last 60 lines an engine (not its API server) or kvplane logged: where a dead engine
    says why."""
    lines = [ln for ln in log.read_text().splitlines() if "APIServer" not in ln]
    return "\n".join(lines[-60:])


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of counter ``name``'s samples whose labels include ``labels`` at ``url``'s
    ``/metrics`` (0 before its first increment): the connector's scheduler side's private port,
    or a vLLM server's own."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if m and labels.items() <= dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))).items():
            total += float(m.group(2))
    return total


@pytest.fixture
def proxy(servers: Servers, request: pytest.FixtureRequest) -> Iterator[PDProxy]:
    config = ProxyConfig(
        prefill=servers.prefill.url, decode=servers.decode.url,
        prefill_pd=servers.prefill_pd, mode=request.param,
    )  # fmt: skip
    p = PDProxy(config)
    p.start()
    yield p
    p.close()


def through(
    proxy: PDProxy, servers: Servers, prompts: list[list[int]], stream: bool
) -> tuple[list[list[int]], list[list[int]]]:
    """Each prompt's tokens through ``proxy``, then from the prefill server alone (no PD: one
    engine decoding from the KV it computed); a failure says what the servers logged."""
    try:
        got = [tokens(proxy.address, p, stream) for p in prompts]
    except OSError as exc:
        tails = {s.log.name: engine_lines(s.log) for s in (servers.prefill, servers.decode)}
        pytest.fail(
            f"{proxy.config.mode}: {exc!r}\n" + "\n".join(f"{k}:\n{v}" for k, v in tails.items())
        )
    return got, [tokens(servers.prefill.url, p) for p in prompts]


@pytest.mark.parametrize(
    ("proxy", "stream"),
    [  # the other two pairings only with KVPLANE_SLOW=1: each case costs a minute here
        ("pull", False),
        ("pipelined", True),
        pytest.param("pull", True, marks=pytest.mark.slow),
        pytest.param("pipelined", False, marks=pytest.mark.slow),
    ],
    indirect=["proxy"],
)
def test_tokens_through_the_proxy_equal_one_engines_and_each_decode_receives(
    servers: Servers, proxy: PDProxy, stream: bool, record_property: Any
) -> None:
    seed = (proxy.config.mode, stream).__repr__()
    rng = random.Random(seed)  # fresh prompts per case: no prefix-cache hit on the decode side
    prompts = [[rng.randrange(1, 512) for _ in range(n)] for n in LENGTHS]
    counters = [("kvplane_vllm_pd_requests_total", {"outcome": o, "role": "recv"})
                for o in ("ok", "failed")]  # fmt: skip
    private = f"http://127.0.0.1:{servers.decode.metrics}"
    before = [metric(private, name, **labels) for name, labels in counters]
    got, want = through(proxy, servers, prompts, stream)
    assert got == want
    assert all(len(t) == MAX_TOKENS for t in got)
    ok, failed = (metric(private, n, **la) - b for (n, la), b in zip(counters, before, strict=True))
    assert (ok, failed) == (len(prompts), 0), "every decode request received its KV"
    record_property("kv_received", ok)


def test_cache_aware_proxy_sends_a_prefix_to_the_engine_holding_it(
    servers: Servers, tmp_path: Path
) -> None:
    """Both servers as ``direct`` engines behind ``--policy cache-aware`` (their connectors
    offload to host and publish KV events, read with the secret). A 300-token prompt is served
    once straight on the engine a tie would *not* pick (its first chunk key's rendezvous loser);
    once its 2 chunks (128 tokens each) are in that engine's events, two prompts with its first
    256 tokens and a new suffix go through the proxy to that engine: each of its 256 cached
    tokens counted cached there (vLLM's ``prompt_tokens_cached``), no request on the other one,
    and tokens equal to the other engine's computed from scratch. A text prompt is refused in
    one line with the engines' own 400 (no tokenizer here: ``--skip-tokenizer-init``)."""
    engines = (servers.prefill, servers.decode)
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    routing = RoutingConfig(  # no key scheme flags: the engines' publishers describe it
        policy="cache-aware", kv_events=",".join(f"tcp://127.0.0.1:{s.events}" for s in engines),
        kv_events_secret_file=str(secret),
    )  # fmt: skip
    config = ProxyConfig(mode="direct", engines=",".join(s.url for s in engines), routing=routing)
    rng = random.Random("cache-aware routing")
    prompt = [rng.randrange(1, 512) for _ in range(300)]
    follow = [prompt[:256] + [rng.randrange(1, 512) for _ in range(n)] for n in (20, 45)]
    proxy = PDProxy(config, env={})
    proxy.start()
    try:
        schemes = proxy.picker.schemes
        assert schemes is not None
        wait_for(lambda: schemes.keys is not None, 60.0, "the engines' key scheme")
        assert schemes.keys is not None and schemes.scheme is not None
        assert (schemes.scheme.block_size, schemes.refused) == (32, [False, False])
        assert [schemes.worker(i) for i in (0, 1)] == [
            f"vllm-127.0.0.1-{s.events}" for s in engines
        ]  # fmt: skip
        keys = schemes.keys.keys(prompt)
        assert len(keys) == 2
        holder, other = sorted(engines, key=lambda s: rendezvous(keys[0], s.url))
        tokens(holder.url, prompt)  # served once, on the engine a tie would not pick
        wait_for(
            lambda: proxy.picker.matches(prompt).get(holder.url) is not None
            and proxy.picker.matches(prompt)[holder.url].by_tier.get("host") == 2,
            60.0, "the holder's KV events",
        )  # fmt: skip
        assert list(proxy.picker.matches(prompt)) == [holder.url]
        counters = [("vllm:prompt_tokens_cached_total", holder), ("vllm:request_success_total",
                    holder), ("vllm:request_success_total", other)]  # fmt: skip
        before = [metric(s.url, name) for name, s in counters]
        got = [tokens(proxy.address, p) for p in follow]
        after = [metric(s.url, name) for name, s in counters]
        with pytest.raises(urllib.error.HTTPError) as refused:  # no tokenizer: text refused
            post(proxy.address, {"model": "tiny", "prompt": "some text", "max_tokens": 1})
    finally:
        proxy.close()
    assert proxy.picker.picked == {holder.url: 2}
    assert refused.value.code == 400
    assert json.loads(refused.value.read())["error"]["message"] == (
        f"cache-aware routing: /tokenize: engine server {engines[0].url}: HTTP 400: Tokenizer "
        "not available when `skip_tokenizer_init=True`"
    )
    assert [a - b for a, b in zip(after, before, strict=True)] == [2 * 256, 2, 0]
    assert got == [tokens(other.url, p) for p in follow]
    assert all(len(t) == MAX_TOKENS for t in got)


TP = 2
EXTERNAL: tuple[str, dict[str, str]] = (
    "vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"},
)  # fmt: skip
LOAD_ERRORS: tuple[str, dict[str, str]] = ("vllm:kvplane_load_error_blocks_total", {})


@pytest.fixture(scope="module")
def servers_tp2(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama: Callable[[Mapping[str, int]], Path]
) -> Iterator[Servers]:
    require_vllm()
    if len(os.sched_getaffinity(0)) < TP:
        pytest.skip(f"TP {TP} servers need a core per rank")
    yield from _serve_pair(tmp_path_factory.mktemp("proxy-vllm-tp2"), tiny_llama(SHAPE), TP)


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "stream"), [("pipelined", False), ("pipelined", True),
                                              ("pull", False)])  # fmt: skip
def test_tp2_servers_through_the_proxy_equal_one_tp2_engine_and_every_rank_receives(
    servers_tp2: Servers, mode: str, stream: bool
) -> None:
    """Both servers at TP 2 (rank r to rank r over tcp); pipelined names both prefill ranks'
    endpoints (``--prefill-pd`` comma-separated). The decode server's own ``/metrics`` (its
    connector has no private port at TP 2) shows every prompt token but the last of each came
    from the connector (vLLM's ``external_kv_transfer`` source) and no rank failed a block."""
    s = servers_tp2
    rng = random.Random(f"tp2 {mode} {stream}")  # fresh prompts: no decode-side prefix hit
    prompts = [[rng.randrange(1, 512) for _ in range(n)] for n in LENGTHS]
    config = ProxyConfig(prefill=s.prefill.url, decode=s.decode.url, prefill_pd=s.prefill_pd,
                         mode=mode)  # fmt: skip
    assert len(config.prefill_pd_ranks) == TP
    before = [metric(s.decode.url, name, **labels) for name, labels in (EXTERNAL, LOAD_ERRORS)]
    proxy = PDProxy(config)
    proxy.start()
    try:
        got, want = through(proxy, s, prompts, stream)
    finally:
        proxy.close()
    assert got == want
    assert all(len(t) == MAX_TOKENS for t in got)
    external, errors = (
        metric(s.decode.url, name, **labels) - b
        for (name, labels), b in zip((EXTERNAL, LOAD_ERRORS), before, strict=True)
    )
    assert (external, errors) == (sum(n - 1 for n in LENGTHS), 0)
