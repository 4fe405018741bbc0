"""``PeerProcess.stop`` returns only once the child can run no code."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvplane.testing import peer_process
from kvplane.testing.peer_process import _all_threads_stopped, _recv_scattered


def test_a_running_process_is_not_stopped_and_a_gone_one_is() -> None:
    assert not _all_threads_stopped(os.getpid())  # this thread is running
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert _all_threads_stopped(child.pid)  # reaped: /proc has no entry


def test_a_sigstopped_child_counts_as_stopped_once_it_is() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        end = time.monotonic() + 10.0
        while not _all_threads_stopped(child.pid) and time.monotonic() < end:
            time.sleep(0.001)
        assert _all_threads_stopped(child.pid)
        os.kill(child.pid, signal.SIGCONT)
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("call_pieces", [1, 5, 1024])
def test_the_scattered_raw_sink_lands_each_piece_at_its_offset(
    call_pieces: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sends cut across pieces (7-byte writes into 8-byte pieces) and calls of one to many
    pieces: every byte lands where its piece's offset says, nothing else is written."""
    monkeypatch.setattr(peer_process, "SCATTER_CALL_PIECES", call_pieces)
    block, n = 8, 50
    offsets = np.random.default_rng(3).permutation(n) * block
    buf = bytearray(n * block + 16)
    view = memoryview(buf)
    pieces = [view[o : o + block] for o in offsets.tolist()]
    data = bytes(np.random.default_rng(4).integers(0, 256, n * block, dtype=np.uint8))
    a, b = socket.socketpair()

    def send() -> None:
        for i in range(0, len(data), 7):
            a.sendall(data[i : i + 7])
            time.sleep(0.0005 if i % 56 == 0 else 0)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert _recv_scattered(b, pieces, block)
    finally:
        sender.join()
    expected = bytearray(n * block + 16)
    for i, o in enumerate(offsets.tolist()):
        expected[o : o + block] = data[i * block : (i + 1) * block]
    assert buf == expected
    a.close()
    assert not _recv_scattered(b, pieces, block)  # EOF before the pieces are full
    b.close()


def test_a_scattered_sink_whose_pieces_leave_the_buffer_is_refused_before_the_child() -> None:
    from kvplane.errors import InvalidArgumentError
    from kvplane.testing.peer_process import PeerProcess

    far = PeerProcess.__new__(PeerProcess)  # no child: the refusal comes before any call
    for block, offsets in ((0, [0]), (8, [-8]), (8, [0, 96])):
        with pytest.raises(InvalidArgumentError):
            far.raw_sink(100, 1, block, offsets)
