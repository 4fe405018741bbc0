"""``kvplane bench vllm-pd``: PD between two real vLLM engines, kvplane's connector (pull,
pipelined) against vLLM's own NixlConnector (pull, push), same model, prompts and cores, with
both engines at TP 1 and (``--tp 2``, or a full run) at TP 2, rank r to rank r.

Runs engine pairs of the vLLM environment (``pd_harness``, one request at a time) and the
reference tokens in one engine without a connector; mode rows (``modes``), ``bench all`` rows
(``rows``, the spread of per-request ratios) and targets from :mod:`.vllm_pd_rows`. A
connector that cannot run here is an ``error`` mode row saying why. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvplane.apps.bench.vllm import MODEL_SHAPE
from kvplane.apps.bench.vllm_pd_rows import (
    EXPOSED_TAIL_DEFINITION,
    TARGET_DEFINITIONS,
    TTFT_DEFINITION,
    Key,
    Sample,
    at_tp,
    bench_rows,
    ratios_at,
    row,
    sample,
    targets,
)
from kvplane.errors import ConfigError, IntegrationError, UnsupportedError
from kvplane.integrations.vllm.env import nixl_support, run_harness, run_pd_pair, save_tiny_llama

NAME = "vllm-pd"
HELP = "vLLM PD: kvplane (pull, pipelined) vs vLLM's NixlConnector (pull, push), same engines."

SIZES = {True: (4, 512, 1024), False: (8, 1024, 4096)}
"""Per ``--quick``: requests per round, shortest and longest prompt (tokens, evenly spaced)."""
ROUNDS = {True: 1, False: 2}
PAIRS = {True: ("kvplane",), False: ("kvplane", "nixl-pull", "nixl-push")}
"""Engine pairs run per ``--quick`` at TP 1: one kvplane pair serves both pull and pipelined;
NixlConnector needs a pair per mode, and each pair is two engine starts (a quick run with the
NIXL pull pair took 213 s at load 8 on this 2-core host, ~70 s of it that pair), so
``--quick`` runs kvplane's pair alone: the NIXL rows are the full run's."""
NIXL_PAIRS = {"pull": ("kvplane", "nixl-pull"), "pull,push": PAIRS[False]}
"""``--nixl``: the NIXL pairs a ``--quick`` run adds (a full run has both)."""
TP_SIZES = {"1": (1,), "2": (2,), "1,2": (1, 2)}
"""``--tp``: the TP sizes run (both engines of a pair at one size); default ``1`` with
``--quick``, ``1,2`` for a full run."""
NOT_IN_QUICK = "full run only (not in --quick)"
REFERENCE = {
    True: "the kvplane pair's prefill engine alone (no peer), after the timed requests",
    False: "one engine without a connector (its own process)",
}
"""Where the TP 1 reference tokens come from, per ``--quick``: the full run's reference is an
engine of its own (it runs while the first pair's engines start); ``--quick`` saves that
engine's start (~50 s at load 8 here) and asks the prefill engine, whose KV never crossed a
connector. At TP > 1 always the latter (round 0's kvplane pair, same TP): TP 2 tokens are
compared with a TP 2 engine's."""
MAX_TOKENS = 8
STEP_TOKENS = 256
"""Chunked-prefill step (``max_num_batched_tokens``): a 4,096-token prompt is 16 slices."""
PAIR_TIMEOUT_S = {True: 300.0, False: 900.0}
AFFINITY_HOW = (
    "each engine process starts under taskset -c on its cores (the same for every connector: "
    "see prefill and decode); once the engine is built, every thread is set back to them "
    "(pd_harness.pin_threads: vLLM's NIXL worker pins the model-runner thread, engine_set "
    "shows where); threads started later inherit them. At TP > 1 the rank workers are other "
    "processes: they inherit the engine's taskset, vLLM binds each rank's threads to its run of "
    "VLLM_CPU_OMP_THREADS_BIND (the engine's cores split per rank, harness.cpu_binds); NIXL's "
    "worker, in each rank worker, moves its model-runner thread to the last core of each NUMA "
    "node (vLLM's nixl/base_worker.py; on one node every rank's runner onto one core), so after "
    "the build every rank worker thread that holds no core of its rank's run is set to that run "
    "(pd_pinning.pin_rank_workers, rank_workers shows what moved; vLLM's per-core binds and "
    "kvplane's threads spread over the engine's cores stay), for both connectors alike"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transport", choices=("tcp", "shm"), default="tcp", help="kvplane's")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of every pair")
    parser.add_argument(
        "--cores", choices=("auto", "split", "shared"), default="auto",
        help="engines' cores: a half each (split), all for both (shared); auto: split from 4",
    )  # fmt: skip
    parser.add_argument(
        "--tp", choices=tuple(TP_SIZES), default=None, metavar="1|2|1,2",
        help="both engines' TP sizes run (default: 1 with --quick, else 1,2); TP 2 is rank r "
        "to rank r and needs a core per rank for each engine",
    )  # fmt: skip
    parser.add_argument(
        "--nixl", choices=tuple(NIXL_PAIRS), default=None,
        help="NixlConnector pairs run beside kvplane's (default: none with --quick, else both)",
    )  # fmt: skip


def lengths(n: int, lo: int, hi: int) -> list[int]:
    """``n`` prompt lengths from ``lo`` to ``hi``, evenly spaced (``lo`` alone for one)."""
    if n == 1:
        return [lo]
    return [lo + (hi - lo) * i // (n - 1) for i in range(n)]


def engine_cores(how: str = "auto") -> tuple[list[int], list[int]]:
    """The prefill and decode engines' cores among this process's: ``split`` gives each engine
    one half, ``shared`` gives both all of them, ``auto`` splits from 4 cores up (an engine
    alone on one core of a small shared host starves behind any other load)."""
    cpus = sorted(os.sched_getaffinity(0))
    if how == "split" and len(cpus) < 2:
        raise ConfigError(f"--cores split needs 2 cores; this process may use {cpus}")
    if how == "split" or (how == "auto" and len(cpus) >= 4):
        half = len(cpus) // 2
        return cpus[:half], cpus[half:]
    return cpus, cpus


def _reason(exc: Exception) -> str:
    """The failure's text without vLLM's warning lines, its last 2,000 characters."""
    lines = [ln for ln in str(exc).splitlines() if ln.strip() and " WARNING " not in ln]
    text = "\n".join(lines)
    return text if len(text) <= 2000 else "..." + text[-2000:]


class _Bench:
    """One run: the prompts, the pairs' specs and what came back."""

    def __init__(self, quick: bool, args: argparse.Namespace, model: Path) -> None:
        transport = str(getattr(args, "transport", "tcp"))
        rounds = int(getattr(args, "rounds", None) or ROUNDS[quick])
        n, lo, hi = SIZES[quick]
        self.n, self.transport, self.rounds = n, transport, rounds
        self.tps = TP_SIZES[str(getattr(args, "tp", None) or ("1" if quick else "1,2"))]
        nixl = getattr(args, "nixl", None)
        pairs = PAIRS[quick] if nixl is None else NIXL_PAIRS[str(nixl)]
        self.pairs = dict.fromkeys(self.tps, pairs)
        self.timeout = PAIR_TIMEOUT_S[quick]
        rng = random.Random(0)
        vocab = MODEL_SHAPE["vocab"]
        self.prompts: list[list[int]] = []

        def new(length: int) -> int:
            self.prompts.append([rng.randrange(1, vocab) for _ in range(length)])
            return len(self.prompts) - 1

        self.warm = (new(lo), new(lo))  # one pull, one pipelined/push warm-up per pair
        sizes = lengths(n, lo, hi)
        self.pull = [[new(x) for x in sizes] for _ in range(rounds)]
        self.early = [[new(x) for x in sizes] for _ in range(rounds)]
        self.base = {
            "model": str(model),
            "block_size": 32,
            "max_model_len": hi + 64,
            "max_num_batched_tokens": STEP_TOKENS,
            "prefix_caching": False,
            "dtype": "float32",
            "max_tokens": MAX_TOKENS,
            "wait_s": self.timeout,
        }
        self.cores = engine_cores(str(getattr(args, "cores", "auto")))
        self.env = {"KVPLANE_SECRET": secrets.token_hex(24)}
        self.samples: dict[Key, list[Sample]] = {}
        self.errors: dict[Key, str] = {}
        self.affinity: dict[str, Any] = {}
        self._nixl: list[str | None] = []  # nixl_support(), asked once
        self.reference: dict[int, list[list[int]]] = {}  # per TP size
        self.vllm_version: str | None = None  # the reference engine's (full run)

    def nixl_missing(self) -> str | None:
        """Why NIXL cannot run here (asked once), or None."""
        if not self._nixl:
            self._nixl.append(nixl_support())
        return self._nixl[0]

    def layout(self, connector: str, r: int) -> list[tuple[str, int | None, int]]:
        """``(mode, slot or None for a warm-up, prompt)`` per request of round ``r``'s pair."""
        slots = range(r * self.n, (r + 1) * self.n)
        if connector == "kvplane":
            out: list[tuple[str, int | None, int]] = [
                ("pull", None, self.warm[0]), ("pipelined", None, self.warm[1]),
            ]  # fmt: skip
            for s, a, b in zip(slots, self.pull[r], self.early[r], strict=True):
                out += [("pull", s, a), ("pipelined", s, b)]
            return out
        mode, prompts, warm = (
            ("pull", self.pull[r], self.warm[0])
            if connector == "nixl-pull"
            else ("push", self.early[r], self.warm[1])
        )
        return [(mode, None, warm), *((mode, s, p) for s, p in zip(slots, prompts, strict=True))]

    def run_pair(
        self,
        connector: str,
        r: int,
        start_after: Path | None = None,
        reference: bool = False,
        tp: int = 1,
    ) -> None:
        """Run round ``r``'s pair of ``connector``, both engines at ``tp``, and keep its samples
        (or its error); with ``start_after`` its engines start at once but serve only once that
        file exists; with ``reference`` its prefill engine then decodes every prompt alone
        (:attr:`reference` at ``tp``)."""
        plan = self.layout(connector, r)
        modes = sorted({m for m, _s, _p in plan})
        name = "kvplane" if connector == "kvplane" else "nixl"
        if any((name, m, tp) in self.errors for m in modes):
            return  # failed in an earlier round: the same error again says nothing new
        spec: dict[str, Any] = {
            **self.base,
            "prompts": [self.prompts[p] for _m, _s, p in plan],
            "sequence": [m for m, _s, _p in plan],
            **({} if start_after is None else {"start_after": str(start_after)}),
            **({} if tp == 1 else {"tensor_parallel_size": tp}),
        }
        if name == "kvplane":
            spec["connector"] = {"host_slots": 16, "pd_transport": self.transport}
        else:
            spec["nixl"] = {"mode": modes[0]}
        try:
            if tp > min(len(c) for c in self.cores):  # vllm-cpu binds a core per rank
                raise ConfigError(f"TP {tp} needs a core per rank in each engine: {self.cores}")
            why = None if name == "kvplane" else self.nixl_missing()
            if why is not None:
                raise UnsupportedError(why)
            alone = {"reference_prompts": self.prompts} if reference else {}
            pre, dec = run_pd_pair(
                {**spec, "cpus": self.cores[0], **alone},
                {**spec, "cpus": self.cores[1]},
                timeout=self.timeout,
                env=self.env,
            )
        except (IntegrationError, UnsupportedError, ConfigError) as exc:
            for m in modes:
                self.errors[(name, m, tp)] = _reason(exc)
            return
        assert dec is not None
        if reference:
            self.reference[tp] = [list(t) for t in pre["reference"]]
        self.affinity.setdefault(
            at_tp(connector, tp),
            {
                role: {**got["affinity"], "busiest_threads_cpu_s": got["thread_cpu_s"][:3]}
                for role, got in (("prefill", pre), ("decode", dec))
            },
        )
        done = pre.get("slices_done_at", {})
        for k, (mode, slot, prompt) in enumerate(plan):
            if slot is None:
                continue
            rid = f"r{k}"
            got = sample(
                name, mode, slot, prompt,
                prefill=pre["prefill"][rid], decode=dec["decode"][rid], slice_done_at=done.get(rid),
                tp=tp,
            )  # fmt: skip
            self.samples.setdefault((name, mode, tp), []).append(got)

    def result(self) -> dict[str, Any]:
        """Mode rows, ``bench all`` rows, targets and ratios, per TP size run."""
        rows: list[dict[str, Any]] = []
        keys = (("kvplane", "pull"), ("kvplane", "pipelined"), ("nixl", "pull"), ("nixl", "push"))
        ratios: dict[str, Any] = {}
        bench: list[dict[str, object]] = []
        for tp in self.tps:
            ref = dict(enumerate(self.reference.get(tp, [])))
            for c, m in keys:
                if (c, m, tp) in self.errors:
                    rows.append({"connector": c, "mode": m, "tp": tp,
                                 "error": self.errors[(c, m, tp)]})  # fmt: skip
                elif (c, m, tp) in self.samples:
                    rows.append(row(c, m, self.samples[(c, m, tp)], ref))
            ratios.update(ratios_at(self.samples, tp))
            bench += bench_rows(self.samples, tp)
        verdicts = targets(rows, ratios, self.tps)
        for tp in self.tps:
            if "nixl-pull" not in self.pairs[tp]:
                why = f"NIXL pull pair: {NOT_IN_QUICK}"
                verdicts[at_tp("kvplane_pull_le_nixl_pull", tp)]["why"] = why
        return {"rows": bench, "modes": rows, "targets": verdicts, "ratios": ratios}

    def not_run(self) -> dict[str, str]:
        """The pairs a full run has and this one does not, and why."""
        out: dict[str, str] = {}
        for tp in self.tps:
            out |= {at_tp(c, tp): NOT_IN_QUICK for c in PAIRS[False] if c not in self.pairs[tp]}
        return out


def _with_reference_engine(bench: _Bench, connector: str, flag: Path) -> None:
    """Round 0's pair of ``connector`` and the reference engine (:attr:`_Bench.reference`) at
    once: the pair's engines serve only once ``flag`` is written, after the reference's."""
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(bench.run_pair, connector, 0, flag)
        try:
            ref = run_harness(
                {**bench.base, "connector": None,
                 "rounds": [{"prompts": bench.prompts, "max_tokens": MAX_TOKENS}]},
                timeout=bench.timeout,
            )  # fmt: skip
        finally:
            flag.write_text("1\n")
        first.result()
    bench.reference[1] = [list(t) for t in ref["tokens"][0]]
    bench.vllm_version = ref.get("vllm_version")


def _run_pairs(bench: _Bench, quick: bool, tmp: Path) -> None:
    """Every round of every pair, alternating the pairs' order per round; round 0's kvplane
    pair at each TP size gives that size's reference tokens (a full run's TP 1: the reference
    engine, started beside it)."""
    done: set[tuple[int, str, int]] = set()
    if 1 in bench.tps and not quick:
        _with_reference_engine(bench, bench.pairs[1][0], tmp / "reference-done")
        done.add((0, bench.pairs[1][0], 1))
    for r in range(bench.rounds):
        for tp in bench.tps:
            order = list(bench.pairs[tp])
            for connector in order if r % 2 == 0 else order[::-1]:
                if (r, connector, tp) not in done:
                    first = r == 0 and connector == "kvplane"
                    bench.run_pair(connector, r, reference=first, tp=tp)


def run(quick: bool, args: argparse.Namespace) -> dict[str, Any]:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvplane-bench-vllm-pd-") as tmp:
        model = Path(tmp) / "model"
        save_tiny_llama(model, MODEL_SHAPE)
        bench = _Bench(quick, args, model)
        _run_pairs(bench, quick, Path(tmp))
    out = bench.result()
    n, lo, hi = SIZES[quick]
    out.update(
        {
            "definitions": {
                "ttft_ms": TTFT_DEFINITION,
                "exposed_tail_ms": EXPOSED_TAIL_DEFINITION,
                "targets": TARGET_DEFINITIONS,
            },
            "affinity": {
                "prefill": bench.cores[0],
                "decode": bench.cores[1],
                "how": AFFINITY_HOW,
                "engines": bench.affinity,
            },
            "requests": n,
            "prompt_tokens": [lo, hi],
            "rounds": bench.rounds,
            "tp": list(bench.tps),
            "pairs": [at_tp(c, tp) for tp in bench.tps for c in bench.pairs[tp]],
            "not_run": bench.not_run(),
            "step_tokens": STEP_TOKENS,
            "max_tokens": MAX_TOKENS,
            "kvplane_transport": bench.transport,
            "model": {**MODEL_SHAPE, "dtype": "float32", "block_size": 32},
            "reference": {f"tp{tp}": REFERENCE[quick or tp > 1] for tp in bench.tps},
            "vllm_version": bench.vllm_version,
            "wall_s": round(time.monotonic() - start, 1),
        }
    )
    return out
