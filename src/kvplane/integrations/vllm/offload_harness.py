"""One real vLLM engine running the offload bench's workload phases, timing every request.

``python -m kvplane.integrations.vllm.offload_harness SPEC.json OUT.json`` inside the vLLM
environment builds one engine (prefix cache on, a fixed number of KV blocks, with or without
kvplane's connector), runs the spec's phases in order and writes per-request TTFTs, tokens and
the connector's metrics; with ``turns`` it waits for the bench's go file before each pressure
round and later phase (:class:`Turns`). Owns the phases' request patterns (``pressure``,
``prefix_hit``, ``store``, ``restart_hit``); decides no ratio (``apps/bench/vllm_offload``).
vLLM is imported inside functions only. Spec keys: ``docs/benchmarks.md`` (vllm-offload).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvplane.errors import ConfigError, IntegrationError
from kvplane.integrations.vllm.harness import build_engine, engine_connectors, metric_samples


def build(spec: dict[str, Any]) -> Any:
    """An in-process ``LLM`` for ``spec``: ``num_gpu_blocks`` KV blocks of ``block_size``
    tokens, vLLM's prefix cache on, float32 unless ``dtype`` says otherwise, kvplane's connector
    when ``connector`` is a mapping (:func:`~.harness.build_engine`)."""
    return build_engine({"dtype": "float32", **spec, "prefix_caching": True})


def serve(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[Any]]:
    """Add every prompt at once (greedy, ``max_tokens`` each) and step the engine until all
    finish; ``(seconds, [(ttft_ms, tokens)] in prompt order)``, the TTFT from the add."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    ids = [f"r{i}" for i in range(len(prompts))]  # outputs carry these, not the internal ids
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = (now - start) * 1e3
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    missing = [i for i in ids if i not in first or i not in tokens]
    if missing:
        raise IntegrationError(f"requests {missing} finished without tokens")
    return seconds, [(first[i], tokens[i]) for i in ids]


def drain(llm: Any) -> None:
    """Let every kvplane job finish, write-through to lower tiers included (no connector: no
    job)."""
    _sched, worker = engine_connectors(llm)
    if worker is not None:
        worker.workers.drain()


def quiesce(llm: Any, filler: list[int]) -> None:
    """:func:`drain`, then one engine step (``filler``, one token) that hands the jobs'
    completions to the scheduler side."""
    drain(llm)
    serve(llm, [filler], 1)


@dataclass(frozen=True, slots=True)
class Turns:
    """Turn-taking with the bench: before step ``label`` wait for ``DIR/NAME.label.go``,
    after it write ``DIR/NAME.label.done``; with no ``dir`` both return at once."""

    dir: str | None = None
    name: str = ""
    wait_s: float = 600.0

    def wait(self, label: str) -> None:
        """Return once this engine's go file for ``label`` exists; IntegrationError after
        ``wait_s``."""
        if self.dir is None:
            return
        go = Path(self.dir) / f"{self.name}.{label}.go"
        deadline = time.monotonic() + self.wait_s
        while not go.exists():
            if time.monotonic() > deadline:
                raise IntegrationError(f"no {go.name} within {self.wait_s:.0f} s")
            time.sleep(0.002)

    def done(self, label: str) -> None:
        if self.dir is not None:
            (Path(self.dir) / f"{self.name}.{label}.done").write_text("")


