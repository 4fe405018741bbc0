"""Prefix offload of a model's KV cache groups: the rules that join one offload per group.

A worker serving KV cache groups keeps one chunk store per group's pool (chunk keys from that
group's block hashes, so each group's hasher; lower tiers in files and namespaces of their own:
:func:`group_tiers`). :func:`common_run` says how many leading chunks
of a prompt every group holds (a window group needs only the chunks its window reads of them, as
a window-only pool skips the rest); :class:`LoadJoin` merges the groups' load results of one
request into one (the prefix that every group loaded). Pure bookkeeping: no tensors, no tiers.
See docs/attention.md, "KV cache groups".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvplane.errors import InvalidArgumentError
from kvplane.ids import RequestId
from kvplane.offload import OffloadConfig
from kvplane.serving.prefix_values import LoadFinished
from kvplane.validators import require_int

Skip = Callable[[int], int]
"""A group's rule: the leading chunks of a ``run``-chunk prefix it does not need."""


def group_tiers(offload: OffloadConfig, group: int) -> OffloadConfig:
    """The tier config of KV cache group ``group`` (1..) beside group 0's ``offload``: the disk
    file ``<disk_path>.group<g>``, the Redis namespace ``<remote_namespace>.group<g>`` (same
    server, mode and replicas): each group's chunks in their own slots and lease."""
    require_int("group", group, min=1)
    path = offload.disk_path
    return dataclasses.replace(
        offload,
        disk_path=None if path is None else Path(f"{path}.group{group}"),
        remote_namespace=f"{offload.remote_namespace}.group{group}",
    )


def common_run(hits: Sequence[Sequence[bool]], skips: Sequence[Skip], limit: int) -> int:
    """The most leading chunks (at most ``limit``) every group holds: ``hits[g][i]`` says
    whether group ``g``'s store holds chunk ``i``, and ``skips[g](run)`` how many leading
    chunks of a ``run``-chunk prefix group ``g`` does not need (its window's; 0 for a group
    with a full layer). 0: no common prefix."""
    if len(hits) != len(skips):
        raise InvalidArgumentError(f"{len(hits)} groups' hits but {len(skips)} skip rules")
    for run in range(min(limit, *(len(h) for h in hits)), 0, -1):
        if all(all(h[skip(run) : run]) for h, skip in zip(hits, skips, strict=True)):
            return run
    return 0


@dataclass(slots=True)
class _Joining:
    """One request's group loads not yet finished, and what the finished ones loaded."""

    waiting: int
    tokens: int
    chunks: int = 0
    failed: int = 0


class LoadJoin:
    """The loads of each request's groups (see the module docstring)."""

    def __init__(self) -> None:
        self._open: dict[RequestId, _Joining] = {}

    def __len__(self) -> int:
        return len(self._open)

    def expect(self, request_id: RequestId, groups: int, tokens: int) -> None:
        """``groups`` loads of ``request_id`` started, of ``tokens`` leading tokens each."""
        if request_id in self._open:
            raise InvalidArgumentError(f"request {request_id!r} already loads its prefix")
        self._open[request_id] = _Joining(groups, tokens)

    def finished(
        self, request_id: RequestId, tokens: int, chunks: int, failed: int
    ) -> LoadFinished | None:
        """One group's load ended with ``tokens`` loaded: the joined result once every group's
        ended (the fewest tokens: a group short of the prefix makes it shorter), else None."""
        joining = self._open.get(request_id)
        if joining is None:
            raise InvalidArgumentError(f"request {request_id!r} loads no prefix")
        joining.waiting -= 1
        joining.tokens = min(joining.tokens, tokens)
        joining.chunks += chunks
        joining.failed += failed
        if joining.waiting:
            return None
        del self._open[request_id]
        return LoadFinished(request_id, joining.tokens, joining.chunks, joining.failed)
