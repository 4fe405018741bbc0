"""What the connector reads of a vLLM request, as plain functions testable without vLLM.

Owns :func:`request_view` (a vLLM ``Request``, read by duck typing, as the scheduler side's
:class:`~.request_state.RequestView`: eligible, readable, extra keys), :func:`pd_request` (its PD
params) and :func:`lora_identity` (stamps an adapter once per process). Reads requests, never
changes them; no vLLM import. The rules: ``docs/vllm.md`` ("Request views").
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

from kvplane.errors import InvalidArgumentError
from kvplane.integrations.vllm.fingerprint import adapter_stamp
from kvplane.integrations.vllm.keys import LoraIdentity, request_extra_keys
from kvplane.integrations.vllm.pd_params import parse_params
from kvplane.integrations.vllm.pd_scheduler import PDRequest
from kvplane.integrations.vllm.request_state import RequestView

log = logging.getLogger(__name__)


@lru_cache(maxsize=1024)
def _adapter(name: str, int_id: int, path: str) -> LoraIdentity:
    return LoraIdentity(name, int_id, adapter_stamp(path) if path else "")


def lora_identity(lora_request: Any) -> LoraIdentity | None:
    """The identity of a vLLM ``LoRARequest`` (``lora_name``, ``lora_int_id``, ``lora_path``),
    or ``None`` without one.

    The adapter's files are stamped once per process per ``(name, id, path)``: vLLM loads an
    adapter once per id, so the KV a running engine computes comes from the files as they were
    then; a restarted engine stamps them afresh.
    """
    if lora_request is None:
        return None
    path = getattr(lora_request, "lora_path", None)
    return _adapter(
        str(lora_request.lora_name),
        int(lora_request.lora_int_id),
        "" if path is None else str(path),
    )


def request_view(request: Any) -> RequestView:
    """The :class:`RequestView` of a vLLM ``Request`` (see the module docstring)."""
    eligible = (
        request.prompt_token_ids is not None
        and getattr(request, "prompt_is_token_ids", None) is None
        and not request.mm_features
    )
    return RequestView(
        req_id=request.request_id,
        token_ids=request.all_token_ids,
        extra_keys=request_extra_keys(lora_identity(request.lora_request), request.cache_salt),
        eligible=eligible,
        readable=not getattr(request, "skip_reading_prefix_cache", False),
    )


def pd_request(request: Any) -> PDRequest | None:
    """The request's PD part (its ``kv_transfer_params``), or None: served locally. Params
    that are not valid are logged and served locally too: a bad proxy never stops the engine."""
    try:
        params = parse_params(getattr(request, "kv_transfer_params", None))
    except InvalidArgumentError as exc:
        log.warning("kvplane: request %s is served locally: %s", request.request_id, exc)
        return None
    if params is None or request.prompt_token_ids is None:
        return None
    return PDRequest(request.request_id, request.prompt_token_ids, params)
