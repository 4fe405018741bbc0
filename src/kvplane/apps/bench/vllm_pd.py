"""``kvplane bench vllm-pd``: PD between two real vLLM engines, kvplane's connector (pull,
pipelined) against vLLM's own NixlConnector (pull, push), same model, prompts and cores.

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
    Sample,
    bench_rows,
    row,
    sample,
    targets,
    time_ratio,
)
from kvplane.errors import ConfigError, IntegrationError, UnsupportedError
from kvplane.integrations.vllm.env import nixl_support, run_harness, run_pd_pair, save_tiny_llama

NAME = "vllm-pd"
HELP = "vLLM PD: kvplane (pull, pipelined) vs vLLM's NixlConnector (pull, push), same engines."

SIZES = {True: (4, 512, 1024), False: (8, 1024, 4096)}
"""Per ``--quick``: requests per round, shortest and longest prompt (tokens, evenly spaced)."""
ROUNDS = {True: 1, False: 2}
PAIRS = {True: ("kvplane",), False: ("kvplane", "nixl-pull", "nixl-push")}
"""Engine pairs run per ``--quick``: one kvplane pair serves both pull and pipelined;
NixlConnector needs a pair per mode, and each pair is two engine starts (a quick run with the
NIXL pull pair took 213 s at load 8 on this 2-core host, ~70 s of it that pair), so
``--quick`` runs kvplane's pair alone: the NIXL rows are the full run's."""
NOT_IN_QUICK = "full run only (not in --quick)"
REFERENCE = {
    True: "the kvplane pair's prefill engine alone (no peer), after the timed requests",
    False: "one engine without a connector (its own process)",
}
"""Where the reference tokens come from, per ``--quick``: the full run's reference is an engine
of its own (it runs while the first pair's engines start); ``--quick`` saves that engine's
start (~50 s at load 8 here) and asks the prefill engine, whose KV never crossed a connector."""
MAX_TOKENS = 8
STEP_TOKENS = 256
"""Chunked-prefill step (``max_num_batched_tokens``): a 4,096-token prompt is 16 slices."""
PAIR_TIMEOUT_S = {True: 300.0, False: 900.0}
AFFINITY_HOW = (
    "each engine process starts under taskset -c on its cores (the same for every connector: "
    "see prefill and decode); once the engine is built, every thread is set back to them "
    "(pd_harness.pin_threads: vLLM's NIXL worker pins the model-runner thread, engine_set "
    "shows where); threads started later inherit them"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transport", choices=("tcp", "shm"), default="tcp", help="kvplane's")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of every pair")
    parser.add_argument(
        "--cores", choices=("auto", "split", "shared"), default="auto",
        help="engines' cores: a half each (split), all for both (shared); auto: split from 4",
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
        self.pairs = PAIRS[quick]
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
        self.samples: dict[tuple[str, str], list[Sample]] = {}
        self.errors: dict[tuple[str, str], str] = {}
        self.affinity: dict[str, Any] = {}
        self._nixl: list[str | None] = []  # nixl_support(), asked once
        self.reference: list[list[int]] = [[] for _ in self.prompts]
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
        self, connector: str, r: int, start_after: Path | None = None, reference: bool = False
    ) -> None:
        """Run round ``r``'s pair of ``connector`` and keep its samples (or its error); with
        ``start_after`` its engines start at once but serve only once that file exists; with
        ``reference`` its prefill engine then decodes every prompt alone (:attr:`reference`)."""
        plan = self.layout(connector, r)
        modes = sorted({m for m, _s, _p in plan})
        name = "kvplane" if connector == "kvplane" else "nixl"
        if any((name, m) in self.errors for m in modes):
            return  # failed in an earlier round: the same error again says nothing new
        spec: dict[str, Any] = {
            **self.base,
            "prompts": [self.prompts[p] for _m, _s, p in plan],
            "sequence": [m for m, _s, _p in plan],
            **({} if start_after is None else {"start_after": str(start_after)}),
        }
        if name == "kvplane":
            spec["connector"] = {"host_slots": 16, "pd_transport": self.transport}
        else:
            spec["nixl"] = {"mode": modes[0]}
        try:
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
                self.errors[(name, m)] = _reason(exc)
            return
        assert dec is not None
        if reference:
            self.reference = [list(t) for t in pre["reference"]]
        self.affinity.setdefault(
            connector,
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
            )  # fmt: skip
            self.samples.setdefault((name, mode), []).append(got)

    def result(self, reference: list[list[int]]) -> dict[str, Any]:
        ref = dict(enumerate(reference))
        rows: list[dict[str, Any]] = []
        keys = (("kvplane", "pull"), ("kvplane", "pipelined"), ("nixl", "pull"), ("nixl", "push"))
        for key in keys:
            if key in self.errors:
                rows.append({"connector": key[0], "mode": key[1], "error": self.errors[key]})
            elif key in self.samples:
                rows.append(row(*key, self.samples[key], ref))
        s = self.samples
        none: list[Sample] = []
        kp, kpipe = s.get(("kvplane", "pull"), none), s.get(("kvplane", "pipelined"), none)
        np_, npush = s.get(("nixl", "pull"), none), s.get(("nixl", "push"), none)
        ratios = {
            "kvplane_pull_vs_nixl_pull": time_ratio(kp, np_),
            "pipelined_vs_pull": time_ratio(kpipe, kp),
            "pipelined_vs_nixl_push": time_ratio(kpipe, npush),
            "decode_ttft_kvplane_pull_vs_nixl_pull": time_ratio(kp, np_, "decode_ttft_ms"),
            "prefill_kvplane_pull_vs_nixl_pull": time_ratio(kp, np_, "prefill_ms"),
        }
        verdicts = targets(rows, ratios)
        if "nixl-pull" not in self.pairs:
            verdicts["kvplane_pull_le_nixl_pull"]["why"] = f"NIXL pull pair: {NOT_IN_QUICK}"
        return {"rows": bench_rows(s), "modes": rows, "targets": verdicts, "ratios": ratios}


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
    bench.reference = [list(t) for t in ref["tokens"][0]]
    bench.vllm_version = ref.get("vllm_version")


def run(quick: bool, args: argparse.Namespace) -> dict[str, Any]:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvplane-bench-vllm-pd-") as tmp:
        model = Path(tmp) / "model"
        save_tiny_llama(model, MODEL_SHAPE)
        bench = _Bench(quick, args, model)
        order = list(bench.pairs)
        if quick:
            bench.run_pair(order[0], 0, reference=True)
        else:
            _with_reference_engine(bench, order[0], Path(tmp) / "reference-done")
        for r in range(bench.rounds):
            for connector in order if r % 2 == 0 else order[::-1]:
                if (r, connector) != (0, order[0]):
                    bench.run_pair(connector, r)
    out = bench.result(bench.reference)
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
            "pairs": list(bench.pairs),
            "not_run": {c: NOT_IN_QUICK for c in PAIRS[False] if c not in bench.pairs},
            "step_tokens": STEP_TOKENS,
            "max_tokens": MAX_TOKENS,
            "kvplane_transport": bench.transport,
            "model": {**MODEL_SHAPE, "dtype": "float32", "block_size": 32},
            "reference": REFERENCE[quick],
            "vllm_version": bench.vllm_version,
            "wall_s": round(time.monotonic() - start, 1),
        }
    )
    return out
