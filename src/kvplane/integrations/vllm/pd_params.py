"""The ``kv_transfer_params`` contract of kvplane's PD mode inside vLLM.

Owns parsing and building the per-request dicts that vLLM's proxy flow passes through unchanged:
what a prefill request asks for (``do_remote_decode``), what a finished prefill returns and a
decode request carries (``do_remote_prefill`` with the prefill engine's PD address and the
session id), and the prompt digest both sides agree on. Plain data: no vLLM, no sockets. Every
bad dict is a one-line ``InvalidArgumentError`` naming the key. See docs/vllm.md ("PD").
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvplane.errors import InvalidArgumentError
from kvplane.validators import is_int

SESSION_KEY = "kvplane_session"
"""The session id both engines name one transfer by (the proxy's, or the prefill request id)."""
ADDRESS_KEY = "kvplane_pd"
"""The prefill engine's PD endpoint address (``tcp://host:port``; rank 0's at TP > 1)."""
RANKS_KEY = "kvplane_pd_ranks"
"""Every prefill rank's PD endpoint address in rank order, only when the prefill runs TP > 1."""
MAX_RANKS = 64
_SESSION_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_KEY_RE = re.compile(r"^[0-9a-f]{32}$")
_ADDRESS_RE = re.compile(r"^tcp://[A-Za-z0-9.\-\[\]:]{1,200}:\d{1,5}$")


def prompt_key(token_ids: Sequence[int]) -> str:
    """32 hex digits naming a prompt (BLAKE2b-128 of its token ids as int64 LE).

    The decode side sends it as its ``TransferRequest``'s request id; the prefill side compares
    it with its own prompt's before a byte moves, so KV of another prompt is never delivered.
    """
    data = np.ascontiguousarray(np.asarray(token_ids, dtype=np.int64), dtype="<i8").tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def transferred_tokens(num_prompt_tokens: int, block_size: int, groups: int = 1) -> int:
    """Token slots whose KV moves: every block holding one of the prompt's tokens but its last,
    which the decode engine recomputes (vLLM needs one scheduled token to sample from, as with
    vLLM's NixlConnector), rounded up to whole blocks. The CPU kernel orders the bytes inside a
    block its own way (K transposed, then V), so only whole blocks can be moved; the slots of
    the last block past the prompt are copied too and never read. With several KV cache
    ``groups`` (vLLM's hybrid manager) rounded down instead: the decode engine computes the
    rest, so a window group's window is read from a block-aligned end (the block holding the
    first token it reads on: :func:`~.pd_groups.plan_window`)."""
    n = max(0, num_prompt_tokens - 1)
    if groups > 1:
        return n // block_size * block_size
    return -(-n // block_size) * block_size


@dataclass(frozen=True, slots=True)
class SendParams:
    """A prefill request whose KV goes to a decode engine (``do_remote_decode``).

    ``session_id`` is given by a proxy that orders decode before prefill (pipelined); without
    it the request id names the session and the decode engine pulls after the prefill ends.
    """

    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class RecvParams:
    """A decode request whose prompt KV comes from a prefill engine (``do_remote_prefill``).
    ``rank_addresses``: every prefill rank's endpoint at TP > 1 (``address`` is rank 0's)."""

    session_id: str
    address: str
    num_prompt_tokens: int | None = None
    prompt: str | None = None
    rank_addresses: tuple[str, ...] = ()

    @property
    def prefill_tp(self) -> int:
        """The prefill engine's TP size: how many endpoints the params name."""
        return max(1, len(self.rank_addresses))


def _text(params: Mapping[str, Any], key: str, pattern: re.Pattern[str]) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise InvalidArgumentError(f"kv_transfer_params[{key!r}] is not valid: {value!r:.80}")
    return value


def parse_params(params: object) -> SendParams | RecvParams | None:
    """The PD role ``params`` (a request's ``kv_transfer_params``) asks for, or None.

    A dict that is not kvplane's PD (another connector's keys, or neither flag) is None: the
    request is served locally. Both flags set, or a malformed session id, address or count,
    is an ``InvalidArgumentError``.
    """
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise InvalidArgumentError(f"kv_transfer_params must be a mapping, got {params!r:.80}")
    decode, prefill = params.get("do_remote_decode"), params.get("do_remote_prefill")
    if decode is True and prefill is True:
        raise InvalidArgumentError("kv_transfer_params asks for remote decode and remote prefill")
    if decode is True:
        sid = params.get(SESSION_KEY)
        return SendParams(None if sid is None else _text(params, SESSION_KEY, _SESSION_RE))
    if prefill is not True or ADDRESS_KEY not in params:
        return None
    count = params.get("num_prompt_tokens")
    if count is not None and not (is_int(count) and count >= 1):
        raise InvalidArgumentError(f"kv_transfer_params['num_prompt_tokens'] is {count!r:.40}")
    prompt = params.get("prompt_key")
    if prompt is not None and not (isinstance(prompt, str) and _KEY_RE.fullmatch(prompt)):
        raise InvalidArgumentError(f"kv_transfer_params['prompt_key'] is {prompt!r:.40}")
    address = _text(params, ADDRESS_KEY, _ADDRESS_RE)
    return RecvParams(
        _text(params, SESSION_KEY, _SESSION_RE), address, count, prompt, _ranks(params, address)
    )


def _ranks(params: Mapping[str, Any], address: str) -> tuple[str, ...]:
    """The ``kvplane_pd_ranks`` list (2 to :data:`MAX_RANKS` addresses, rank 0's equal to
    ``kvplane_pd``), or () when absent (a TP 1 prefill)."""
    if RANKS_KEY not in params:
        return ()
    ranks = params[RANKS_KEY]
    ok = isinstance(ranks, list | tuple) and 2 <= len(ranks) <= MAX_RANKS
    if not ok or any(not isinstance(a, str) or not _ADDRESS_RE.fullmatch(a) for a in ranks):
        raise InvalidArgumentError(f"kv_transfer_params[{RANKS_KEY!r}] is not valid: {ranks!r:.80}")
    if ranks[0] != address:
        raise InvalidArgumentError(f"kv_transfer_params[{RANKS_KEY!r}][0] is not {ADDRESS_KEY!r}")
    return tuple(ranks)


def address_params(addresses: Sequence[str]) -> dict[str, Any]:
    """The params naming a prefill engine's PD endpoints (one per rank, in rank order): rank
    0's as ``kvplane_pd``, and all of them as ``kvplane_pd_ranks`` only at TP > 1."""
    if not addresses:
        raise InvalidArgumentError("a prefill engine names at least one PD address")
    out: dict[str, Any] = {ADDRESS_KEY: addresses[0]}
    if len(addresses) > 1:
        out[RANKS_KEY] = list(addresses)
    return out


def decode_params(
    session_id: str, addresses: Sequence[str], token_ids: Sequence[int], engine_id: str
) -> dict[str, Any]:
    """What a finished prefill returns: the decode request's ``kv_transfer_params`` as is
    (``addresses``: the prefill engine's PD endpoints, one per rank; see
    :func:`address_params`)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        SESSION_KEY: session_id,
        **address_params(addresses),
        "remote_engine_id": engine_id,
        "num_prompt_tokens": len(token_ids),
        "prompt_key": prompt_key(token_ids),
    }
