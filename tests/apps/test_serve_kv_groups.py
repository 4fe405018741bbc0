"""``kvplane serve --kv-groups on|off``: the flag, ``[model] kv_groups`` and
``KVPLANE_MODEL_KV_GROUPS`` choose whether a model mixing windows is served with one paged pool
per KV cache group; the default is :class:`ModelSpec`'s; a bad value names the field (#33). The
workers it builds are exercised in ``tests/serving/test_gather_window.py``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvplane.apps.serve_config import settle
from kvplane.cli import build_parser
from kvplane.errors import ConfigError
from kvplane.serving.producers.model import ModelSpec


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_flag_over_env_over_file_over_the_model_specs_default(tmp_path: Path) -> None:
    default = "on" if ModelSpec("tiny-llama").kv_groups else "off"
    assert settle(_args("decode"), {}).kv_groups == default
    path = tmp_path / "c.toml"
    path.write_text('[model]\nkv_groups = "on"\n')
    assert settle(_args("prefill", "--config", str(path)), {}).kv_groups == "on"
    env = {"KVPLANE_MODEL_KV_GROUPS": "off"}
    assert settle(_args("prefill", "--config", str(path)), env).kv_groups == "off"
    assert settle(_args("decode", "--kv-groups", "on"), env).kv_groups == "on"


def test_a_bad_value_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"\[model\] kv_groups must be one of \['on', 'off'\]"):
        settle(_args("decode"), {"KVPLANE_MODEL_KV_GROUPS": "yes"})
