"""The PD ``kv_transfer_params`` contract: parsing, building, prompt keys, token counts."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvplane.errors import InvalidArgumentError
from kvplane.integrations.vllm.pd_params import (
    ADDRESS_KEY,
    SESSION_KEY,
    RecvParams,
    SendParams,
    decode_params,
    parse_params,
    prompt_key,
    transferred_tokens,
)

ADDR = "tcp://127.0.0.1:5555"
KEY = "0123456789abcdef0123456789abcdef"


def recv(**more: Any) -> dict[str, Any]:
    """A valid decode request's params, with ``more`` on top (``None`` drops a key)."""
    base: dict[str, Any] = {
        "do_remote_prefill": True,
        SESSION_KEY: "s-1",
        ADDRESS_KEY: ADDR,
        "num_prompt_tokens": 10,
        "prompt_key": KEY,
    }
    base.update(more)
    return {k: v for k, v in base.items() if v is not None}


# -- parse_params: what is not kvplane's PD ------------------------------------------------------
@pytest.mark.parametrize(
    "params",
    [
        None,
        {},
        {"do_remote_decode": False},
        {"do_remote_prefill": False, ADDRESS_KEY: ADDR, SESSION_KEY: "s"},
        {"do_remote_decode": "true"},  # only the bool True asks
        {"do_remote_decode": 1},
        # NixlConnector's decode params: no kvplane address, served locally
        {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "e",
            "remote_block_ids": [1, 2],
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
        },
        {"some_other_connector": {"x": 1}},
    ],
)
def test_params_that_are_not_kvplane_pd_are_none(params: object) -> None:
    assert parse_params(params) is None


@pytest.mark.parametrize("params", [[("do_remote_decode", True)], "do_remote_decode", 3])
def test_a_non_mapping_is_refused(params: object) -> None:
    with pytest.raises(InvalidArgumentError, match="must be a mapping"):
        parse_params(params)


def test_both_flags_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="remote decode and remote prefill"):
        parse_params(recv(do_remote_decode=True))


# -- send ----------------------------------------------------------------------------------------
def test_send_without_a_session_names_none() -> None:
    assert parse_params({"do_remote_decode": True}) == SendParams(None)
    assert parse_params({"do_remote_decode": True, "do_remote_prefill": False}) == SendParams()


@pytest.mark.parametrize("sid", ["a", "req-1.2:3_x", "A" * 128])
def test_send_with_a_session(sid: str) -> None:
    assert parse_params({"do_remote_decode": True, SESSION_KEY: sid}) == SendParams(sid)


BAD_SESSIONS = ["", "a b", "a/b", "x" * 129, "é", 7, b"s", ["s"]]


@pytest.mark.parametrize("sid", BAD_SESSIONS)
def test_send_with_a_bad_session_is_refused(sid: object) -> None:
    with pytest.raises(InvalidArgumentError, match=SESSION_KEY) as info:
        parse_params({"do_remote_decode": True, SESSION_KEY: sid})
    assert "\n" not in str(info.value)


# -- recv ----------------------------------------------------------------------------------------
def test_valid_recv() -> None:
    assert parse_params(recv()) == RecvParams("s-1", ADDR, 10, KEY)


def test_recv_count_and_key_are_optional() -> None:
    got = parse_params(recv(num_prompt_tokens=None, prompt_key=None))
    assert got == RecvParams("s-1", ADDR, None, None)


@pytest.mark.parametrize(
    "addr", ["tcp://localhost:1", "tcp://[::1]:65535", "tcp://10.0.0.2:80", "tcp://a-b.c:9"]
)
def test_recv_addresses(addr: str) -> None:
    got = parse_params(recv(**{ADDRESS_KEY: addr}))
    assert isinstance(got, RecvParams) and got.address == addr


@pytest.mark.parametrize("sid", BAD_SESSIONS)
def test_recv_with_a_bad_session_is_refused(sid: object) -> None:
    with pytest.raises(InvalidArgumentError, match=SESSION_KEY):
        parse_params(recv(**{SESSION_KEY: sid}))


def test_recv_without_a_session_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=SESSION_KEY):
        parse_params(recv(**{SESSION_KEY: None}))


