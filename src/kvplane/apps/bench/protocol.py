"""``kvplane bench protocol``: PD control round trips and session setup over zmq on 127.0.0.1.

Reports the endpoint's round trip against a raw zmq REQ/REP ping-pong (alternating batches,
repeated until their paired ratio is stable), the setup time of a minimal session and the rate
of 1,000 concurrent sessions. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time
from typing import Any

import zmq

from kvplane.apps.bench.spread import Row, repeat_until_stable, spread
from kvplane.errors import IncompatiblePeerError
from kvplane.ids import PeerId, RequestId, SessionId, SliceId
from kvplane.pd.actions import Action, Finished, StartSubmit
from kvplane.pd.control_client import ControlClient
from kvplane.pd.endpoint import Endpoint
from kvplane.pd.events import (
    Heartbeat,
    HelloReply,
    LeaseRenew,
    StartTransfer,
    SubmitSkipped,
    SubmitSlice,
)
from kvplane.pd.handshake import PROTOCOL_VERSION, LayoutInfo, PeerProfile
from kvplane.pd.participant import Participant
from kvplane.pd.states import Role, SessionState

NAME = "protocol"
HELP = "PD control protocol: round trips vs raw zmq REQ/REP, session setup, 1,000 sessions."
TARGET_RATIO = 1.5
"""The round trip's target: at most this many raw zmq round trips."""
REPEATS = {True: (5, 12, 10.0), False: (5, 40, 30.0)}
"""Batch pairs by ``quick``: (min_repeats, max_repeats, cap_s)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, default=None, help="concurrent sessions to hold")


def _profile() -> PeerProfile:
    lay = LayoutInfo(
        kind="mla", dtype="bfloat16", layer_ids=tuple(range(61)), total_heads=1, head_start=0,
        head_end=1, head_dim=512, rope_dim=64, block_size=64,
    )  # fmt: skip
    return PeerProfile(protocol_version=PROTOCOL_VERSION, model_id="deepseek-v3", layouts=(lay,))


def _participant(name: str, incarnation: int) -> Participant:
    return Participant(PeerId(name), _profile(), incarnation=incarnation)


def _raw_batch(req: zmq.Socket[bytes], payload: bytes, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        req.send(payload)
        req.recv()
    return (time.perf_counter() - start) / n


def _ours_batch(client: ControlClient, seq0: int, n: int) -> float:
    start = time.perf_counter()
    for seq in range(seq0, seq0 + n):
        client.send(Heartbeat(peer_id="bench-client", seq=seq))
        while True:  # the endpoint also sends its own heartbeats: skip them
            got = client.recv()
            if isinstance(got, LeaseRenew) and got.seq == seq:
                break
    return (time.perf_counter() - start) / n


def _round_trips(quick: bool) -> dict[str, Any]:
    per_batch = 250 if quick else 500
    low, high, cap = REPEATS[quick]
    server = Endpoint(_participant("bench-server", 1))
    server.start()
    client = ControlClient(server.address)
    # like the endpoint and its client, each side owns a context (one zmq I/O thread each)
    server_ctx, client_ctx = zmq.Context(), zmq.Context()
    rep = server_ctx.socket(zmq.REP)
    port = rep.bind_to_random_port("tcp://127.0.0.1")
    req = client_ctx.socket(zmq.REQ)
    req.connect(f"tcp://127.0.0.1:{port}")

    def echo() -> None:
        while (msg := rep.recv()) != b"stop":
            rep.send(msg)
        rep.send(b"")

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    try:
        reply = client.handshake(_participant("bench-client", 2).hello())
        if not isinstance(reply, HelloReply) or not reply.accepted:
            raise IncompatiblePeerError(f"bench handshake refused: {reply!r}")
        payload = b"x" * len(client.codec.encode(Heartbeat(peer_id="bench-client", seq=1)))
        _raw_batch(req, payload, 200)
        _ours_batch(client, 0, 200)
        batches = itertools.count(1)

        def pair() -> tuple[float, float]:
            raw = _raw_batch(req, payload, per_batch)
            return _ours_batch(client, next(batches) * per_batch, per_batch), raw

        ours, raw = repeat_until_stable(
            pair, min_repeats=low, max_repeats=high, cap_s=cap, settle_s=0.0
        )
        dropped = sum(v for k, v in server.snapshot().items() if k.startswith("dropped_"))
    finally:
        req.send(b"stop")
        req.recv()
        thread.join(timeout=2.0)
        req.close(linger=0)
        rep.close(linger=0)
        server_ctx.term()
        client_ctx.term()
        client.close()
        server.close()
    rtt, raw_rtt = statistics.median(ours) * 1e6, statistics.median(raw) * 1e6
    paired = spread(ours, raw, higher_is_better=False)
    row = Row("protocol", "rtt_us_vs_raw_zmq", rtt, "µs", raw_rtt, "raw zmq REQ/REP ping-pong",
              paired, TARGET_RATIO, False)  # fmt: skip
    return {
        "rtt_us": rtt,
        "raw_rtt_us": raw_rtt,
        "ratio": paired.ratio_median,
        "ratio_of_medians": rtt / raw_rtt,
        "frame_bytes": len(payload),
        "round_trips": len(ours) * per_batch,
        "rtt_dropped_frames": dropped,
        "rows": [row.as_dict()],
    }


class _Pd:
    """A prefill and a decode endpoint, connected; the prefill skips every (empty) slice."""

    def __init__(self) -> None:
        self.finished: dict[SessionId, tuple[float, SessionState]] = {}
        self.done = threading.Condition()
        self.prefill = Endpoint(_participant("prefill", 10), on_action=self._prefill_action)
        self.decode = Endpoint(_participant("decode", 1 << 40), on_action=self._decode_action)
        self.prefill.start()
        self.decode.start()
        self.peer = self.decode.connect(self.prefill.address)

    def _prefill_action(self, act: Action) -> None:
        if isinstance(act, StartSubmit):  # nothing to move: the request has no tokens
            self.prefill.receive_local(act.session_id, SubmitSkipped(slice_id=act.slice_id))

    def _decode_action(self, act: Action) -> None:
        if isinstance(act, Finished) and act.role is Role.RECEIVER:
            with self.done:
                self.finished[act.session_id] = (time.perf_counter(), act.state)
                self.done.notify_all()

    def open_senders(self, sids: list[SessionId], submit: bool) -> None:
        def run() -> None:
            for sid in sids:
                self.prefill.open_sender(sid, PeerId("decode"))
                if submit:
                    self.submit(sid)

        self.prefill.call(run)

    def submit(self, sid: SessionId) -> None:
        self.prefill.send(sid, SubmitSlice(slice_id=SliceId(0), is_last=True, start=0, end=0))

    def open_receivers(self, sids: list[SessionId]) -> None:
        start = StartTransfer(
            request_id=RequestId("r"), dst_block_ids=(), prefix_tokens=0, num_tokens=0
        )

        def run() -> None:
            for sid in sids:
                self.decode.open_receiver(sid, self.peer, start)

        self.decode.call(run)

    def submit_all(self, sids: list[SessionId]) -> None:
        def run() -> None:
            for sid in sids:
                self.submit(sid)

        self.prefill.call(run)

    def requested(self, sids: list[SessionId]) -> int:
        """Sender sessions live with their TransferRequest (held at once, waiting for input)."""

        def run() -> int:
            sessions = [self.prefill.participant.session(s) for s in sids]
            return sum(1 for s in sessions if getattr(s, "request", None) is not None)

        return self.prefill.call(run)

    def wait(self, sids: list[SessionId], timeout_s: float = 60.0) -> None:
        with self.done:
            self.done.wait_for(lambda: all(s in self.finished for s in sids), timeout=timeout_s)

    def close(self) -> dict[str, int]:
        counts = {
            **self.prefill.snapshot(),
            **{f"decode_{k}": v for k, v in self.decode.snapshot().items()},
        }
        self.prefill.close()
        self.decode.close()
        return counts


def _sessions(quick: bool, concurrent: int) -> dict[str, Any]:
    pd = _Pd()
    try:
        setups = []
        for i in range(20 if quick else 100):
            sid = SessionId(f"setup-{i}")
            pd.open_senders([sid], submit=True)
            start = time.perf_counter()
            pd.open_receivers([sid])
            pd.wait([sid])
            setups.append(pd.finished[sid][0] - start)
        sids = [SessionId(f"held-{i}") for i in range(concurrent)]
        start = time.perf_counter()
        pd.open_senders(sids, submit=False)
        pd.open_receivers(sids)
        deadline = time.monotonic() + 60.0
        held = 0
        while held < concurrent and time.monotonic() < deadline:
            held = pd.requested(sids)
            time.sleep(0.002)
        pd.submit_all(sids)
        pd.wait(sids)
        elapsed = max(pd.finished[s][0] for s in sids if s in pd.finished) - start
        ok = sum(1 for s in sids if pd.finished.get(s, (0.0, None))[1] is SessionState.SUCCESS)
    finally:
        counts = pd.close()
    dropped = sum(v for k, v in counts.items() if "dropped_" in k)
    return {
        "setup_ms": statistics.median(setups) * 1e3,
        "sessions_per_s": concurrent / elapsed,
        "concurrent_sessions": held,
        "session_errors": (concurrent - ok) + dropped,
    }


def run(quick: bool, args: argparse.Namespace) -> dict[str, object]:
    concurrent = getattr(args, "sessions", None) or (200 if quick else 1000)
    result: dict[str, object] = {}
    result.update(_round_trips(quick))
    result.update(_sessions(quick, concurrent))
    result["target_ratio"] = TARGET_RATIO
    result["meets_target"] = bool(
        float(result["ratio"]) <= TARGET_RATIO  # type: ignore[arg-type]
        and result["concurrent_sessions"] == concurrent
        and result["session_errors"] == 0
    )
    return result
