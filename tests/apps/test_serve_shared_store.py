"""``kvplane serve prefill --offload-remote-mode shared``: two real prefill workers of a tiny
Llama share one Redis namespace; a prompt worker A computed is a remote hit on worker B,
started before A published it, with equal tokens; the flags become the offload config."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from functools import partial

import redis

from kvplane.apps.serve import offload_of
from kvplane.cli import build_parser
from kvplane.serving.router.router import Router
from kvplane.testing.cluster import TEST_SECRET, Proc, free_port, wait_for

PROMPT = list(range(5, 75))  # 70 tokens: 4 full chunks of one 16-token block
NEW = 4


def _flags(url: str, ns: str) -> list[str]:
    return ["--offload-host-slots", "8", "--blocks-per-chunk", "1", "--offload-remote-url", url,
            "--offload-remote-mode", "shared", "--offload-remote-namespace", ns,
            "--offload-remote-slots", "16"]  # fmt: skip


def _worker(name: str, *extra: str) -> list[str]:
    return ["--name", name, "--model", "tiny-llama", "--num-blocks", "32", "--num-slots", "4",
            "--step-size", "16", *extra]  # fmt: skip


def _remote_hits(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    want = 'kvplane_offload_chunk_hits_total{tier="remote"} '
    line = next((x for x in text.splitlines() if x.startswith(want)), want + "0")
    return float(line.removeprefix(want))


def test_two_prefill_workers_share_one_namespace(
    procs: list[Proc],
    start_procs: Callable[..., list[Proc]],
    redis_url: str,
    redis_namespace: str,
) -> None:
    ports = [free_port(), free_port()]
    shared = _flags(redis_url, redis_namespace)
    a, b, dec = start_procs(
        procs,
        partial(Proc, "prefill", _worker("a", *shared, "--metrics-port", str(ports[0]))),
        partial(Proc, "prefill", _worker("b", *shared, "--metrics-port", str(ports[1]))),
        partial(Proc, "decode", _worker("d")),
    )
    client = redis.Redis.from_url(redis_url)
    router = Router([a.control, b.control], [dec.control], timeout_s=60, secret=TEST_SECRET)
    try:
        router.connect()
        first = router.generate("r0", PROMPT, max_new_tokens=NEW)
        assert first.state == "success" and len(first.tokens) == NEW

        def published() -> bool:
            return len(list(client.scan_iter(match=f"{redis_namespace}:*:h:*"))) == 4

        wait_for(published, timeout_s=30, what="worker a's 4 chunks in the shared store")
        second = router.generate("r1", PROMPT, max_new_tokens=NEW)  # round-robin: the other
        assert second.state == "success" and second.tokens == first.tokens
        # the worker that computed it found nothing; the other all 4 chunks, in the store
        assert sorted(_remote_hits(port) for port in ports) == [0.0, 4.0]
    finally:
        router.close()
        client.close()


def test_remote_flags_become_the_offload_config() -> None:
    argv = ["serve", "prefill", *_flags("redis://127.0.0.1:1/0", "ns")]
    args = build_parser().parse_args([*argv, "--offload-remote-replicas", "redis://h:2/0"])
    settings = offload_of(args)
    assert settings is not None
    c = settings.offload
    got = (c.remote_url, c.remote_mode, c.remote_namespace, c.remote_slots, c.remote_replicas)
    assert got == ("redis://127.0.0.1:1/0", "shared", "ns", 16, "redis://h:2/0")
    plain = offload_of(build_parser().parse_args(["serve", "prefill", "--offload-host-slots", "2"]))
    assert plain is not None and (plain.offload.remote_url, plain.offload.remote_mode) == (
        "",
        "private",
    )
