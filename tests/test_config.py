"""Config: validation on construction and the precedence flag > env > file > default."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvplane import validators
from kvplane.config import (
    ChunkConfig,
    HashConfig,
    PoolConfig,
    Source,
    env_name,
    load_toml,
    resolve,
)
from kvplane.errors import ConfigError
from kvplane.validators import MAX_DURATION_S, require_finite_positive


def test_defaults_and_validation() -> None:
    assert PoolConfig() == PoolConfig(num_blocks=1024, block_size=16)
    with pytest.raises(ConfigError, match=r"PoolConfig\.block_size .* got 0"):
        PoolConfig(block_size=0)
    with pytest.raises(ConfigError, match="num_blocks"):
        PoolConfig(num_blocks=True)
    with pytest.raises(ConfigError, match="blocks_per_chunk"):
        ChunkConfig(blocks_per_chunk=-1)
    with pytest.raises(ConfigError, match="seed"):
        HashConfig(seed=-3)


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    path = tmp_path / "kvplane.toml"
    path.write_text("[pool]\nnum_blocks = 64\nblock_size = 32\n")
    file = load_toml(path)
    env = {"KVPLANE_POOL_BLOCK_SIZE": "8", "KVPLANE_POOL_NUM_BLOCKS": "0x80"}
    cfg, src = resolve(PoolConfig, "pool", file=file)
    assert cfg == PoolConfig(64, 32)
    assert src == {"num_blocks": Source.FILE, "block_size": Source.FILE}
    cfg, src = resolve(PoolConfig, "pool", file=file, env=env)
    assert cfg == PoolConfig(128, 8) and src["block_size"] is Source.ENV
    cfg, src = resolve(PoolConfig, "pool", file=file, env=env, flags={"block_size": 4})
    assert cfg == PoolConfig(128, 4)
    assert src == {"num_blocks": Source.ENV, "block_size": Source.FLAG}
    cfg, src = resolve(PoolConfig, "pool", flags={"block_size": None})
    assert cfg == PoolConfig() and set(src.values()) == {Source.DEFAULT}
    assert env_name("pool", "block_size") == "KVPLANE_POOL_BLOCK_SIZE"


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Mixed:
    ratio: float = 0.5
    enabled: bool = False
    name: str = "x"
    where: Path = Path(".")
    color: Color = Color.RED
    limit: int | None = None


def test_string_conversion_by_field_type() -> None:
    env = {
        "KVPLANE_M_RATIO": "0.25",
        "KVPLANE_M_ENABLED": "yes",
        "KVPLANE_M_NAME": "abc",
        "KVPLANE_M_WHERE": "/tmp/x",
        "KVPLANE_M_COLOR": "BLUE",
        "KVPLANE_M_LIMIT": "7",
    }
    cfg, _ = resolve(Mixed, "m", env=env)
    assert cfg == Mixed(0.25, True, "abc", Path("/tmp/x"), Color.BLUE, 7)
    cfg, _ = resolve(Mixed, "m", file={"m": {"ratio": 1}})
    assert cfg.ratio == 1.0 and isinstance(cfg.ratio, float)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"file": {"pool": {"num_blockz": 3}}}, r"unknown key\(s\) \['num_blockz'\]"),
        ({"flags": {"blocksize": 3}}, "unknown flag"),
        ({"env": {"KVPLANE_POOL_BLOCK_SIZE": "many"}}, "KVPLANE_POOL_BLOCK_SIZE"),
        ({"file": {"pool": {"block_size": 2.5}}}, r"\[pool\]\.block_size"),
        ({"file": {"pool": {"block_size": -2}}}, "block_size must be a positive"),
    ],
)
def test_bad_sources_raise_config_error(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve(PoolConfig, "pool", **kwargs)  # type: ignore[arg-type]


def test_an_empty_environment_variable_is_unset() -> None:
    empty = {f"KVPLANE_M_{f.upper()}": "" for f in ("ratio", "enabled", "name", "where", "limit")}
    cfg, src = resolve(Mixed, "m", env=empty, file={"m": {"name": "from-file"}})
    assert cfg == Mixed(name="from-file")  # no Path("") (the working directory), no parse error
    assert src["where"] is Source.DEFAULT and src["name"] is Source.FILE


def test_an_empty_path_from_a_file_or_a_flag_is_refused() -> None:
    for given in ({"file": {"m": {"where": ""}}}, {"flags": {"where": "  "}}):
        with pytest.raises(ConfigError, match="an empty path"):
            resolve(Mixed, "m", **given)  # type: ignore[arg-type]


def test_bad_env_enum_and_bool() -> None:
    with pytest.raises(ConfigError, match="not one of red, blue"):
        resolve(Mixed, "m", env={"KVPLANE_M_COLOR": "green"})
    with pytest.raises(ConfigError, match="not a boolean"):
        resolve(Mixed, "m", env={"KVPLANE_M_ENABLED": "maybe"})


def test_toml_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[pool\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(bad)


def test_unreadable_toml_files_are_one_line_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        load_toml(tmp_path)
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b"[pool]\nnum_blocks = 4 # caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_toml(latin)


@pytest.mark.parametrize("text", ["pool = 3\n", 'pool = "x"\n', "pool = [1, 2]\n"])
def test_a_section_that_is_not_a_table_is_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"section \[pool\] must be a table"):
        resolve(PoolConfig, "pool", file=load_toml(path))


@dataclass(frozen=True)
class Listed:
    names: list[str] = dataclasses.field(default_factory=list)


def test_a_list_of_strings_from_env_file_or_flag() -> None:
    env = {"KVPLANE_L_NAMES": "a, b,,c"}
    assert resolve(Listed, "l", env=env)[0].names == ["a", "b", "c"]
    assert resolve(Listed, "l", file={"l": {"names": ["x"]}})[0].names == ["x"]
    assert resolve(Listed, "l", env=env, flags={"names": ["f"]})[0].names == ["f"]
    with pytest.raises(ConfigError, match=r"\[l\]\.names: expected a list of strings"):
        resolve(Listed, "l", file={"l": {"names": [1]}})


def test_the_duration_check_is_re_exported_from_validators() -> None:
    """Its tests live in tests/test_validators.py; importers of ``kvplane.config`` keep working."""
    assert require_finite_positive is validators.require_finite_positive
    assert MAX_DURATION_S == validators.MAX_DURATION_S == 1e6


@pytest.mark.parametrize(
    ("make", "want"),
    [
        (lambda: PoolConfig(num_blocks=0), "PoolConfig.num_blocks must be a positive int, got 0"),
        (
            lambda: PoolConfig(block_size=True),
            "PoolConfig.block_size must be a positive int, got True",
        ),
        (
            lambda: ChunkConfig(blocks_per_chunk=2.0),
            "ChunkConfig.blocks_per_chunk must be a positive int, got 2.0",
        ),
        (lambda: HashConfig(seed=-3), "HashConfig.seed must be an int >= 0, got -3"),
        (lambda: HashConfig(seed=False), "HashConfig.seed must be an int >= 0, got False"),
    ],
)
def test_the_shared_validators_word_every_refusal(make: object, want: str) -> None:
    with pytest.raises(ConfigError) as err:
        make()  # type: ignore[operator]
    assert str(err.value) == want
    assert HashConfig(seed=0).seed == 0 and PoolConfig(1, 1) == PoolConfig(
        num_blocks=1, block_size=1
    )
