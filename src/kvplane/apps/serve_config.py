"""``kvplane serve``'s flags as config sections: ``--config FILE`` and ``KVPLANE_*`` variables.

Each argument group of a serve role titled with a name of :data:`SECTIONS` is one config
section: flag ``--num-blocks`` of group ``pool`` is also ``[pool] num_blocks`` in the TOML file
and ``KVPLANE_POOL_NUM_BLOCKS`` in the environment; a flag named after its group drops that
prefix (``--offload-disk`` is ``[offload] disk``, ``--hash-seed`` is ``[hash] seed``).
:func:`settle` resolves every section through :func:`kvplane.config.resolve` (flag >
environment > file > default) and writes the values back into the parsed namespace. A file's
``[tune.chunks]`` table (``kvplane tune chunks --write``) becomes ``args.tune_chunks``
(:class:`~kvplane.offload.chunk_cost.TunedChunks`; file only). Owns the flag/field mapping
only: the values' rules live with the objects they configure.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvplane.config import Source, load_toml, resolve
from kvplane.errors import ConfigError
from kvplane.offload.chunk_cost import TunedChunks

SECTIONS = (
    "worker", "pool", "hash", "chunk", "offload", "kv_events", "pd", "model", "synthetic",
    "router", "proxy",
)  # fmt: skip
"""Every section a serve config file may hold (a role ignores the sections of other roles)."""
TUNE = "tune"
"""The table ``kvplane tune`` writes (``[tune.chunks]``); read from the file only."""
_SETTLED = "_serve_settled"


@dataclass(frozen=True, slots=True)
class FlagField:
    """One flag of a section: its argparse ``dest``, its field ``name``, type and default."""

    dest: str
    name: str
    type: Any
    default: Any
    choices: tuple[Any, ...] | None


@dataclass(frozen=True, slots=True)
class Section:
    """One titled argument group: its flags as the fields of a config dataclass."""

    name: str
    fields: tuple[FlagField, ...]

    def config_class(self) -> type[Any]:
        """A frozen dataclass with one field per flag (type, default): what ``resolve`` reads."""
        specs = [(f.name, f.type, _default(f.default)) for f in self.fields]
        return dataclasses.make_dataclass(self.name, specs, frozen=True)


def _default(value: Any) -> Any:
    if isinstance(value, list):  # a list default must be a factory
        return dataclasses.field(default_factory=lambda: list(value))
    return dataclasses.field(default=value)


def _type_of(action: argparse.Action) -> Any:
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return bool
    if isinstance(action, argparse._AppendAction):
        return list[str]
    base: Any = action.type if action.type in (int, float) else str
    return base | None if action.default is None else base


def sectioned(parser: argparse.ArgumentParser) -> tuple[Section, ...]:
    """Record ``parser``'s section groups and make their flags default to ``None`` (so a flag
    that was given is told apart from one left out); :func:`settle` later fills in the rest.
    Mutates ``parser``: its section flags' defaults, and a ``_serve_sections`` default."""
    sections = []
    for group in parser._action_groups:  # argparse keeps no public list of its groups
        if group.title not in SECTIONS:
            continue
        fields = []
        for action in group._group_actions:
            prefix = f"{group.title}_"
            name = action.dest.removeprefix(prefix) if action.dest != group.title else action.dest
            default = [] if isinstance(action, argparse._AppendAction) else action.default
            choices = tuple(action.choices) if action.choices else None
            fields.append(FlagField(action.dest, name, _type_of(action), default, choices))
            action.default = None
        sections.append(Section(group.title, tuple(fields)))
    parser.set_defaults(_serve_sections=tuple(sections))
    return tuple(sections)


def settle(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Resolve every section flag of ``args`` from flag > ``env`` (default ``os.environ``) >
    ``args.config`` (a TOML file) > default, in place; a no-op the second time. ``ConfigError``
    for an unreadable file, an unknown section or key, or a value of the wrong type."""
    if getattr(args, _SETTLED, False):
        return args
    sections: tuple[Section, ...] = getattr(args, "_serve_sections", ())
    path = getattr(args, "config", None)
    file = load_toml(path) if path else {}
    unknown = sorted(set(file) - {*SECTIONS, TUNE})
    if unknown:
        raise ConfigError(
            f"unknown section(s) {unknown} in {path}; known: {[*SECTIONS, 'tune.chunks']}"
        )
    tuned = tune_chunks(file)
    environ = os.environ if env is None else env
    for section in sections:
        flags = {f.name: getattr(args, f.dest, None) for f in section.fields}
        flags = {k: v for k, v in flags.items() if v is not None and v != []}
        value, sources = resolve(
            section.config_class(), section.name, file=file, env=environ, flags=flags
        )
        if (
            tuned is not None
            and section.name == "chunk"
            and sources["blocks_per_chunk"] != Source.DEFAULT
        ):
            tuned = dataclasses.replace(tuned, host_blocks_per_chunk=0)  # a given size wins
        for f in section.fields:
            got = getattr(value, f.name)
            if f.choices is not None and got is not None and got not in f.choices:
                raise ConfigError(
                    f"[{section.name}] {f.name} must be one of {list(f.choices)}, got {got!r}"
                )
            setattr(args, f.dest, got)
    args.tune_chunks = tuned
    setattr(args, _SETTLED, True)
    return args


def tune_chunks(file: Mapping[str, Any]) -> TunedChunks | None:
    """The ``[tune.chunks]`` table of a parsed config file, or ``None`` without one.
    ``ConfigError`` for another table under ``[tune]`` or a bad key or value."""
    table = file.get(TUNE)
    if table is None:
        return None
    if not isinstance(table, Mapping) or set(table) - {"chunks"}:
        got = sorted(table) if isinstance(table, Mapping) else table
        raise ConfigError(f"[tune] may hold only the table [tune.chunks], got {got!r}")
    value, _sources = resolve(TunedChunks, "chunks", file=table, env={})
    return value
