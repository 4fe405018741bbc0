"""The processes ``kvplane bench routing`` replays against: 2 prefill and 2 decode ``kvplane
serve`` workers of the tiny model (prefix offload with KV events on the prefill side), and
one ``kvplane serve router`` process per policy, all sharing one secret.

:class:`RoutingCluster` starts the workers once; :meth:`RoutingCluster.router` starts a router
with a policy (stopped on :meth:`PolicyRouter.close`); :meth:`PolicyRouter.replay` sends
requests at given times and returns each one's TTFT. Owns the processes it starts; computes no
figures (:mod:`.routing` does).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from kvplane.apps.demo_procs import Child, ProcessGroup, new_secret
from kvplane.errors import KVPlaneError, TransferTimeoutError
from kvplane.serving.messages import AnyMessage, Generate, RequestResult, StatsQuery, WorkerStats
from kvplane.serving.rpc import RpcClient
from kvplane.validators import require_int

MODEL = "tiny-llama"
BLOCK_SIZE = 16
BLOCKS_PER_CHUNK = 2
START_TIMEOUT_S = 120.0
"""Seconds the processes may take to announce themselves (five start together on a loaded
2-core host, each importing torch)."""
REQUEST_TIMEOUT_S = 120.0
"""Seconds a replay waits for its last answer after its last send."""
HIT_PREFIX = "offload_hit_chunks_"
"""The prefill workers' counters of chunks loaded from an offload tier, one per tier."""


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """The workers' shape: host-tier ``host_slots`` (chunks) per prefill worker, KV pool
    ``num_blocks`` per worker, the prefill ``step`` (tokens)."""

    host_slots: int
    num_blocks: int
    step: int

    def __post_init__(self) -> None:
        require_int("ClusterSpec.host_slots", self.host_slots, min=1)
        require_int("ClusterSpec.num_blocks", self.num_blocks, min=1)
        require_int("ClusterSpec.step", self.step, min=1)


def _worker_args(name: str, spec: ClusterSpec, prefill: bool) -> list[str]:
    args = [
        "--name", name, "--model", MODEL, "--seed", "0", "--transport", "tcp",
        "--block-size", str(BLOCK_SIZE), "--num-blocks", str(spec.num_blocks),
        "--num-slots", "16", "--step-size", str(spec.step), "--slice-timeout", "60",
        "--deadline", "120", "--heartbeat", "1", "--lease", "10",
    ]  # fmt: skip
    if prefill:
        args += ["--offload-host-slots", str(spec.host_slots), "--kv-events",
                 "--blocks-per-chunk", str(BLOCKS_PER_CHUNK)]  # fmt: skip
    return args


@dataclass(frozen=True, slots=True)
class Served:
    """One replayed request: its TTFT (send to first token ready on the decode worker), ms."""

    request_id: str
    ttft_ms: float


class PolicyRouter:
    """A ``kvplane serve router --policy POLICY`` process and a client of it."""

    def __init__(self, group: ProcessGroup, work: Path, addresses: dict[str, str], policy: str):
        work.mkdir(parents=True, exist_ok=True)
        args = ["--policy", policy, "--timeout", "60", "--request-deadline", "120",
                "--refresh", "1"]  # fmt: skip
        for name, address in addresses.items():
            args += [f"--{'prefill' if name.startswith('p') else 'decode'}", address]
        self.group, self.key, self.policy = group, f"router-{policy}", policy
        self.child = Child("router", args, work, group.secret)
        group.children[self.key] = self.child
        info = self.child.announce(time.monotonic() + START_TIMEOUT_S)
        self.client = RpcClient(str(info["control"]), timeout_s=60.0, secret=group.secret)

    def _stats(self, *, timeline: bool = False) -> WorkerStats:
        """The workers' stats as the router aggregates them (counters summed)."""
        got = self.client.call(StatsQuery(timeline=timeline))
        if not isinstance(got, WorkerStats):
            raise KVPlaneError(f"router stats: unexpected reply {got!r:.200}")
        return got

    def hit_chunks(self) -> int:
        """Chunks the prefill workers loaded from their offload tiers so far (summed)."""
        got = self._stats()
        return sum(v for k, v in got.counters.items() if k.startswith(HIT_PREFIX))

    def replay(
        self, prompts: Sequence[Sequence[int]], at_s: Sequence[float], tag: str
    ) -> list[Served]:
        """Send prompt ``i`` at ``at_s[i]`` seconds from now (open loop: never waiting for an
        answer), then wait for every answer; ``KVPlaneError`` when one did not succeed."""
        sent: list[tuple[str, float, Future[AnyMessage]]] = []
        t0 = time.monotonic()
        for i, (tokens, at) in enumerate(zip(prompts, at_s, strict=True)):
            delay = t0 + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            rid = f"{tag}{i}"
            began = time.monotonic()
            sent.append((rid, began, self.client.call_async(Generate(
                request_id=rid, token_ids=tuple(tokens), max_new_tokens=1,
            ))))  # fmt: skip
        out = []
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        for rid, began, fut in sent:
            try:
                res = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise TransferTimeoutError(f"bench routing: {rid} unanswered") from None
            if not isinstance(res, RequestResult) or res.state != "success":
                raise KVPlaneError(f"bench routing: {rid} ended {res!r:.300}")
            out.append(Served(rid, (res.ready_at - began) * 1e3))
        self.group.check("replaying the trace")
        return out

    def prefill_of(self, request_ids: Sequence[str]) -> list[str | None]:
        """The prefill worker (its name) each request went to, from the workers' timelines
        (their ``order`` events); None where the event is missing (the timeline is bounded)."""
        got = self._stats(timeline=True)
        wanted = set(request_ids)
        where = {
            str(e["request_id"]): str(e["worker"])
            for e in got.timeline
            if e.get("mark") == "order"
            and e.get("request_id") in wanted
            and str(e.get("worker", "")).startswith("p")
        }
        return [where.get(rid) for rid in request_ids]

    def serve_serially(self, prompts: Sequence[Sequence[int]], tag: str) -> list[Served]:
        """Send each prompt once the one before it was answered (closed loop)."""
        return [self.replay([p], [0.0], f"{tag}{i}.")[0] for i, p in enumerate(prompts)]

    def close(self) -> None:
        self.client.close()
        self.child.stop()
        self.group.children.pop(self.key, None)


class RoutingCluster:
    """The four workers (see the module docstring); :meth:`close` stops every process."""

    def __init__(self, work: Path, spec: ClusterSpec) -> None:
        self.work = work
        self.group = ProcessGroup(work, new_secret())
        self.addresses: dict[str, str] = {}
        try:
            for name in ("p0", "p1", "d0", "d1"):
                sub = work / name
                sub.mkdir(parents=True, exist_ok=True)
                role = "prefill" if name.startswith("p") else "decode"
                args = _worker_args(name, spec, role == "prefill")
                self.group.children[name] = Child(role, args, sub, self.group.secret)
            deadline = time.monotonic() + START_TIMEOUT_S
            for name in ("p0", "p1", "d0", "d1"):
                info = self.group.children[name].announce(deadline)
                self.addresses[name] = str(info["control"])
        except BaseException:
            self.group.stop()
            raise

    def router(self, policy: str) -> PolicyRouter:
        """A router process with ``policy`` over the four workers (its own log directory)."""
        return PolicyRouter(self.group, self.work / f"router-{policy}", self.addresses, policy)

    def close(self) -> None:
        """Stop every process: all are told at once, then each is waited for."""
        for child in self.group.children.values():
            if child.alive():
                child.proc.terminate()
        self.group.stop()
