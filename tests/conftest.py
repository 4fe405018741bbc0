"""Suite-wide test policy.

- ``@pytest.mark.slow`` soak/fuzz runs only with ``KVPLANE_SLOW=1``.
- torch runs single-threaded: the tests use tiny tensors, where intra-op threads only add
  hand-off cost, and CI machines have two shared cores.
- ``redis_url``: the server of ``KVPLANE_TEST_REDIS_URL`` (the test command starts one), else a
  private ``redis-server`` for the session; without a binary or client the remote tests skip,
  saying why. ``redis_namespace``: a namespace unique to the test, emptied before and after.
- Native kernels (``cpu_fused``) are built into a private cache directory for the session
  (unless ``KVPLANE_CACHE_DIR`` is set), so the suite never writes into the user's home and
  always exercises the build once.
- ``start_procs`` / ``stop_procs``: ``kvplane serve`` processes started (or stopped) at once,
  not one after the other: each start imports torch, each stop waits for the process's exit.
- ``tiny_llama``: a random-init Llama checkpoint per shape, saved once for the session (seed 0:
  the same bytes each module would save itself, saved in this process where it can; engines
  only read it).
- Suite-wide helpers live beside this file, importable by name: ``ports_testlib`` (free ports),
  ``qwen2_testlib`` (the tiny Qwen2 mixing window and full layers). ``mixed_qwen2``: that
  model's transformers checkpoint, saved once for the session.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from kvplane.native import CACHE_ENV as _CACHE_ENV
from kvplane.offload.tiers.remote import redis_support
from kvplane.testing.redis_server import LocalRedisServer, redis_server_support

if TYPE_CHECKING:  # imported where used: a broken module fails its tests, not the collection
    from kvplane.testing.cluster import Proc
    from qwen2_testlib import MixedQwen2

# importlib mode puts no test directory on sys.path: this one goes last, so that the suite-wide
# helpers beside this file import by name and nothing installed is shadowed.
sys.path.append(str(Path(__file__).resolve().parent))

_MADE_CACHE = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get(_CACHE_ENV):
        config.stash[_MADE_CACHE] = os.environ[_CACHE_ENV] = tempfile.mkdtemp(
            prefix="kvplane-kernels-"
        )


def pytest_unconfigure(config: pytest.Config) -> None:
    made = config.stash.get(_MADE_CACHE, None)
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
        os.environ.pop(_CACHE_ENV, None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("KVPLANE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="soak/fuzz run: set KVPLANE_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _single_thread_torch() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("KVPLANE_TEST_REDIS_URL")
    reason = redis_support()
    if reason is not None:
        pytest.skip(reason)
    if url:
        yield url
        return
    reason = redis_server_support()
    if reason is not None:
        pytest.skip(f"KVPLANE_TEST_REDIS_URL is not set and {reason}")
    with LocalRedisServer() as server:
        yield server.url


@pytest.fixture
def redis_namespace(request: pytest.FixtureRequest, redis_url: str) -> Iterator[str]:
    """A namespace unique to the test, emptied before and after it."""
    import redis

    ns = "kvtest-" + hashlib.blake2b(request.node.nodeid.encode(), digest_size=6).hexdigest()
    client = redis.Redis.from_url(redis_url)
    names = list(client.scan_iter(match=f"{ns}:*"))
    if names:
        client.delete(*names)
    yield ns
    names = list(client.scan_iter(match=f"{ns}:*"))
    if names:
        client.delete(*names)
    client.close()


def _vllm_transformers_version() -> str | None:
    """The vLLM environment's transformers version (read from its install, no process), or
    None when it cannot be read."""
    from importlib.metadata import distributions

    from kvplane.integrations.vllm.env import vllm_python

    python = vllm_python()
    if python is None:
        return None
    for site in sorted((python.parent.parent / "lib").glob("python*/site-packages")):
        for dist in distributions(name="transformers", path=[str(site)]):
            return str(dist.version)
    return None


def _save_tiny_llama(path: Path, shape: Mapping[str, int]) -> None:
    """Save :func:`~kvplane.integrations.vllm.harness.save_tiny_llama`'s checkpoint in this
    process (this environment's transformers: the same weights, no vLLM-environment process,
    ~5-9 s each), its config files' ``transformers_version`` set to the vLLM environment's:
    the bytes that environment would write. Without transformers here, or that version,
    the vLLM environment saves it (:func:`kvplane.integrations.vllm.env.save_tiny_llama`)."""
    from kvplane.integrations.vllm.env import save_tiny_llama

    there = _vllm_transformers_version()
    try:
        import transformers
    except ImportError:
        there = None
    if there is None:
        save_tiny_llama(path, shape)
        return
    from kvplane.integrations.vllm.harness import save_tiny_llama as save_here

    save_here(path, dict(shape))
    here = f'"transformers_version": "{transformers.__version__}"'
    for name in ("config.json", "generation_config.json"):
        text = (path / name).read_text()
        assert here in text, f"{name} of {path} names no transformers version"
        (path / name).write_text(text.replace(here, f'"transformers_version": "{there}"'))


def _digest(directory: Path) -> dict[str, str]:
    return {
        f.name: hashlib.blake2b(f.read_bytes(), digest_size=16).hexdigest()
        for f in sorted(directory.iterdir())
    }


@pytest.fixture(scope="session")
def tiny_llama(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[Mapping[str, int]], Path]]:
    """``tiny_llama(shape)``: the directory of a random-init Llama checkpoint of ``shape``
    (:func:`~kvplane.integrations.vllm.harness.save_tiny_llama`, seed 0), saved at the first ask
    and shared by every later one (:func:`_save_tiny_llama`: in this process where it can).
    Needs the vLLM environment (call ``require_vllm`` first). Read-only: at the session's end
    every checkpoint must hold the files it was saved with."""
    made: dict[str, tuple[Path, dict[str, str]]] = {}

    def get(shape: Mapping[str, int]) -> Path:
        key = json.dumps(dict(shape), sort_keys=True)
        if key not in made:
            path = tmp_path_factory.mktemp("tiny-llama") / "model"
            _save_tiny_llama(path, shape)
            made[key] = (path, _digest(path))
        return made[key][0]

    yield get
    for key, (path, saved) in made.items():
        assert _digest(path) == saved, f"a test changed the shared checkpoint {key}"


@pytest.fixture(scope="session")
def mixed_qwen2(tmp_path_factory: pytest.TempPathFactory) -> MixedQwen2:
    """The 3-layer :class:`qwen2_testlib.MixedQwen2` checkpoint (sliding, full, sliding; seed
    33), saved once per session; tests only read it."""
    from qwen2_testlib import MixedQwen2

    return MixedQwen2(tmp_path_factory.mktemp("qwen2-mixed"))


def _start_procs(into: list[Proc], *makers: Callable[[], Proc]) -> list[Proc]:
    """Call every maker at once (each starts a process and waits for its announce line); the
    processes in maker order. Each one started is appended to ``into`` (for its caller to
    stop) before the first maker's exception, if any, is re-raised once every maker ended."""
    with ThreadPoolExecutor(len(makers)) as pool:
        futures = [pool.submit(make) for make in makers]
    errors = [f.exception() for f in futures]
    into.extend(f.result() for f, e in zip(futures, errors, strict=True) if e is None)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return [f.result() for f in futures]


def _stop_procs(procs: Sequence[Proc]) -> None:
    """Stop every process still running: SIGTERM to all first, then each one's wait (and
    SIGKILL after 15 s), so their shutdowns overlap."""
    running = [p for p in procs if p.proc.poll() is None]
    for p in running:
        p.proc.terminate()
    for p in running:
        p.stop()


@pytest.fixture(scope="session")
def start_procs() -> Callable[..., list[Proc]]:
    """``start_procs(into, *makers)``: see :func:`_start_procs`."""
    return _start_procs


@pytest.fixture(scope="session")
def stop_procs() -> Callable[[Sequence[Proc]], None]:
    """``stop_procs(procs)``: see :func:`_stop_procs`."""
    return _stop_procs
