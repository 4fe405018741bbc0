"""The proxy's upstream bodies, per mode (pure functions, no sockets)."""

from __future__ import annotations

import json

import pytest

from kvplane.apps.proxy_requests import (
    ClientRequest,
    new_session_id,
    parse_request,
    pipelined_decode_body,
    prefill_body,
    pull_decode_body,
)
from kvplane.errors import InvalidArgumentError
from kvplane.integrations.vllm.pd_params import RecvParams, SendParams, parse_params, prompt_key

PD = "tcp://10.0.0.2:7000"


def parse(body: object, chat: bool = False) -> ClientRequest:
    return parse_request(json.dumps(body).encode(), chat=chat)


@pytest.mark.parametrize(
    ("prompt", "ids"),
    [([5, 6, 7], (5, 6, 7)), ([[5, 6]], (5, 6)), ("hello", None), (["hello"], None)],
)
def test_a_prompt_is_token_ids_only_when_given_as_ints(prompt: object, ids: object) -> None:
    req = parse({"prompt": prompt, "stream": True})
    assert (req.token_ids, req.stream) == (ids, True)


def test_pipelined_decode_params_carry_the_prompt_key_only_for_token_ids() -> None:
    sid = new_session_id()
    ids = pipelined_decode_body(parse({"prompt": [5, 6, 7]}), sid, [PD])["kv_transfer_params"]
    assert ids == {
        "do_remote_prefill": True,
        "kvplane_session": sid,
        "kvplane_pd": PD,
        "num_prompt_tokens": 3,
        "prompt_key": prompt_key([5, 6, 7]),
    }
    assert parse_params(ids) == RecvParams(sid, PD, 3, prompt_key([5, 6, 7]))  # the engine's view
    text = pipelined_decode_body(parse({"prompt": "hi"}), sid, [PD])["kv_transfer_params"]
    assert text == {"do_remote_prefill": True, "kvplane_session": sid, "kvplane_pd": PD}


def test_the_prefill_body_asks_one_unstreamed_token_and_keeps_the_rest() -> None:
    chat = parse({"messages": [], "max_completion_tokens": 9, "stream": True, "n": 1}, chat=True)
    body = prefill_body(chat, "abc")
    assert body == {
        "messages": [],
        "max_completion_tokens": 1,
        "max_tokens": 1,
        "stream": False,
        "n": 1,
        "kv_transfer_params": {"do_remote_decode": True, "kvplane_session": "abc"},
    }
    assert parse_params(body["kv_transfer_params"]) == SendParams("abc")
    assert chat.body["max_completion_tokens"] == 9  # the client's body is not changed


def test_pull_decode_passes_the_params_on_as_returned() -> None:
    req = parse({"prompt": [1, 2]})
    given = {"do_remote_prefill": True, "kvplane_session": "s", "future_key": {"a": 1}}
    assert pull_decode_body(req, given) == {"prompt": [1, 2], "kv_transfer_params": given}
    assert pull_decode_body(req, None) == {"prompt": [1, 2]}


def test_session_ids_are_fresh_32_hex_digits() -> None:
    ids = {new_session_id() for _ in range(100)}
    assert len(ids) == 100 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


@pytest.mark.parametrize(
    ("body", "chat", "message"),
    [
        ({"prompt": []}, False, "'prompt' must be a string or a list of token ids"),
        ({"prompt": [1, True]}, False, "'prompt' must be a string or a list of token ids"),
        ({"prompt": ["a", "b"]}, False,
         "one prompt per request: the proxy picks the engines per prompt"),
        ({"prompt": "a", "stream": "yes"}, False, "'stream' must be true or false, got 'yes'"),
        ({"messages": "hi"}, True, "'messages' must be a list"),
    ],
)  # fmt: skip
def test_bad_client_bodies_are_one_line_errors(body: object, chat: bool, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        parse(body, chat)
    assert str(err.value) == message


def test_pipelined_decode_params_name_every_prefill_rank_at_tp_above_1() -> None:
    sid, ranks = new_session_id(), ["tcp://10.0.0.1:7000", "tcp://10.0.0.1:7001"]
    params = pipelined_decode_body(parse({"prompt": [5, 6]}), sid, ranks)["kv_transfer_params"]
    assert params == {
        "do_remote_prefill": True,
        "kvplane_session": sid,
        "kvplane_pd": ranks[0],
        "kvplane_pd_ranks": ranks,
        "num_prompt_tokens": 2,
        "prompt_key": prompt_key([5, 6]),
    }
    assert parse_params(params) == RecvParams(sid, ranks[0], 2, prompt_key([5, 6]), tuple(ranks))
