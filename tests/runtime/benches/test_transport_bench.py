"""Pieces of ``kvplane bench transport`` that decide what is compared with what."""

from __future__ import annotations

import os

import pytest

from kvplane.runtime.benches.transport import UCX_TCP, _environ, _tls


def test_environ_sets_then_restores_values_and_absences(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPLANE_TEST_KEEP", "before")
    monkeypatch.delenv("KVPLANE_TEST_NEW", raising=False)
    with _environ({"KVPLANE_TEST_KEEP": "during", "KVPLANE_TEST_NEW": "x"}):
        assert os.environ["KVPLANE_TEST_KEEP"] == "during"
        assert os.environ["KVPLANE_TEST_NEW"] == "x"
    assert os.environ["KVPLANE_TEST_KEEP"] == "before"
    assert "KVPLANE_TEST_NEW" not in os.environ


def test_environ_restores_after_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_TLS", raising=False)
    with pytest.raises(RuntimeError), _environ(UCX_TCP):
        assert os.environ["UCX_TLS"] == "tcp"
        raise RuntimeError("bench failed")
    assert "UCX_TLS" not in os.environ


def test_only_tcp_restricted_nixl_rows_get_a_label() -> None:
    assert _tls({"transport": "nixl", "ucx_tls": "tcp"}) == " (UCX_TLS=tcp)"
    assert _tls({"transport": "nixl", "ucx_tls": "default"}) == ""
    assert _tls({"transport": "tcp"}) == ""
