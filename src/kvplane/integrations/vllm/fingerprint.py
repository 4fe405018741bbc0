"""The engine fingerprint: what must match for a stored chunk's bytes to be usable.

vLLM's CPU attention kernel keeps an ISA-dependent layout inside each block (K transposed,
then V), so a block's bytes mean something only to an engine with the same vLLM release, kernel
ISA, KV dtype, compute dtype (``--dtype``: with an fp8 KV cache the KV dtype alone does not show
it), block size, model (architecture, layers, KV heads, head size, weights) and tensor-parallel
shard. :class:`EngineFingerprint` collects those facts as data; its
:meth:`~EngineFingerprint.digest` roots the connector's chunk-key hash chains (see
:mod:`kvplane.integrations.vllm.keys`). Two engines that differ in any field derive different
keys for the same tokens, so an incompatible store is a miss, never corruption.

The weights enter by a cheap stamp (file names, sizes and modification times of the
checkpoint's weight files, in subdirectories too, or of the one weight file a model given as a
file, such as a GGUF, is), not by hashing gigabytes; rewriting a checkpoint in place therefore
changes the stamp. A LoRA adapter's files are stamped the same way by :func:`adapter_stamp`
(see :mod:`kvplane.integrations.vllm.views`). The model's *effective* configuration enters by
:func:`config_stamp`: the Hugging Face config as the engine resolved it (so ``hf_overrides``
such as a RoPE scaling change, which alter every KV byte without touching the weights or the
model name, change the key), the checkpoint revision and the quantization method. Everything
here is plain data: no vLLM import.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvplane.errors import InvalidArgumentError

_TAG = b"kvplane/vllm-engine-fingerprint/v3"
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

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers", "tp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"EngineFingerprint.{name} must be > 0: {value!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgumentError(
                f"EngineFingerprint.tp_rank {self.tp_rank} not in 0..{self.tp_size - 1}"
            )
        if not self.block_shape or any(d <= 0 for d in self.block_shape):
            raise InvalidArgumentError(f"EngineFingerprint.block_shape {self.block_shape}")

    def describe(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def digest(self) -> bytes:
        """16 bytes naming this fingerprint (every field, in a fixed canonical text form)."""
        d = self.describe()
        text = ";".join(f"{k}={d[k]!r}" for k in sorted(d))
        return hashlib.blake2b(_TAG + b"\0" + text.encode(), digest_size=16).digest()
