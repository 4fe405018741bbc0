"""registry: lazy name -> class mapping, construction errors, availability with install hints."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvplane.errors import ConfigError, UnsupportedError
from kvplane.transports.base import Transport
from kvplane.transports.local import LocalTransport
from kvplane.transports.registry import CROSS_PROCESS, TRANSPORTS, available, create_transport


def test_names_and_lazy_classes():
    assert list(TRANSPORTS) == ["local", "shm", "tcp", "nixl", "mooncake"]
    assert TRANSPORTS["local"] is LocalTransport
    assert {"shm", "tcp", "nixl", "mooncake"} == CROSS_PROCESS
    with pytest.raises(KeyError):
        TRANSPORTS["carrier-pigeon"]


def test_import_kvplane_imports_no_engine():
    code = ("import sys, kvplane, kvplane.transports.registry, kvplane.transports.base; "
            "print(any(m.split('.')[0] in ('nixl', 'mooncake') for m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_create_and_refusals():
    t = create_transport("local", agent="made")
    assert isinstance(t, Transport) and t.agent == "made"
    t.close()
    with pytest.raises(ConfigError, match="unknown transport 'udp'; known: local, shm"):
        create_transport("udp")
    with pytest.raises(ConfigError, match="bad options for transport 'local'"):
        create_transport("local", colour="blue")


def test_missing_engine_is_reported_not_raised(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)  # the engine is absent from this interpreter
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    got = available()
    assert got["local"] is None and got["tcp"] is None and got["shm"] is None
    assert got["nixl"].startswith(
        "NIXL is not installed: pip install torch==2.13.0 && pip install nixl"
    )
    assert "pip install mooncake-transfer-engine-non-cuda" in got["mooncake"]
    assert "libibverbs1" in got["mooncake"]
    for name in ("nixl", "mooncake"):
        with pytest.raises(UnsupportedError, match="is not installed"):
            create_transport(name)
        with pytest.raises(UnsupportedError, match="is not installed"):
            TRANSPORTS[name]()