def _one(llm: Any, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    _s, [(ttft, toks)] = serve(llm, [prompt], max_tokens)
    return ttft, toks


def pressure(llm: Any, phase: dict[str, Any], filler: list[int], turns: Turns) -> dict[str, Any]:
    """Each round's prompts added at once, on its turn (``round<i>``); a round's seconds run
    from its first add until its last token and every kvplane job it started finished."""
    rounds = []
    for i, prompts in enumerate(phase["rounds"]):
        turns.wait(f"round{i}")
        start = time.perf_counter()
        _s, got = serve(llm, prompts, int(phase["max_tokens"]))
        drain(llm)
        seconds = time.perf_counter() - start
        turns.done(f"round{i}")
        rounds.append(
            {"seconds": seconds, "ttft_ms": [t for t, _ in got], "tokens": [k for _, k in got]}
        )
    return {"rounds": rounds}


def prefix_hit(llm: Any, phase: dict[str, Any], filler: list[int], _t: Turns) -> dict[str, Any]:
    """Per prompt: a miss (stores it), then the same prompt hit in vLLM's prefix cache and,
    after ``reset_prefix_cache()``, hit in kvplane's host tier; even repeats time vLLM's hit
    first, odd ones kvplane's (a kvplane hit leaves the prefix in vLLM's cache again)."""
    n = int(phase["max_tokens"])
    out: dict[str, list[Any]] = {k: [] for k in ("miss_ms", "vllm_hit_ms", "kvplane_hit_ms")}
    out |= {"tokens": [], "reset": []}

    def reset() -> None:
        quiesce(llm, filler)
        out["reset"].append(bool(llm.reset_prefix_cache()))

    for i, prompt in enumerate(phase["prompts"]):
        miss, toks = _one(llm, prompt, n)
        quiesce(llm, filler)
        if i % 2:
            reset()
        first, toks_a = _one(llm, prompt, n)
        if not i % 2:
            reset()
        second, toks_b = _one(llm, prompt, n)
        vllm_hit, kv_hit = (second, first) if i % 2 else (first, second)
        out["miss_ms"].append(miss)
        out["vllm_hit_ms"].append(vllm_hit)
        out["kvplane_hit_ms"].append(kv_hit)
        out["tokens"].append([toks, toks_a, toks_b])
        quiesce(llm, filler)
    return out


def store(llm: Any, phase: dict[str, Any], filler: list[int], _t: Turns) -> dict[str, Any]:
    """Each prompt once (a miss: computed and stored); then every job finishes."""
    got = [_one(llm, p, int(phase["max_tokens"])) for p in phase["prompts"]]
    quiesce(llm, filler)
    return {"ttft_ms": [t for t, _ in got], "tokens": [k for _, k in got]}


def restart_hit(llm: Any, phase: dict[str, Any], filler: list[int], _t: Turns) -> dict[str, Any]:
    """Per repeat: ``hits[i]`` (stored by an earlier engine), then ``fresh[i]`` (same length,
    never seen: recomputed), each after every job finished."""
    n = int(phase["max_tokens"])
    out: dict[str, list[Any]] = {"hit_ms": [], "fresh_ms": [], "tokens": []}
    for hit, fresh in zip(phase["hits"], phase["fresh"], strict=True):
        ttft, toks = _one(llm, hit, n)
        quiesce(llm, filler)
        out["hit_ms"].append(ttft)
        out["tokens"].append(toks)
        out["fresh_ms"].append(_one(llm, fresh, n)[0])
        quiesce(llm, filler)
    return out


PHASES = {"pressure": pressure, "prefix_hit": prefix_hit, "store": store,
          "restart_hit": restart_hit}  # fmt: skip


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the engine, run ``spec["phases"]`` in order (each result with the scheduler
    side's metric samples at its end), finish every job, check the connector's integrity."""
    for key in ("model", "num_gpu_blocks", "phases", "filler"):
        if key not in spec:
            raise ConfigError(f"offload harness spec needs {key!r}")
    unknown = [p.get("kind") for p in spec["phases"] if p.get("kind") not in PHASES]
    if unknown:
        raise ConfigError(f"unknown phase kind(s) {unknown}; known: {sorted(PHASES)}")
    import vllm

    start = time.perf_counter()
    llm = build(spec)
    started = time.perf_counter() - start
    result: dict[str, Any] = {"vllm_version": vllm.__version__, "engine_start_s": started}
    filler = list(spec["filler"])
    for prompt in spec.get("warmup", [filler]):  # first-call costs of engine and tiers
        serve(llm, [list(prompt)], 1)
        quiesce(llm, filler)
    sched, worker = engine_connectors(llm)
    turns = Turns(**spec.get("turns", {}))
    result["phases"] = []
    for i, phase in enumerate(spec["phases"]):
        if i:
            turns.wait(f"phase{i}")
        got = PHASES[phase["kind"]](llm, phase, filler, turns)
        if sched is not None:
            got["scheduler_metrics"] = metric_samples(sched.metrics)
        result["phases"].append(got)
    if sched is not None and worker is not None:
        worker.workers.drain()
        sched.hybrid.apply(worker.workers.take_reports())
        sched.hybrid.check_integrity()
        result["integrity"] = "ok"
        result["worker_metrics"] = metric_samples(worker.metrics)
    llm.llm_engine.engine_core.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m kvplane.integrations.vllm.offload_harness SPEC.json OUT.json")
        return 2
    result = run(json.loads(Path(args[0]).read_text()))
    Path(args[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
