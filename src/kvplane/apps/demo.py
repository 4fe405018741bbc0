"""``kvplane demo``: a real model served across processes, checked token by token.

Starts prefill, decode and router processes with prefix offload (sharing a secret generated
for the run, unless ``--insecure``), sends the demo prompts through the router, compares every
request's tokens with one-process ``generate`` and prints the seed's metrics. Exit 0 only with
parity and balanced pools, ledgers and slots. See docs/serving.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress

from kvplane.apps.demo_procs import ROLES, ProcessGroup, free_port, new_secret, seed_families
from kvplane.apps.generate import add_attention_flag
from kvplane.apps.report import draw_timeline, metrics_table, summarize
from kvplane.errors import InvalidArgumentError, TransferTimeoutError, WorkerDiedError
from kvplane.metrics import SEED_METRICS
from kvplane.models import TINY_MODELS, PagedDecoder
from kvplane.pipeline.trace import chrome_trace, events_from_dicts, spans, write_trace
from kvplane.serving.messages import AnyMessage, Generate, RequestResult, StatsQuery, WorkerStats
from kvplane.serving.producers.model import ModelSpec
from kvplane.serving.rpc import RpcClient
from kvplane.serving.worker_config import check_transport_secret

NAME = "demo"
HELP = "Serve a tiny model across prefill/decode processes with offload; check token parity."

BLOCK_SIZE = 16
BLOCKS_PER_CHUNK = 2
CHUNK = BLOCK_SIZE * BLOCKS_PER_CHUNK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=TINY_MODELS[0], help="tiny-llama, tiny-deepseek or DIR")
    parser.add_argument("--transport", default="tcp", help="tcp, shm, nixl or mooncake")
    parser.add_argument("--out", default=None, help="write trace.json and timeline.png here")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--seed", type=int, default=0, help="model weights seed")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--step-size", type=int, default=32, help="prefill step (tokens)")
    parser.add_argument("--host-slots", type=int, default=6, help="host tier chunks")
    parser.add_argument(
        "--disk-codec", choices=("raw", "lz4", "zstd", "auto"), default="raw",
        help="the disk tier's codec; lossless only, since the demo checks token parity",
    )  # fmt: skip
    parser.add_argument(
        "--pipelining", choices=("on", "off", "auto"), default="auto",
        help="the prefill worker's KV sending: per slice, after prefill, or (default, as "
        "`kvplane serve`) per request from the calibrated cost model",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=120.0, help="whole-demo deadline (s)")
    parser.add_argument(
        "--concurrency", type=int, default=4,
        help="requests in flight at once (within each wave of the prompt schedule)",
    )  # fmt: skip
    add_attention_flag(parser)
    parser.add_argument(
        "--insecure", action="store_true",
        help="run the processes without a secret (needed by nixl and mooncake, which cannot "
        "authenticate their data plane); by default each run generates one",
    )  # fmt: skip
    c = parser.add_argument_group("chaos (tests)")
    c.add_argument("--chaos-kill", choices=("prefill", "decode"), default=None)
    c.add_argument("--chaos-kill-after", type=int, default=2, help="requests before the kill")


@dataclass(frozen=True, slots=True)
class DemoPrompt:
    """One request; a ``wave`` starts once every request of the earlier waves has ended."""

    request_id: str
    tokens: tuple[int, ...]
    note: str
    wave: int = 0


LOAD_PROMPTS = 8
"""Requests of the last wave: distinct prompts of 33 to 160 tokens, only there to load the
cluster (they look up no stored chunk, and nothing reads the tier after them)."""


def demo_prompts(vocab_size: int, seed: int = 0) -> list[DemoPrompt]:
    """The demo's requests for a 6-chunk host tier (chunks of 32 tokens), in waves: a 4-chunk
    shared prefix is stored; 5 chunks of other prompts, sent together, push 3 of its chunks
    down to disk only; the prefix comes back (1 chunk from host, 3 from disk) and again (all
    from host); then :data:`LOAD_PROMPTS` other prompts, sent together."""
    if vocab_size < 2:
        raise InvalidArgumentError(f"the demo needs a vocabulary of >= 2 tokens, got {vocab_size}")
    rng = np.random.default_rng(seed + 20240901)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(0, vocab_size, n))

    shared = ids(4 * CHUNK)
    story = [
        DemoPrompt("r0", shared + ids(20), "shared prefix, stored", 0),
        DemoPrompt("r1", ids(70), "other prompt", 1),
        DemoPrompt("r2", ids(40), "other prompt", 1),
        DemoPrompt("r3", ids(9), "short prompt", 1),
        DemoPrompt("r4", ids(75), "other prompt", 1),
        DemoPrompt("r5", shared + ids(30), "shared prefix: host + disk", 2),
        DemoPrompt("r6", shared + ids(7), "shared prefix: host", 3),
    ]
    lengths = rng.integers(CHUNK + 1, 5 * CHUNK + 1, LOAD_PROMPTS)
    load = [DemoPrompt(f"r{len(story) + i}", ids(int(n)), "load", 4) for i, n in enumerate(lengths)]
    return story + load


def waves(prompts: list[DemoPrompt]) -> list[list[DemoPrompt]]:
    """``prompts`` grouped by wave, in wave order (each group in the given order)."""
    by_wave: dict[int, list[DemoPrompt]] = {}
    for p in prompts:
        by_wave.setdefault(p.wave, []).append(p)
    return [by_wave[w] for w in sorted(by_wave)]


@dataclass
class DemoResult:
    parity: bool = True
    requests: int = 0
    failures: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    integrity: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    concurrency: int = 1
    scraped: dict[str, list[str]] = field(default_factory=dict)
    """Per process (prefill, decode, router), the seed metric families its ``/metrics``
    showed, scraped once the requests were served."""

    @property
    def ok(self) -> bool:
        """Parity, no failure, balanced pools, and the six seed metrics on every /metrics."""
        six = all(set(SEED_METRICS) <= set(f) for f in self.scraped.values())
        balanced = all(v == "" for v in self.integrity.values())
        return self.parity and not self.failures and balanced and six

    def as_json(self) -> dict[str, Any]:
        return {
            "parity": self.parity and not self.failures,
            "requests": self.requests,
            "offload_hit_chunks": int(self.metrics.get("offload_hit_chunks", 0)),
            "metrics": self.metrics,
            "failures": self.failures,
            "integrity": self.integrity,
            "timings": self.timings,
            "concurrency": self.concurrency,
            "scraped": self.scraped,
        }


def _serve_args(args: argparse.Namespace, role: str, disk: Path, metrics_port: int) -> list[str]:
    common = [
        "--name", role, "--model", args.model, "--seed", str(args.seed),
        "--attention", args.attention, "--metrics-port", str(metrics_port),
        "--transport", args.transport, "--block-size", str(BLOCK_SIZE), "--num-blocks", "256",
        "--num-slots", "16", "--step-size", str(args.step_size), "--heartbeat", "0.2",
        "--lease", "2.0", "--deadline", "20", *(["--insecure"] if args.insecure else []),
    ]  # fmt: skip
    if role == "prefill":
        common += [
            "--offload-host-slots", str(args.host_slots), "--offload-disk", str(disk),
            "--offload-disk-slots", "64", "--offload-disk-codec", args.disk_codec,
            "--blocks-per-chunk", str(BLOCKS_PER_CHUNK),
            "--pipelining", args.pipelining,
        ]  # fmt: skip
    return common


def _wait(fut: Future[AnyMessage], group: ProcessGroup, deadline: float, doing: str) -> AnyMessage:
    while True:
        group.check(doing)
        try:
            return fut.result(timeout=0.1)
        except TimeoutError:
            if time.monotonic() > deadline:
                raise TransferTimeoutError(f"no answer {doing} before the deadline") from None


def run_demo(args: argparse.Namespace, console: Console, work: Path) -> DemoResult:
    """Start the processes, run the prompts, check parity, gather metrics (see module doc)."""
    for name in ("max_new_tokens", "step_size", "host_slots", "concurrency"):
        value = getattr(args, name)
        if value <= 0:
            raise InvalidArgumentError(f"--{name.replace('_', '-')} must be positive, got {value}")
    check_transport_secret(args.transport, not args.insecure)
    started = time.monotonic()
    deadline = started + args.timeout
    spec = ModelSpec(args.model, args.seed, attention=args.attention)
    model = spec.load()  # also validates the checkpoint before any process starts
    prompts = demo_prompts(model.vocab_size, args.seed)
    result = DemoResult(concurrency=args.concurrency)
    group = ProcessGroup(work, None if args.insecure else new_secret())
    clients: list[RpcClient] = []
    ports = {role: free_port() for role in ROLES}
    try:
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("starting workers", total=len(prompts) + 3)
            disk = work / "disk"  # the disk tier's directory
            flags = {r: _serve_args(args, r, disk, ports[r]) for r in ("prefill", "decode")}
            workers = group.start_together(flags, deadline)  # each loads its model meanwhile
            pre, dec = workers["prefill"], workers["decode"]
            bar.advance(task, 2)
            rtr = group.start(
                "router",
                ["--prefill", pre["control"], "--decode", dec["control"], "--timeout", "30",
                 "--metrics-port", str(ports["router"])]
                + (["--insecure"] if args.insecure else []),
                deadline,
            )  # fmt: skip
            bar.advance(task)
            result.timings["startup_s"] = round(time.monotonic() - started, 3)
            router = RpcClient(str(rtr["control"]), timeout_s=30.0, secret=group.secret)
            clients.append(router)
            t_req = time.monotonic()
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # the workers run single-threaded too
            try:
                _serve_waves(
                    args, model, prompts, router=router, group=group, deadline=deadline,
                    result=result, progress=lambda n: bar.update(task, description=n, advance=1),
                )  # fmt: skip
            finally:
                torch.set_num_threads(threads)
            result.timings["requests_s"] = round(time.monotonic() - t_req, 3)
            bar.update(task, description="collecting metrics")
            stats = _settled_stats([pre, dec], group, clients, deadline)
            result.scraped = {role: seed_families(port) for role, port in ports.items()}
        result.integrity = {s.peer_id: s.integrity for s in stats}
        for s in stats:
            if (s.used_blocks, s.used_slots, s.sessions_live, s.requests_live) != (0, 0, 0, 0):
                result.integrity[s.peer_id] = result.integrity[s.peer_id] or (
                    f"still holds {s.used_blocks} blocks, {s.used_slots} slots, "
                    f"{s.sessions_live} sessions"
                )
        events = events_from_dicts(row for s in stats for row in s.timeline)
        result.metrics = summarize({s.peer_id: s.counters for s in stats}, events)
        result.timings["total_s"] = round(time.monotonic() - started, 3)
        if args.out:
            _write_out(Path(args.out), events, result)
        return result
    finally:
        for c in clients:
            c.close()
        group.stop()


def _serve_waves(
    args: argparse.Namespace,
    model: PagedDecoder,
    prompts: list[DemoPrompt],
    *,
    router: RpcClient,
    group: ProcessGroup,
    deadline: float,
    result: DemoResult,
    progress: Callable[[str], object],
) -> None:
    """Send ``prompts`` wave by wave, at most ``--concurrency`` in flight, each answer checked
    against ``model.generate`` in this process (computed while the cluster serves)."""
    sent = 0
    for wave in waves(prompts):
        pending = list(wave)
        flying: deque[tuple[DemoPrompt, Future[AnyMessage]]] = deque()
        while pending or flying:
            while pending and len(flying) < args.concurrency:
                p = pending.pop(0)
                order = Generate(request_id=p.request_id, token_ids=p.tokens,
                                 max_new_tokens=args.max_new_tokens)  # fmt: skip
                flying.append((p, router.call_async(order)))
                if args.chaos_kill and sent == args.chaos_kill_after:
                    group.children[args.chaos_kill].kill()
                sent += 1
            p, fut = flying.popleft()
            want = model.generate(
                p.tokens, args.max_new_tokens, args.step_size, block_size=BLOCK_SIZE
            ).tokens
            got = _wait(fut, group, deadline, f"while serving request {p.request_id}")
            result.requests += 1
            if not isinstance(got, RequestResult) or got.state != "success":
                reason = got.reason if isinstance(got, RequestResult) else repr(got)
                result.failures.append(f"{p.request_id}: {reason}")
            elif tuple(got.tokens) != tuple(want):
                result.parity = False
                result.failures.append(
                    f"{p.request_id}: tokens {list(got.tokens)} != reference {list(want)}"
                )
            progress(f"{p.request_id}: {p.note}")


def _settled_stats(
    workers: list[dict[str, Any]], group: ProcessGroup, clients: list[RpcClient], deadline: float
) -> list[WorkerStats]:
    """Both workers' stats (with timelines) once idle (offload jobs done), or at the deadline."""
    conns = [RpcClient(str(w["control"]), timeout_s=10.0, secret=group.secret) for w in workers]
    clients.extend(conns)
    end = min(deadline, time.monotonic() + 10.0)
    while True:
        stats = []
        for c in conns:
            got = _wait(c.call_async(StatsQuery(timeline=True)), group, deadline, "giving stats")
            if not isinstance(got, WorkerStats):
                raise WorkerDiedError(f"a worker answered {got!r} to a stats query")
            stats.append(got)
        idle = all(
            (s.used_blocks, s.used_slots, s.sessions_live, s.requests_live) == (0, 0, 0, 0)
            and s.integrity == ""
            for s in stats
        )
        if idle or time.monotonic() > end:
            return stats
        time.sleep(0.05)


