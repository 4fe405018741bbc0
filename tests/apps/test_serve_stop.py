"""How ``kvplane serve`` stops: SIGTERM closes everything in order, then the process ends at once
(``apps/serve_stop``) with code 0, its lease released and every address free again."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable

import redis

from kvplane.apps.serve_stop import STOP_SIGNALS, wait_for_stop
from kvplane.offload.tiers.lease import owner_key
from kvplane.serving.messages import Generate, RequestResult
from kvplane.serving.rpc import RpcClient
from kvplane.testing.cluster import TEST_SECRET, Proc, free_port

SMALL = ["--layers", "1", "--latent-dim", "16", "--rope-dim", "8"]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_sigterm_releases_the_lease_and_every_address_then_exits_0(
    procs: list[Proc], start_procs: Callable[..., list[Proc]], redis_url: str, redis_namespace: str
) -> None:
    ports = {f: free_port() for f in ("--control", "--pd", "--kv-events-pub", "--kv-events-replay")}
    metrics = free_port()
    addresses = [a for f, p in ports.items() for a in (f, f"tcp://127.0.0.1:{p}")]
    tiers = ["--offload-host-slots", "4", "--blocks-per-chunk", "1", "--offload-remote-url",
             redis_url, "--offload-remote-namespace", redis_namespace, "--kv-events"]  # fmt: skip
    pre, dec = start_procs(
        procs,
        lambda: Proc("prefill", [*SMALL, *addresses, *tiers, "--metrics-port", str(metrics)]),
        lambda: Proc("decode", SMALL),
    )
    router = Proc("router", ["--prefill", pre.control, "--decode", dec.control])
    procs.append(router)
    client = RpcClient(router.control, timeout_s=20, secret=TEST_SECRET)
    try:
        got = client.call(Generate(request_id="r0", token_ids=tuple(range(70))))
        assert isinstance(got, RequestResult) and got.state == "success"
    finally:
        client.close()
    store = redis.Redis.from_url(redis_url)
    try:
        assert store.get(owner_key(redis_namespace)) is not None  # the private tier's lease
        router.proc.terminate()
        pre.proc.terminate()
        assert pre.proc.wait(timeout=15) == 0 and router.proc.wait(timeout=15) == 0
        assert store.get(owner_key(redis_namespace)) is None  # released by the close
    finally:
        store.close()
    assert pre.proc.stderr is not None and "Traceback" not in pre.proc.stderr.read()
    assert [p for p in [*ports.values(), metrics] if not _bindable(p)] == []
    assert dec.stop() == 0


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_end_process_runs_the_exit_handlers_flushes_and_exits_with_the_code() -> None:
    done = _python("""
        import atexit, sys
        from kvplane.apps.serve_stop import end_process
        atexit.register(lambda: print("handler ran"))
        sys.stdout.write("buffered, ")
        end_process(7)
        print("not reached")
    """)
    assert (done.returncode, done.stdout, done.stderr) == (7, "buffered, handler ran\n", "")


def test_end_process_returns_while_a_non_daemon_thread_lives() -> None:
    done = _python("""
        import threading
        from kvplane.apps.serve_stop import end_process
        go = threading.Event()
        t = threading.Thread(target=go.wait, name="busy")
        t.start()
        end_process(7)
        print("returned")
        go.set()
    """)
    assert (done.returncode, done.stdout) == (0, "returned\n")


def test_wait_for_stop_says_whether_a_signal_ended_it() -> None:
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        stop = threading.Event()
        threading.Timer(0.05, stop.set).start()
        assert wait_for_stop(stop) is False  # a Shutdown order
        stop = threading.Event()
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()
        assert wait_for_stop(stop) is True and stop.is_set()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
