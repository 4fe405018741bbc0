"""The KV bytes a simulated token costs, from a :class:`~kvplane.layout.KVLayout`.

A model is GQA (``layers``, ``kv_heads``, ``head_dim``), MLA (``layers``, ``latent_dim``,
``rope_dim``) or an HF ``config.json`` read by :mod:`kvplane.models.config`. The layout's own
byte rule sizes a token; tensor parallelism decides what a worker holds and moves: GQA heads are
split across ranks (each rank at least one head, so fewer heads than ranks are replicated) and
MLA's latent is whole on every rank. Must not import serving or pipeline.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvplane.errors import ConfigError, KVPlaneError, LayoutError
from kvplane.layout import KVLayout, dtype_from_name
from kvplane.transfer.resharding import tp_head_range
from kvplane.validators import require_int


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """Bytes per token: ``logical`` once per model, ``held`` summed over one worker's ``tp``
    ranks (``held / logical`` is the TP transfer amplification, 1.0 when heads split evenly)."""

    logical_bytes_per_token: int
    held_bytes_per_token: int
    describe: str

    def __post_init__(self) -> None:
        require_int(
            "logical bytes per token", self.logical_bytes_per_token, min=1, error=ConfigError
        )
        require_int("held bytes per token", self.held_bytes_per_token, min=1, error=ConfigError)


def _layout_bytes(layout: KVLayout) -> int:
    return layout.num_layers * layout.bytes_per_token_per_layer


def gqa_geometry(layers: int, kv_heads: int, head_dim: int, dtype: str, tp: int) -> KVGeometry:
    """K and V of ``kv_heads`` heads; ``ConfigError`` unless ``tp`` divides the heads or the
    heads divide ``tp`` (how engines shard them: :func:`.resharding.tp_head_range`)."""
    try:
        heads = tp_head_range(kv_heads, tp, 0)
    except LayoutError:
        raise ConfigError(
            f"[model] kv_heads {kv_heads} and [cluster] tp {tp}: one must divide the other"
        ) from None
    try:
        full = KVLayout.gqa(
            num_blocks=1, block_size=1, num_layers=layers, kv_heads=kv_heads, head_dim=head_dim,
            dtype=dtype_from_name(dtype),
        )  # fmt: skip
        rank = KVLayout.gqa(
            num_blocks=1, block_size=1, num_layers=layers, kv_heads=kv_heads, head_dim=head_dim,
            dtype=dtype_from_name(dtype), head_range=heads,
        )  # fmt: skip
    except KVPlaneError as exc:
        raise ConfigError(f"[model]: {exc}") from None
    return KVGeometry(
        _layout_bytes(full), tp * _layout_bytes(rank), f"GQA {layers}x{kv_heads}x{head_dim} {dtype}"
    )


def mla_geometry(layers: int, latent_dim: int, rope_dim: int, dtype: str, tp: int) -> KVGeometry:
    """MLA's packed latent ``c_kv ‖ k_pe``, whole on each of ``tp`` ranks."""
    try:
        layout = KVLayout.mla(
            num_blocks=1, block_size=1, num_layers=layers, latent_dim=latent_dim,
            rope_dim=rope_dim, dtype=dtype_from_name(dtype),
        )  # fmt: skip
    except KVPlaneError as exc:
        raise ConfigError(f"[model]: {exc}") from None
    one = _layout_bytes(layout)
    return KVGeometry(one, tp * one, f"MLA {layers}x({latent_dim}+{rope_dim}) {dtype}")


def hf_geometry(path: Path, dtype: str, tp: int) -> KVGeometry:
    """The geometry of an HF ``config.json`` (Llama or DeepSeek-V2/V3 families)."""
    from kvplane.models.config import DeepSeekConfig, config_from_hf

    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        config = config_from_hf(raw)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"[model] hf_config {str(path)!r}: {exc}") from None
    if isinstance(config, DeepSeekConfig):
        return mla_geometry(
            config.num_layers, config.kv_lora_rank, config.qk_rope_head_dim, dtype, tp
        )
    return gqa_geometry(config.num_layers, config.num_kv_heads, config.head_dim, dtype, tp)


def model_geometry(table: Mapping[str, Any], tp: int, base: Path) -> KVGeometry:
    """The ``[model]`` section as a geometry; ``hf_config`` is relative to ``base`` (the cluster
    file's folder). ``ConfigError`` names the first missing or bad key."""
    dtype = table.get("dtype", "bfloat16")
    if not isinstance(dtype, str):
        raise ConfigError(f"[model] dtype must be a dtype name such as 'bfloat16', got {dtype!r}")
    try:
        dtype_from_name(dtype)
    except KVPlaneError as exc:
        raise ConfigError(f"[model] dtype: {exc}") from None
    if "hf_config" in table:
        extra = sorted(set(table) - {"hf_config", "dtype"})
        if extra:
            raise ConfigError(f"[model] hf_config excludes the keys {extra}")
        hf = table["hf_config"]
        if not isinstance(hf, str):
            raise ConfigError(f"[model] hf_config must be a path, got {hf!r}")
        return hf_geometry(base / hf, dtype, tp)
    kind = table.get("kind")
    needed = {
        "gqa": ("layers", "kv_heads", "head_dim"),
        "mla": ("layers", "latent_dim", "rope_dim"),
    }
    if kind not in needed:
        raise ConfigError(f"[model] kind must be gqa or mla (or give hf_config), got {kind!r}")
    keys = needed[kind]
    extra = sorted(set(table) - {"kind", "dtype", *keys})
    if extra:
        raise ConfigError(f"[model] kind {kind} does not take the keys {extra}")
    dims = []
    for key in keys:
        if key not in table:
            raise ConfigError(f"[model] {key} is missing (kind {kind} needs {', '.join(keys)})")
        dims.append(require_int(f"[model] {key}", table[key], min=1, error=ConfigError))
    build = gqa_geometry if kind == "gqa" else mla_geometry
    return build(dims[0], dims[1], dims[2], dtype, tp)
