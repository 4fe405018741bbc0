"""``PeerProcess.stop`` returns only once the child can run no code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from kvplane.transports.peer_process import _all_threads_stopped


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
