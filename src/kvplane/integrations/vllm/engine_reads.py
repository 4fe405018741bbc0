"""What the connector reads of the vLLM engine it runs in, beyond the hooks' arguments.

Owns the engine's tensor-parallel size and this worker's rank (:func:`tp_size`,
:func:`tp_rank`), a scheduled request's block ids (:func:`state_block_ids`) and one KV cache
group's layers as a :class:`~.pool.VllmPool` with its engine fingerprint (:func:`group_pool`,
the CPU kernel's ISA included). vLLM is imported inside functions only, where the answer lives
nowhere else; the connector calls these at start-up and per step. Decides nothing.
"""

from __future__ import annotations

import platform
from typing import Any

import torch

from kvplane.errors import ConfigError, UnsupportedError
from kvplane.integrations.vllm.fingerprint import EngineFingerprint, engine_fingerprint
from kvplane.integrations.vllm.groups import HMA_OFF, KVGroup, group_caches
from kvplane.integrations.vllm.kv_shapes import LayerShape, stride_order_from_name
from kvplane.integrations.vllm.pool import VllmPool
from kvplane.integrations.vllm.tp import TPShard


def _isa(dtype: torch.dtype, block_size: int, head_dim: int, cache_dtype: Any) -> str:
    """The CPU attention kernel's ISA (it decides the byte order inside a block)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = str(_get_attn_isa(dtype, block_size, head_dim, str(cache_dtype)))
    return f"{platform.machine()}:{isa}"


def state_block_ids(state: Any, req_id: str) -> Any:
    """A scheduled request's block ids from ``SchedulerOutput.kv_connector_block_state``, or
    None: vLLM 0.30+ resolves any scheduled request (``get_block_ids``); 0.29 snapshots only the
    requests given blocks this step (a ``block_ids`` dict)."""
    if state is None:
        return None
    get = getattr(state, "get_block_ids", None)
    if get is not None:
        return get(req_id)
    return (getattr(state, "block_ids", None) or {}).get(req_id)


def tp_size(vllm_config: Any, config: Any) -> int:
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


def tp_rank(size: int) -> int:
    """This worker's tensor-parallel rank (0 without tensor parallelism)."""
    if size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def group_pool(
    vllm_config: Any,
    kv_caches: dict[str, torch.Tensor],
    group: KVGroup,
    shard: TPShard,
    *,
    vllm_version: str,
    cpu: bool,
) -> tuple[VllmPool, EngineFingerprint]:
    """KV cache group ``group``'s layers of ``kv_caches`` (:func:`~.groups.group_caches`) as
    a :class:`VllmPool` and the engine fingerprint of it (its layout, the CPU kernel's ISA
    when ``cpu``, ``shard``'s rank). :class:`UnsupportedError` from the pool for tensors it
    cannot wrap (with several groups, e.g. pages vLLM padded to one size, naming
    :data:`~.groups.HMA_OFF`)."""
    cache = vllm_config.cache_config
    layout_name = getattr(cache, "kv_cache_layout", None)
    model = vllm_config.model_config
    rope = int(model.hf_text_config.qk_rope_head_dim) if model.use_mla else None
    mine = group_caches(kv_caches, group)
    try:
        pool = VllmPool.from_kv_caches(  # RFC #42082: every backend's layer view is [B,H,N,C]
            mine,
            LayerShape.BHNC,
            mla_rope_dim=rope,
            stride_order=stride_order_from_name(layout_name) if layout_name else None,
        )
    except UnsupportedError as exc:
        if group.count == 1:
            raise
        raise UnsupportedError(
            f"KV cache group {group.index} of {group.count}: {exc}; start vLLM with {HMA_OFF}"
        ) from exc
    layout = pool.layout
    isa = ""
    if cpu:  # GPU kernels: the layout alone orders a block's bytes
        isa = _isa(layout.dtype, layout.block_size, layout.head_dim, cache.cache_dtype)
    block_shape = tuple(next(iter(mine.values())).shape[1:])
    fingerprint = engine_fingerprint(
        vllm_config,
        layout,
        block_shape,
        vllm_version,
        isa,
        tp_rank=shard.rank,
        tp_size=shard.size,
    )
    return pool, fingerprint