def _write_out(out: Path, events: list[Any], result: DemoResult) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summary = result.as_json()
    write_trace(out / "trace.json", chrome_trace(events, other=summary))
    done, _instants = spans(events)
    if done:
        title = f"kvplane PD timeline: {result.concurrency} request(s) in flight at most"
        draw_timeline(done, out / "timeline.png", title=title)


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True) if args.json else Console()
    progress = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="kvplane-demo-") as tmp:
        try:
            result = run_demo(args, progress, Path(tmp))
        except WorkerDiedError as exc:
            if args.json:
                print(json.dumps({"parity": False, "requests": 0, "offload_hit_chunks": 0,
                                  "metrics": {}, "error": str(exc)}))  # fmt: skip
            progress.print(f"[red]demo failed:[/red] {exc}", markup=True, highlight=False)
            return 3
    if args.json:
        print(json.dumps(result.as_json()))
        return 0 if result.ok else 1
    console.print(metrics_table(result.metrics, title=f"kvplane demo: {args.model} over "
                                f"{args.transport}"))  # fmt: skip
    for line in result.failures:
        console.print(f"[red]failed[/red] {line}", highlight=False)
    for peer, problem in result.integrity.items():
        if problem:
            console.print(f"[red]integrity[/red] {peer}: {problem}", highlight=False)
    verdict = "[green]PASS[/green]" if result.ok else "[red]FAIL[/red]"
    console.print(
        f"parity: {verdict} — {result.requests} requests, tokens identical to one-process "
        f"model.generate: {result.parity and not result.failures}; "
        f"offload chunk hits: {int(result.metrics.get('offload_hit_chunks', 0))}; "
        f"concurrency {result.concurrency}; {result.timings}"
    )
    for role, families in result.scraped.items():
        missing = sorted(set(SEED_METRICS) - set(families))
        state = f"[red]missing {', '.join(missing)}[/red]" if missing else "all six seed metrics"
        console.print(f"/metrics of {role}: {state}", highlight=False)
    if args.out:
        console.print(
            f"wrote {Path(args.out) / 'trace.json'} and {Path(args.out) / 'timeline.png'}"
        )
    return 0 if result.ok else 1