@pytest.mark.parametrize(
    "addr",
    [
        "",
        "127.0.0.1:5555",
        "http://127.0.0.1:5555",
        "tcp://127.0.0.1",
        "tcp://127.0.0.1:123456",
        "tcp://a b:1",
        "tcp://h:1/x",
        "ipc:///tmp/x",
        "tcp://" + "h" * 201 + ":1",
        5555,
    ],
)
def test_recv_with_a_bad_address_is_refused(addr: object) -> None:
    with pytest.raises(InvalidArgumentError, match=ADDRESS_KEY) as info:
        parse_params(recv(**{ADDRESS_KEY: addr}))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("count", [0, -1, True, False, "10", 10.0, [10]])
def test_recv_with_a_bad_count_is_refused(count: object) -> None:
    with pytest.raises(InvalidArgumentError, match="num_prompt_tokens"):
        parse_params(recv(num_prompt_tokens=count))


@pytest.mark.parametrize("key", ["", KEY[:-1], KEY + "0", KEY.upper(), "g" * 32, 5, b"0" * 32])
def test_recv_with_a_bad_prompt_key_is_refused(key: object) -> None:
    with pytest.raises(InvalidArgumentError, match="prompt_key"):
        parse_params(recv(prompt_key=key))


@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_decode": True, SESSION_KEY: "s-1\n"},
        recv(**{SESSION_KEY: "s-1\n"}),
        recv(**{ADDRESS_KEY: ADDR + "\n"}),
        recv(prompt_key=KEY + "\n"),
    ],
)
def test_a_trailing_newline_is_refused(params: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        parse_params(params)


# -- decode_params -------------------------------------------------------------------------------
def test_decode_params_round_trip() -> None:
    tokens = [5, 6, 7, 8, 9]
    params = decode_params("sess.9", [ADDR], tokens, "vllm-prefill")
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        SESSION_KEY: "sess.9",
        ADDRESS_KEY: ADDR,
        "remote_engine_id": "vllm-prefill",
        "num_prompt_tokens": 5,
        "prompt_key": prompt_key(tokens),
    }
    assert parse_params(params) == RecvParams("sess.9", ADDR, 5, prompt_key(tokens))


@given(
    st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=64),
    st.from_regex(r"[A-Za-z0-9._:\-]{1,128}", fullmatch=True),
    st.integers(1, 65535),
)
def test_decode_params_round_trip_for_any_prompt(tokens: list[int], sid: str, port: int) -> None:
    addr = f"tcp://127.0.0.1:{port}"
    got = parse_params(decode_params(sid, [addr], tokens, "e"))
    assert got == RecvParams(sid, addr, len(tokens), prompt_key(tokens))


# -- prompt_key ----------------------------------------------------------------------------------
def test_prompt_key_is_blake2b_128_of_int64_le() -> None:
    raw = b"".join(t.to_bytes(8, "little", signed=True) for t in (1, 2, -3))
    assert prompt_key([1, 2, -3]) == hashlib.blake2b(raw, digest_size=16).hexdigest()
    assert prompt_key([]) == hashlib.blake2b(b"", digest_size=16).hexdigest()


def test_prompt_key_depends_on_the_tokens_not_their_container() -> None:
    key = prompt_key([1, 2, 3])
    assert len(key) == 32 and set(key) <= set("0123456789abcdef")
    assert prompt_key((1, 2, 3)) == key
    assert prompt_key(np.array([1, 2, 3], dtype=np.int32)) == key  # type: ignore[arg-type]
    assert prompt_key([3, 2, 1]) != key
    assert prompt_key([1, 2]) != key
    assert prompt_key([1, 2, 3, 0]) != key
    assert prompt_key([256]) != prompt_key([1, 0])  # 8-byte tokens: no byte aliasing


# -- transferred_tokens --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "want"), [(0, 0), (1, 0), (2, 32), (32, 32), (33, 32), (34, 64), (64, 64), (65, 64)]
)
def test_transferred_tokens_at_block_boundaries(n: int, want: int) -> None:
    assert transferred_tokens(n, 32) == want


@given(st.integers(0, 10_000), st.integers(1, 256))
def test_transferred_tokens_are_the_blocks_of_all_but_the_last_token(n: int, bs: int) -> None:
    got = transferred_tokens(n, bs)
    assert got % bs == 0
    assert max(0, n - 1) <= got < max(0, n - 1) + bs
