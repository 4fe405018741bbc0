"""The engine fingerprint: what must match for a stored chunk's bytes to be usable.

Owns :class:`EngineFingerprint` (whose digest roots the connector's chunk keys, so an
incompatible engine misses instead of reading wrong KV) and the cheap stamps of weights,
adapters and the effective model config. Plain data read by duck typing: no vLLM import, no
hashing of weight bytes. What enters and why: ``docs/vllm.md`` ("The engine fingerprint").
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvplane.errors import InvalidArgumentError
from kvplane.layout import KVLayout, dtype_name
from kvplane.validators import is_int, require_int

_TAG = b"kvplane/vllm-engine-fingerprint/v4"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _stamp(parts: list[str]) -> str:
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=12).hexdigest()


def _file_part(path: Path, name: str) -> str:
    st = path.stat()
    return f"{name}:{st.st_size}:{st.st_mtime_ns}"


def weights_stamp(model: str | Path) -> str:
    """A short digest of a local checkpoint's weight files (name, size, mtime) and config.

    A directory stamps by every weight file (``.safetensors``, ``.bin``, ``.pt``, ``.pth``,
    ``.gguf``) and ``config.json`` in it or its subdirectories, by path relative to it; raises
    :class:`InvalidArgumentError` when it holds none. A regular file (a GGUF model) stamps by
    its own size and mtime, so rewriting it in place changes the stamp. Anything else (a hub
    name) stamps as the name itself: its revision then has to be part of the name for the stamp
    to change with the weights.
    """
    root = Path(model)
    if root.is_file():
        return _stamp([_file_part(root, "file")])
    if not root.is_dir():
        return f"name:{model}"
    parts = [
        _file_part(path, path.relative_to(root).as_posix())
        for path in sorted(root.rglob("*"))
        if (path.suffix in _WEIGHT_SUFFIXES or path.name == "config.json") and path.is_file()
    ]
    if not parts:
        raise InvalidArgumentError(f"model directory {str(root)!r} holds no weight files")
    return _stamp(parts)


def adapter_stamp(path: str | Path) -> str:
    """A short digest of a LoRA adapter's files: every regular file of a directory (relative
    path, size, mtime, subdirectories included), or a file's own size and mtime; anything else
    (a hub name) stamps as ``name:<path>``. A retrained adapter saved under the same path
    therefore stamps differently."""
    root = Path(path)
    if root.is_file():
        return _stamp([_file_part(root, "file")])
    if not root.is_dir():
        return f"name:{path}"
    parts = [
        _file_part(p, p.relative_to(root).as_posix())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    ]
    return _stamp(parts)


def config_stamp(model_config: Any) -> str:
    """A short digest of a vLLM ``ModelConfig``'s KV-relevant facts, read by duck typing.

    Its ``hf_config`` serialised in full with sorted keys (``to_json_string(use_diff=False)``
    where the object has it, else its ``repr``), ``revision``, ``quantization`` and
    ``hf_overrides``; a missing attribute reads as ``None``. Equal configs give equal stamps in
    every process: no ids or addresses enter it. A callable (vLLM accepts a function as
    ``hf_overrides``; its effect is already in the resolved ``hf_config``) stamps as its
    ``module.qualname``. Raises ``InvalidArgumentError`` for a value that is neither plain data
    nor callable and whose ``repr`` names a memory address (``<... at 0x...>``, the default
    ``object.__repr__``): it would give every process a different stamp, so every restart
    would derive new chunk keys and never hit a stored chunk.
    """
    hf = getattr(model_config, "hf_config", None)
    to_json = getattr(hf, "to_json_string", None)
    hf_text = to_json(use_diff=False) if callable(to_json) else _stable_repr(hf, "hf_config")
    parts = [
        f"hf_config={hf_text}",
        f"revision={_stable_repr(getattr(model_config, 'revision', None), 'revision')}",
        f"quantization={_stable_repr(getattr(model_config, 'quantization', None), 'quantization')}",
        f"hf_overrides={_canonical(getattr(model_config, 'hf_overrides', None))}",
    ]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=12).hexdigest()


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _callable_name(value: object) -> str:
    kind = type(value)
    module = getattr(value, "__module__", None) or kind.__module__
    name = getattr(value, "__qualname__", None) or kind.__qualname__
    return f"<callable {module}.{name}>"


def _stable_repr(value: object, what: str) -> str:
    """``repr(value)`` when it is the same in every process, else ``InvalidArgumentError``."""
    if callable(value) and not isinstance(value, type):
        return _callable_name(value)  # a class's repr holds no address
    text = repr(value)
    if _ADDRESS.search(text):
        raise InvalidArgumentError(
            f"config stamp: {what} {text:.80} has no stable form (its repr names a memory "
            "address); give it plain data or a repr without one"
        )
    return text


def _canonical(value: object) -> str:
    """``value`` as JSON of :func:`_plain` data with sorted keys (plain data stamps as before:
    ``json.dumps(value, sort_keys=True)``)."""
    return json.dumps(_plain(value), sort_keys=True)


def _plain(value: object) -> object:
    """JSON-ready data of ``value``: scalars as they are, mappings with str keys as dicts and
    others as ``[key, value]`` pairs sorted by key text (one order whatever the key types or
    insertion order), sequences as lists, a callable as its name, anything else by a
    :func:`_stable_repr` (which refuses an address)."""
    if value is None or isinstance(value, (str, int, float)):
        return value
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _plain(v) for k, v in value.items()}
        pairs = [(_canonical(k), _plain(v)) for k, v in value.items()]
        return [[k, v] for k, v in sorted(pairs, key=lambda kv: kv[0])]
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return _stable_repr(value, "hf_overrides")


@dataclass(frozen=True, slots=True)
class EngineFingerprint:
    """The facts that decide whether two engines' KV blocks are interchangeable byte for byte."""

    vllm_version: str
    isa: str
    """The CPU attention kernel's ISA (it orders the bytes inside a CPU block); empty on GPU
    backends, whose block interiors ``pool_layout`` describes in full."""
    kv_layout: str
    dtype: str
    block_size: int
    block_shape: tuple[int, ...]
    num_layers: int
    model: str
    weights: str
    config: str = ""
    """:func:`config_stamp` of the engine's model config (empty where it is not known)."""
    model_dtype: str = ""
    """The model's compute dtype (vLLM's ``model_config.dtype``, ``--dtype``; empty where it is
    not known): with a quantized KV cache the ``dtype`` field does not show it."""
    tp_rank: int = 0
    tp_size: int = 1
    pool_layout: str = ""
    """The pool :class:`~kvplane.layout.KVLayout`'s fingerprint (hex): kind, heads, dims,
    dtype and memory order, so a GPU backend's layout change is a new key space."""

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers", "tp_size"):
            require_int(f"EngineFingerprint.{name}", getattr(self, name), min=1)
        require_int("EngineFingerprint.tp_rank", self.tp_rank, min=0, max=self.tp_size - 1)
        if not self.block_shape or not all(is_int(d) and d > 0 for d in self.block_shape):
            raise InvalidArgumentError(f"EngineFingerprint.block_shape {self.block_shape}")

    def describe(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def digest(self) -> bytes:
        """16 bytes naming this fingerprint (every field, in a fixed canonical text form)."""
        d = self.describe()
        text = ";".join(f"{k}={d[k]!r}" for k in sorted(d))
        return hashlib.blake2b(_TAG + b"\0" + text.encode(), digest_size=16).digest()


def engine_fingerprint(
    vllm_config: Any,
    layout: KVLayout,
    block_shape: tuple[int, ...],
    vllm_version: str,
    isa: str = "",
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> EngineFingerprint:
    """The fingerprint of an engine whose pool is ``layout`` (per-layer tensors of
    ``block_shape`` past the block dim), read from ``vllm_config`` by duck typing: cache dtype
    and layout name, model, its weights and config stamps. ``isa``: the CPU attention ISA on
    the CPU backend, ``""`` on GPU backends (the layout keys their byte order). ``tp_rank`` of
    ``tp_size``: the worker's tensor-parallel shard (its ``layout`` holds that rank's heads)."""
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    cache_dtype = str(cache.cache_dtype)
    return EngineFingerprint(
        vllm_version=vllm_version,
        isa=isa,
        kv_layout=str(getattr(cache, "kv_cache_layout", "unknown")),
        dtype=f"{dtype_name(layout.dtype)}/{cache_dtype}",
        block_size=layout.block_size,
        block_shape=block_shape,
        num_layers=layout.num_layers,
        model=str(model.model),
        weights=weights_stamp(model.model),
        config=config_stamp(model),
        model_dtype=str(model.dtype),
        pool_layout=layout.fingerprint().hex(),
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
