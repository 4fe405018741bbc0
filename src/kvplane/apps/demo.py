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
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress

from kvplane.apps.demo_procs import ProcessGroup, new_secret
from kvplane.apps.report import draw_timeline, metrics_table, summarize
from kvplane.errors import InvalidArgumentError, TransferTimeoutError, WorkerDiedError
from kvplane.models import TINY_MODELS
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
    parser.add_argument("--timeout", type=float, default=120.0, help="whole-demo deadline (s)")
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
    request_id: str
    tokens: tuple[int, ...]
    note: str


def demo_prompts(vocab_size: int, seed: int = 0) -> list[DemoPrompt]:
    """The demo's requests for a 6-chunk host tier (chunks of 32 tokens): a 4-chunk shared
    prefix is stored, 5 chunks of other prompts push 3 of its chunks down to disk only, then
    the prefix comes back (1 chunk from host, 3 from disk) and again (all from host)."""
    if vocab_size < 2:
        raise InvalidArgumentError(f"the demo needs a vocabulary of >= 2 tokens, got {vocab_size}")
    rng = np.random.default_rng(seed + 20240901)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(0, vocab_size, n))

    shared = ids(4 * CHUNK)
    return [
        DemoPrompt("r0", shared + ids(20), "shared prefix, stored"),
        DemoPrompt("r1", ids(70), "other prompt"),
        DemoPrompt("r2", ids(40), "other prompt"),
        DemoPrompt("r3", ids(9), "short prompt"),
        DemoPrompt("r4", ids(75), "other prompt"),
        DemoPrompt("r5", shared + ids(30), "shared prefix: host + disk"),
        DemoPrompt("r6", shared + ids(7), "shared prefix: host"),
    ]


@dataclass
class DemoResult:
    parity: bool = True
    requests: int = 0
    failures: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    integrity: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.parity and not self.failures and all(v == "" for v in self.integrity.values())

    def as_json(self) -> dict[str, Any]:
        return {
            "parity": self.parity and not self.failures,
            "requests": self.requests,
            "offload_hit_chunks": int(self.metrics.get("offload_hit_chunks", 0)),
            "metrics": self.metrics,
            "failures": self.failures,
            "integrity": self.integrity,
            "timings": self.timings,
        }


def _serve_args(args: argparse.Namespace, role: str, disk: Path) -> list[str]:
    common = [
        "--name", role, "--model", args.model, "--seed", str(args.seed),
        "--transport", args.transport, "--block-size", str(BLOCK_SIZE), "--num-blocks", "256",
        "--num-slots", "16", "--step-size", str(args.step_size), "--heartbeat", "0.2",
        "--lease", "2.0", "--deadline", "20", *(["--insecure"] if args.insecure else []),
    ]  # fmt: skip
    if role == "prefill":
        common += [
            "--offload-host-slots", str(args.host_slots), "--offload-disk", str(disk),
            "--offload-disk-slots", "64", "--blocks-per-chunk", str(BLOCKS_PER_CHUNK),
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
    for name in ("max_new_tokens", "step_size", "host_slots"):
        value = getattr(args, name)
        if value <= 0:
            raise InvalidArgumentError(f"--{name.replace('_', '-')} must be positive, got {value}")
    check_transport_secret(args.transport, not args.insecure)
    started = time.monotonic()
    deadline = started + args.timeout
    spec = ModelSpec(args.model, args.seed)
    model = spec.load()  # also validates the checkpoint before any process starts
    prompts = demo_prompts(model.vocab_size, args.seed)
    result = DemoResult()
    group = ProcessGroup(work, None if args.insecure else new_secret())
    clients: list[RpcClient] = []
    try:
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("starting workers", total=len(prompts) + 3)
            disk = work / "disk"  # the disk tier's directory
            pre = group.start("prefill", _serve_args(args, "prefill", disk), deadline)
            bar.advance(task)
            dec = group.start("decode", _serve_args(args, "decode", disk), deadline)
            bar.advance(task)
            rtr = group.start(
                "router",
                ["--prefill", pre["control"], "--decode", dec["control"], "--timeout", "30"]
                + (["--insecure"] if args.insecure else []),
                deadline,
            )
            bar.advance(task)
            result.timings["startup_s"] = round(time.monotonic() - started, 3)
            router = RpcClient(str(rtr["control"]), timeout_s=30.0, secret=group.secret)
            clients.append(router)
            t_req = time.monotonic()
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # the workers run single-threaded too
            try:
                for i, p in enumerate(prompts):
                    bar.update(task, description=f"{p.request_id}: {p.note}")
                    fut = router.call_async(
                        Generate(request_id=p.request_id, token_ids=p.tokens,
                                 max_new_tokens=args.max_new_tokens)
                    )  # fmt: skip
                    if args.chaos_kill and i == args.chaos_kill_after:
                        group.children[args.chaos_kill].kill()
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
                    bar.advance(task)
            finally:
                torch.set_num_threads(threads)
            result.timings["requests_s"] = round(time.monotonic() - t_req, 3)
            bar.update(task, description="collecting metrics")
            stats = _settled_stats([pre, dec], group, clients, deadline)
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
        draw_timeline(done, out / "timeline.png")


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
        f"{result.timings}"
    )
    if args.out:
        console.print(
            f"wrote {Path(args.out) / 'trace.json'} and {Path(args.out) / 'timeline.png'}"
        )
    return 0 if result.ok else 1
