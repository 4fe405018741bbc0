"""The bodies ``kvplane serve proxy`` sends the prefill and the decode vLLM server.

Owns what a client may send (one JSON object, one prompt, no ``kv_transfer_params`` of its own)
and the PD part of each upstream body, per mode: the prefill request (one token, not streamed,
``do_remote_decode``) and the decode request (the client's own, with the prefill's returned
params in pull mode, or the proxy's session and the prefill engine's PD address in pipelined
mode). Pure functions over JSON values: no sockets, no vLLM. Keys follow
:mod:`kvplane.integrations.vllm.pd_params` (see docs/vllm.md, "PD between two engines").
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvplane.errors import InvalidArgumentError
from kvplane.integrations.vllm.pd_params import SESSION_KEY, address_params, prompt_key
from kvplane.validators import is_int

MODES = ("pull", "pipelined", "direct")
"""Pull: prefill, then decode with the params it returned. Pipelined: decode first, prefill
concurrently, both naming the proxy's session, so each prefill step's KV moves as computed.
Direct: no PD, the client's request as is on one engine (the routing picks which)."""
_CHAT_TOKENIZE = (
    "model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
    "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs",
)  # fmt: skip
"""The chat request's keys vLLM's ``/tokenize`` reads the same way as the chat endpoint."""
PARAMS = "kv_transfer_params"


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """One client request: its JSON ``body`` (unchanged), whether it asked for a stream, and
    its prompt as token ids when it was given so (a completion's ``prompt`` list of ints)."""

    body: Mapping[str, Any]
    stream: bool
    token_ids: tuple[int, ...] | None


def _token_ids(prompt: object) -> tuple[int, ...] | None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list | str):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return tuple(prompt)
    return None


def _check_prompt(body: Mapping[str, Any], chat: bool) -> None:
    if chat:
        if not isinstance(body.get("messages"), list):
            raise InvalidArgumentError("'messages' must be a list")
        return
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _token_ids(prompt) is not None:
        return
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return
    if (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, list | str) for p in prompt)
    ):
        raise InvalidArgumentError("one prompt per request: the proxy picks the engines per prompt")
    raise InvalidArgumentError("'prompt' must be a string or a list of token ids")


def parse_request(raw: bytes, *, chat: bool) -> ClientRequest:
    """The client request in ``raw`` (a ``/v1/completions`` body, or ``/v1/chat/completions``
    when ``chat``). ``InvalidArgumentError`` (one line) for a body that is not a JSON object,
    a batch of prompts, a ``stream`` that is not a bool, or ``kv_transfer_params`` (the
    proxy's own to set)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidArgumentError("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise InvalidArgumentError("the request body must be a JSON object")
    if body.get(PARAMS) is not None:
        raise InvalidArgumentError(f"'{PARAMS}' is set by the proxy, not by clients")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidArgumentError(f"'stream' must be true or false, got {stream!r:.40}")
    _check_prompt(body, chat)
    ids = None if chat else _token_ids(body.get("prompt"))
    return ClientRequest(body, stream, ids)


def tokenize_body(req: ClientRequest, chat: bool) -> dict[str, Any]:
    """The ``/tokenize`` request of ``req``'s prompt (a completion's text, or a chat's messages
    with the keys that shape its template), the request's ``model`` named as the client did."""
    if chat:
        return {k: v for k, v in req.body.items() if k in _CHAT_TOKENIZE}
    prompt = req.body.get("prompt")
    if isinstance(prompt, list):  # a batch of one
        prompt = prompt[0]
    body: dict[str, Any] = {"prompt": prompt}
    for key in ("model", "add_special_tokens"):
        if key in req.body:
            body[key] = req.body[key]
    return body


def new_session_id() -> str:
    """A fresh PD session id (uuid4 hex): both engines name one pipelined transfer by it."""
    return uuid.uuid4().hex


def prefill_body(req: ClientRequest, session_id: str | None = None) -> dict[str, Any]:
    """The prefill server's request: the client's, computing one token, not streamed, asking
    ``do_remote_decode`` (with ``session_id`` in pipelined mode, whose decode request was sent
    first). Limits that would contradict one token (``min_tokens``, ``stream_options``) go."""
    body = {k: v for k, v in req.body.items() if k not in ("stream_options", "min_tokens")}
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    params: dict[str, Any] = {"do_remote_decode": True}
    if session_id is not None:
        params[SESSION_KEY] = session_id
    body[PARAMS] = params
    return body


def pull_decode_body(req: ClientRequest, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The decode server's request in pull mode: the client's, with the ``kv_transfer_params``
    the finished prefill returned, passed on unchanged (none: a prompt too short to move any
    KV; the decode server computes it)."""
    body = dict(req.body)
    if params is not None:
        body[PARAMS] = dict(params)
    return body


def pipelined_decode_body(
    req: ClientRequest, session_id: str, prefill_pd: Sequence[str]
) -> dict[str, Any]:
    """The decode server's request in pipelined mode, sent before the prefill's: the client's,
    receiving session ``session_id`` from the prefill engine's PD endpoints ``prefill_pd`` (one
    per TP rank, in rank order: ``kvplane_pd`` and, at TP > 1, ``kvplane_pd_ranks``); the
    prompt's length and key only when the client gave token ids (the decode engine checks its
    prompt against them; for text the proxy has no tokenizer and the prefill engine checks)."""
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        SESSION_KEY: session_id,
        **address_params(prefill_pd),
    }
    if req.token_ids is not None:
        params["num_prompt_tokens"] = len(req.token_ids)
        params["prompt_key"] = prompt_key(req.token_ids)
    return {**req.body, PARAMS: params}
