"""vLLM's KV cache groups, each one pool of the connector (hybrid KV cache manager on).

Owns :class:`KVGroup` (one group: its index, layers, window rule), :func:`read_groups`
(``kv_cache_config.kv_cache_groups`` read by class name, refusing in one line what the
connector cannot move, with :func:`hybrid_refusal`) and what makes a group its own pool: its
layers' KV tensors (:func:`group_caches`), chunk-key root (:func:`group_root`), lower-tier
places (:func:`group_offload`) and counters (:func:`group_registries`). With one group every
answer is today's (no salt, no suffix). No vLLM import. See ``docs/vllm.md`` ("Sliding
windows and hybrids").
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prometheus_client.metrics_core import Metric

from kvplane.errors import UnsupportedError
from kvplane.integrations.vllm.windows import KVWindow, spec_refusal, spec_window
from kvplane.metrics import PREFIX, MetricsRegistry
from kvplane.offload.config import OffloadConfig
from kvplane.validators import require_int

_GROUP_TAG = b"kvplane/vllm-kv-group/v1"

HMA_OFF = "--disable-hybrid-kv-cache-manager"
"""vLLM's flag that turns its hybrid KV cache manager off (window layers become full)."""


@dataclass(frozen=True, slots=True)
class KVGroup:
    """vLLM KV cache group ``index`` of ``count``: its ``layers`` (names) and ``window``
    (:class:`~.windows.KVWindow` for a ``SlidingWindowSpec`` group, None: every block kept)."""

    index: int
    count: int
    layers: tuple[str, ...]
    window: KVWindow | None = None

    def __post_init__(self) -> None:
        require_int("KVGroup.count", self.count, min=1)
        require_int("KVGroup.index", self.index, min=0, max=self.count - 1)

    @property
    def kind(self) -> str:
        """``"window"`` or ``"full"``."""
        return "full" if self.window is None else "window"


def read_groups(groups: Sequence[Any]) -> tuple[KVGroup, ...]:
    """vLLM's ``kv_cache_groups`` (``layer_names``, ``kv_cache_spec``) as :class:`KVGroup`,
    in vLLM's order (block ids per group come in it). :class:`UnsupportedError` in one line
    for no group or a group of a kind in :data:`~.windows.UNSUPPORTED_SPECS` (naming
    :data:`HMA_OFF` when other groups are attention: vLLM then promotes every window or local
    layer to full attention, one group; a Mamba state cannot be promoted)."""
    if not groups:
        raise UnsupportedError("vLLM gave kvplane's connector no KV cache group")
    for g in groups:
        if bad := spec_refusal(g.kv_cache_spec):
            if len(groups) == 1 or bad == "MambaSpec":
                raise UnsupportedError(
                    f"kvplane's vLLM connector does not support {bad} layers (no kvplane "
                    "path moves their KV; run this model without the connector)"
                )
            raise UnsupportedError(
                f"kvplane's vLLM connector does not support {bad} layers; start vLLM with "
                f"{HMA_OFF} to run them as full attention (every block kept)"
            )
    n = len(groups)
    return tuple(
        KVGroup(i, n, tuple(str(x) for x in g.layer_names), spec_window(g.kv_cache_spec))
        for i, g in enumerate(groups)
    )


def hybrid_refusal(groups: Sequence[KVGroup], events: bool) -> None:
    """:class:`UnsupportedError` in one line for what the connector does not do with several
    groups yet: KV events (``events``)."""
    if len(groups) > 1 and events:
        raise UnsupportedError(
            f"kvplane's vLLM connector does not support KV events with {len(groups)} KV cache "
            f"groups (vLLM's hybrid KV cache manager); start vLLM with {HMA_OFF}"
        )


def group_caches(kv_caches: Mapping[str, torch.Tensor], group: KVGroup) -> dict[str, torch.Tensor]:
    """The KV tensors of ``group``'s layers (all of them with one group). Under the hybrid
    manager the layers of different groups view the same tensors slot by slot: each group's
    block ids are its own, so the group's layers alone are its pool."""
    if group.count == 1:
        return dict(kv_caches)
    missing = [name for name in group.layers if name not in kv_caches]
    if missing:
        raise UnsupportedError(f"KV cache group {group.index}: vLLM registered no {missing[0]!r}")
    return {name: kv_caches[name] for name in group.layers}


def group_root(root: bytes, group: KVGroup) -> bytes:
    """The chunk-key root of ``group``: ``root`` (the engine's) with one group, else salted
    with the group's index, layers and window, so groups never share a chunk key."""
    if group.count == 1:
        return root
    w = group.window
    text = f"{group.index}/{group.count};{','.join(group.layers)};{w}".encode()
    return hashlib.blake2b(_GROUP_TAG + b"\0" + root + text, digest_size=len(root)).digest()


def group_offload(config: OffloadConfig, group: KVGroup) -> OffloadConfig:
    """``config`` with ``group``'s own disk file and Redis namespace (``<path>.g<i>of<n>``,
    ``<namespace>.g<i>of<n>``): groups never share a slot. Unchanged with one group."""
    if group.count == 1:
        return config
    suffix = f"g{group.index}of{group.count}"
    disk = config.disk_path
    return dataclasses.replace(
        config,
        disk_path=None if disk is None else Path(f"{disk}.{suffix}"),
        remote_namespace=f"{config.remote_namespace}.{suffix}",
    )


def group_registries(main: MetricsRegistry, count: int) -> list[MetricsRegistry]:
    """One registry per group: group 0's is ``main`` (its counters keep their names, and
    vLLM's stats read them), group ``i`` > 0 counts in its own, shown in ``main`` as
    ``kvplane_g<i>_<name>``."""
    out = [main]
    for i in range(1, count):
        own = MetricsRegistry()
        main.register(_Renamed(own, f"{PREFIX}g{i}_"))
        out.append(own)
    return out


class _Renamed:
    """A collector showing ``source``'s families with ``prefix`` for ``kvplane_``."""

    def __init__(self, source: MetricsRegistry, prefix: str) -> None:
        self.source = source
        self.prefix = prefix

    def _name(self, name: str) -> str:
        return self.prefix + name.removeprefix(PREFIX)

    def collect(self) -> Iterator[Metric]:
        for family in self.source.registry.collect():
            out = Metric(self._name(family.name), family.documentation, family.type)
            for s in family.samples:
                out.add_sample(self._name(s.name), s.labels, s.value, s.timestamp, s.exemplar)
            yield out
