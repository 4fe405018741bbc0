"""The PD harness's parts that need no engine: which modes a spec may ask for, putting every
thread of the process back on its cores (what undoes NIXL's pin), the per-thread CPU report and
the ``taskset`` prefix of :func:`~kvplane.integrations.vllm.env.run_pd_pair`."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import pytest

from kvplane.errors import ConfigError
from kvplane.integrations.vllm import pd_harness as h
from kvplane.integrations.vllm.env import pinned
from kvplane.integrations.vllm.pd_params import RecvParams, address_params, parse_params, prompt_key


def test_modes_follow_the_connector() -> None:
    prompts = {"prompts": [[1], [2]]}
    assert h._modes({**prompts, "mode": "pipelined"}) == ["pipelined", "pipelined"]
    assert h._modes({**prompts, "sequence": ["pull", "pipelined"]}) == ["pull", "pipelined"]
    assert h._modes({**prompts, "nixl": {"mode": "push"}, "sequence": ["push"] * 2}) == [
        "push",
        "push",
    ]
    with pytest.raises(ConfigError, match="allowed"):
        h._modes({**prompts, "sequence": ["push", "pull"]})  # push is NIXL's
    with pytest.raises(ConfigError, match="allowed"):
        h._modes({**prompts, "nixl": {"mode": "pull"}, "sequence": ["pipelined", "pull"]})
    with pytest.raises(ConfigError):
        h._modes({**prompts, "sequence": ["pull"]})  # one mode per prompt
    with pytest.raises(ConfigError, match="nixl mode"):
        h._modes({**prompts, "nixl": {"mode": "both"}, "mode": "both"})


def test_pin_threads_puts_a_thread_pinned_elsewhere_back_and_says_where_it_was() -> None:
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("needs two cores to pin a thread away from the others")
    one = {max(cpus)}
    ready, stop = threading.Event(), threading.Event()
    tid: list[int] = []

    def pinned_thread() -> None:
        tid.append(threading.get_native_id())
        os.sched_setaffinity(0, one)  # as NIXL's worker does to its thread
        ready.set()
        stop.wait(10)

    t = threading.Thread(target=pinned_thread)
    t.start()
    try:
        assert ready.wait(10)
        got = h.pin_threads(cpus)
        assert got["cpus"] == sorted(cpus)
        assert got["threads_repinned"] == 1
        assert got["engine_set"] == [sorted(one)]
        assert os.sched_getaffinity(tid[0]) == cpus
        assert h.pin_threads(cpus)["threads_repinned"] == 0
    finally:
        stop.set()
        t.join()


def test_thread_cpu_reports_a_spinning_thread_busiest_first() -> None:
    spent, stop = threading.Event(), threading.Event()

    def spin() -> None:
        while time.thread_time() < 0.3:  # 0.3 s of this thread's own CPU, whatever the load
            pass
        spent.set()
        stop.wait(10)

    t = threading.Thread(target=spin)
    t.start()
    try:
        assert spent.wait(60)
        got = h.thread_cpu_s(min_s=0.0)
    finally:
        stop.set()
        t.join()
    spun = [s for n, s in got if n.endswith(f"/{t.native_id}")]
    assert len(spun) == 1 and 0.29 <= spun[0] <= 1.0  # clock ticks are 10 ms
    assert [s for _n, s in got] == sorted((s for _n, s in got), reverse=True)
    assert all(s >= 0.5 for _n, s in h.thread_cpu_s())  # the default leaves idle threads out


def test_pinned_is_a_taskset_prefix_of_allowed_cores_only() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    assert pinned(None) == []
    if shutil.which("taskset") is not None:
        assert pinned(cpus[:1]) == [shutil.which("taskset"), "-c", str(cpus[0])]
    with pytest.raises(ConfigError):
        pinned([])
    with pytest.raises(ConfigError):
        pinned([max(cpus) + 1000])


def test_pipelined_params_name_every_prefill_rank_the_address_file_names() -> None:
    """The prefill writes its ranks' addresses (``address_params``, JSON); the decode's early
    params carry them as a finished prefill's would."""
    a0, a1 = "tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002"
    prompt = [5, 6, 7]
    for addresses in ([a0], [a0, a1]):
        params = h._early_params("pipelined", "r0", prompt, json.dumps(address_params(addresses)))
        ranks = tuple(addresses) if len(addresses) > 1 else ()
        assert parse_params(params) == RecvParams("r0", a0, 3, prompt_key(prompt), ranks)


def test_push_params_name_the_prefill_engines_tp_size_the_address_file_names() -> None:
    """NixlPushConnector's decode request names the prefill's TP (vLLM pairs its ranks by it):
    the prefill writes it beside its NIXL side channel; an address without it is TP 1."""
    peer = {"engine_id": "prefill-7", "host": "127.0.0.1", "port": 5600}
    for tp in (1, 2):
        params = h._early_params("push", "r3", [5, 6], json.dumps({**peer, "tp_size": tp}))
        assert params == {
            "do_remote_prefill": True, "remote_engine_id": "prefill-7",
            "remote_request_id": "r3", "remote_host": "127.0.0.1", "remote_port": 5600,
            "tp_size": tp,
        }  # fmt: skip
    assert h._early_params("push", "r3", [5], json.dumps(peer))["tp_size"] == 1
