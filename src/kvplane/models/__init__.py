"""L5 models: tiny Llama/Mistral (sliding window), DeepSeek-V2/V3, Bamba and Granite-4.0-H
(attention + Mamba2) decoders over paged KV and kvplane's attention backends, HF checkpoint
loading, chunked-prefill forward steps and greedy generation.

Start with :func:`load_model`; a serving loop drives :meth:`CausalLM.forward_step`. See
docs/attention.md.
"""

from kvplane.models.bamba import BambaModel
from kvplane.models.bamba_config import BambaConfig, MambaShape
from kvplane.models.base import CausalLM
from kvplane.models.config import (
    SUPPORTED_ARCHITECTURES,
    DeepSeekConfig,
    LlamaConfig,
    ModelConfig,
    MoEConfig,
    config_from_hf,
)
from kvplane.models.decoder import PagedDecoder, StepAttention
from kvplane.models.deepseek import DeepSeekModel, MLAPath
from kvplane.models.generate import (
    GenerationResult,
    PagedContext,
    blocks_needed,
    greedy_generate,
    greedy_token,
    prefill_ranges,
)
from kvplane.models.granite_hybrid import GraniteHybridModel
from kvplane.models.granite_hybrid_config import GraniteHybridConfig
from kvplane.models.hf_fields import Family
from kvplane.models.kv import PagedKVCache
from kvplane.models.llama import LlamaModel
from kvplane.models.loader import (
    TINY_DEEPSEEK,
    TINY_HYBRID,
    TINY_LLAMA,
    TINY_MODELS,
    TINY_SWA,
    build_model,
    load_model,
    save_checkpoint,
    tiny_config,
)
from kvplane.models.recurrent import HybridKVCache, RecurrentState, StateSnapshot
from kvplane.models.rope import RopeSpec, RopeStyle
from kvplane.models.step import StepBatch, StepRequest

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "TINY_DEEPSEEK",
    "TINY_HYBRID",
    "TINY_LLAMA",
    "TINY_MODELS",
    "TINY_SWA",
    "BambaConfig",
    "BambaModel",
    "CausalLM",
    "DeepSeekConfig",
    "DeepSeekModel",
    "Family",
    "GenerationResult",
    "GraniteHybridConfig",
    "GraniteHybridModel",
    "HybridKVCache",
    "LlamaConfig",
    "LlamaModel",
    "MLAPath",
    "MambaShape",
    "MoEConfig",
    "ModelConfig",
    "PagedContext",
    "PagedDecoder",
    "PagedKVCache",
    "RecurrentState",
    "RopeSpec",
    "RopeStyle",
    "StateSnapshot",
    "StepAttention",
    "StepBatch",
    "StepRequest",
    "blocks_needed",
    "build_model",
    "config_from_hf",
    "greedy_generate",
    "greedy_token",
    "load_model",
    "prefill_ranges",
    "save_checkpoint",
    "tiny_config",
]
