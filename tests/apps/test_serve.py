"""The workers and the router as real processes (``python -m kvplane serve ...``)."""

from __future__ import annotations

import signal
import time
import urllib.request
from collections.abc import Callable

import numpy as np

from kvplane.serving.messages import (
    ErrorReply,
    Generate,
    RequestResult,
    Shutdown,
    StatsQuery,
    WorkerStats,
)
from kvplane.serving.router.router import Router
from kvplane.serving.rpc import RpcClient
from kvplane.testing.cluster import (
    TEST_SECRET,
    Proc,
    check_balanced,
    free_port,
    idle,
    prompt,
    wait_for,
)

TIMING = [
    "--heartbeat",
    "0.1",
    "--lease",
    "0.6",
    "--in-doubt",
    "0.2",
    "--drain",
    "0.5",
    "--retransmit",
    "0.05",
    "--deadline",
    "8",
]
SHAPE = ["--layout", "mla", "--layers", "2", "--latent-dim", "32", "--rope-dim", "16"]


def worker_args(name: str, control: int, pd: int, *extra: str) -> list[str]:
    return [
        "--name",
        name,
        "--control",
        f"tcp://127.0.0.1:{control}",
        "--pd",
        f"tcp://127.0.0.1:{pd}",
        *SHAPE,
        *TIMING,
        "--num-blocks",
        "128",
        *extra,
    ]


StartProcs = Callable[..., list[Proc]]


def test_processes_serve_requests_through_a_router_process(
    procs: list[Proc], start_procs: StartProcs
) -> None:
    mport = free_port()
    pre_args = worker_args(
        "prefill", free_port(), free_port(), "--step-size", "24", "--metrics-port", str(mport)
    )
    dec_args = worker_args("decode", free_port(), free_port(), "--block-size", "8")
    pre, dec = start_procs(
        procs, lambda: Proc("prefill", pre_args), lambda: Proc("decode", dec_args)
    )
    assert str(pre.info["pd"]).startswith("tcp://127.0.0.1:")
    router = Proc(
        "router",
        [
            "--control",
            f"tcp://127.0.0.1:{free_port()}",
            "--prefill",
            pre.control,
            "--decode",
            dec.control,
        ],
    )
    procs.append(router)
    client = RpcClient(router.control, timeout_s=20, secret=TEST_SECRET)
    try:
        rng = np.random.default_rng(5)
        for i, n in enumerate([3, 50, 129]):
            got = client.call(Generate(request_id=f"p{i}", token_ids=tuple(prompt(rng, n))))
            assert isinstance(got, RequestResult)
            assert (got.state, got.mismatches, got.num_tokens) == ("success", 0, n)
        body = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read()
        text = body.decode()
        assert 'kvplane_pd_requests_total{role="prefill",state="success"} 3.0' in text
        assert "kvplane_pd_overlap_ratio_bucket" in text
        assert 'kvplane_pd_sessions{state="transferring"}' in text  # refreshed every 0.5 s
        assert "kvplane_pd_bytes_moved_total" in text and "kvplane_pd_slices_total" in text
        assert "kvplane_block_pool_usage" in text
        for w in (pre, dec):
            wc = RpcClient(w.control, timeout_s=10, secret=TEST_SECRET)
            try:
                stats = wc.call(StatsQuery())
                assert isinstance(stats, WorkerStats) and stats.integrity == "" and idle(stats)
                assert isinstance(wc.call(Shutdown()), object)
            finally:
                wc.close()
        assert pre.proc.wait(timeout=15) == 0 and dec.proc.wait(timeout=15) == 0
    finally:
        client.close()
    router.proc.send_signal(signal.SIGTERM)
    assert router.proc.wait(timeout=15) == 0


def test_sigkill_mid_transfer_then_restart(procs: list[Proc], start_procs: StartProcs) -> None:
    pc, pp, dc, dp = free_port(), free_port(), free_port(), free_port()
    slow = ["--compute-ms-per-step", "10", "--step-size", "16"]
    pre, dec = start_procs(
        procs,
        lambda: Proc("prefill", worker_args("prefill", pc, pp, *slow)),
        lambda: Proc("decode", worker_args("decode", dc, dp)),
    )
    router = Router([pre.control], [dec.control], timeout_s=20, secret=TEST_SECRET)
    try:
        router.connect()
        assert router.generate("warm", list(range(40))).state == "success"
        fut = router.submit("victim", list(range(600)))
        time.sleep(0.15)  # a few steps in: slices are moving
        killed = time.monotonic()
        dec.kill()
        pclient = router.prefill[0].client

        def prefill_idle() -> bool:
            got = pclient.call(StatsQuery())
            return isinstance(got, WorkerStats) and idle(got) and got.integrity == ""

        wait_for(prefill_idle, timeout_s=10.0, what="prefill released the dead peer's request")
        assert time.monotonic() - killed <= 0.6 + 0.1 + 0.5  # lease + heartbeat + poll slack
        assert not fut.done()  # its decode worker died: the router's answer never came
        dec2 = Proc("decode", worker_args("decode", dc, dp))
        procs.append(dec2)
        assert dec2.info["incarnation"] != dec.info["incarnation"]
        assert router.refresh() == ["decode"]
        res = router.generate("after", list(range(77)))
        assert (res.state, res.mismatches) == ("success", 0)
        check_balanced(router)
    finally:
        router.close()


def test_the_router_process_survives_a_decode_restart(
    procs: list[Proc], start_procs: StartProcs
) -> None:
    pc, pp, dc, dp = free_port(), free_port(), free_port(), free_port()
    pre, dec = start_procs(
        procs,
        lambda: Proc("prefill", worker_args("prefill", pc, pp)),
        lambda: Proc("decode", worker_args("decode", dc, dp)),
    )
    flags = ["--timeout", "5", "--refresh", "0.2", "--request-deadline", "20"]
    rt = Proc("router", ["--prefill", pre.control, "--decode", dec.control, *flags])
    procs.append(rt)
    client = RpcClient(rt.control, timeout_s=15, secret=TEST_SECRET)
    try:
        before = client.call(Generate(request_id="a", token_ids=tuple(range(40))))
        assert isinstance(before, RequestResult) and before.state == "success"
        dec.kill()
        lost = client.call(Generate(request_id="b", token_ids=tuple(range(40))))
        if isinstance(lost, RequestResult):  # sent before the router saw it go: failed then
            assert (lost.state, lost.reason) == (
                "failed",
                f"decode worker at tcp://127.0.0.1:{dc} is unreachable",
            )
        else:  # the router already knew: refused
            assert lost == ErrorReply(reason="no decode worker is up")
        procs.append(Proc("decode", worker_args("decode", dc, dp)))
        for i in range(3):
            got = client.call(Generate(request_id=f"c{i}", token_ids=tuple(range(40))))
            assert isinstance(got, RequestResult) and (got.state, got.mismatches) == ("success", 0)
    finally:
        client.close()
