"""Building models: ``load_model(DIR | "tiny-llama" | "tiny-deepseek" | "tiny-swa" | ...)``,
and back.

The family registry, the embedded tiny configs with seeded weights (nothing downloaded), and
:func:`save_checkpoint` in the HF format. See docs/attention.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Unpack

import torch

from kvplane.errors import CheckpointError, InvalidArgumentError
from kvplane.models.bamba import BambaModel
from kvplane.models.bamba_config import BambaConfig, MambaShape
from kvplane.models.config import (
    DEEPSEEK_V3,
    MISTRAL,
    DeepSeekConfig,
    LlamaConfig,
    ModelConfig,
    MoEConfig,
    config_from_hf,
)
from kvplane.models.decoder import DecoderOptions, PagedDecoder
from kvplane.models.deepseek import DeepSeekModel, MLAPath
from kvplane.models.granite_hybrid import GraniteHybridModel
from kvplane.models.hf_fields import Family
from kvplane.models.llama import LlamaModel
from kvplane.models.safetensors_io import write_safetensors
from kvplane.models.weights import (
    CheckpointTensors,
    RandomTensors,
    TensorSource,
    WeightKind,
    read_checkpoint_dir,
)

TINY_LLAMA = "tiny-llama"
TINY_DEEPSEEK = "tiny-deepseek"
TINY_SWA = "tiny-swa"
TINY_HYBRID = "tiny-hybrid"
TINY_MODELS = (TINY_LLAMA, TINY_DEEPSEEK, TINY_SWA, TINY_HYBRID)

Builder = Callable[..., PagedDecoder]


def tiny_config(name: str) -> ModelConfig:
    """The embedded config named ``name`` (one of :data:`TINY_MODELS`)."""
    if name == TINY_LLAMA:
        return LlamaConfig(
            vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=4096,
        )  # fmt: skip
    if name == TINY_SWA:
        return LlamaConfig(
            vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=4096,
            architecture=MISTRAL, sliding_window=16,
        )  # fmt: skip
    if name == TINY_HYBRID:
        return BambaConfig(
            vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=4,
            num_heads=4, num_kv_heads=2, attn_layer_indices=(1,),
            mamba=MambaShape(num_heads=8, head_dim=32, num_groups=1, state_size=16,
                             conv_kernel=4),
            max_position_embeddings=4096,
        )  # fmt: skip
    if name == TINY_DEEPSEEK:
        moe = MoEConfig(
            num_experts=4, experts_per_token=2, intermediate_size=64, num_shared_experts=1,
            routed_scaling_factor=2.5, scoring="sigmoid", topk_method="noaux_tc", num_groups=1,
            topk_groups=1, norm_topk_prob=True, first_k_dense_replace=1,
        )  # fmt: skip
        return DeepSeekConfig(
            architecture=DEEPSEEK_V3, vocab_size=1024, hidden_size=128, intermediate_size=256,
            num_layers=2, num_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
            qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=4096, moe=moe,
        )  # fmt: skip
    raise InvalidArgumentError(f"no embedded model {name!r}; embedded: {', '.join(TINY_MODELS)}")


def family_builders() -> dict[Family, Builder]:
    """The registry: which model class serves each config family."""
    return {
        Family.LLAMA: LlamaModel, Family.DEEPSEEK: DeepSeekModel, Family.BAMBA: BambaModel,
        Family.GRANITE_HYBRID: GraniteHybridModel,
    }  # fmt: skip


def build_model(
    config: ModelConfig,
    src: TensorSource,
    *,
    mla_path: MLAPath = MLAPath.AUTO,
    **options: Unpack[DecoderOptions],
) -> PagedDecoder:
    """The model of ``config``'s family with weights from ``src``; ``mla_path`` applies to the
    DeepSeek family only (``InvalidArgumentError`` otherwise)."""
    kwargs: dict[str, Any] = dict(options)
    if config.family is Family.DEEPSEEK:
        kwargs["mla_path"] = mla_path
    elif mla_path is not MLAPath.AUTO:
        raise InvalidArgumentError(
            f"mla_path applies to DeepSeek models, not {config.architecture}"
        )
    return family_builders()[config.family](config, src, **kwargs)


def load_model(
    source: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    mla_path: MLAPath = MLAPath.AUTO,
    **options: Unpack[DecoderOptions],
) -> PagedDecoder:
    """A tiny embedded model by name (weights seeded by ``seed``) or a checkpoint directory.

    Raises :class:`~kvplane.errors.CheckpointError` naming the problem for a missing directory
    or file, an unsupported architecture, or missing, mis-shaped or unused tensors.
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise InvalidArgumentError(f"model dtype must be float32, bfloat16 or float16, got {dtype}")
    if isinstance(source, str) and source in TINY_MODELS:
        src: TensorSource = RandomTensors(seed, dtype, device)
        return build_model(tiny_config(source), src, mla_path=mla_path, **options)
    if isinstance(source, str) and not Path(source).exists() and "/" not in source:
        raise CheckpointError(
            f"{source!r} is neither an embedded model ({', '.join(TINY_MODELS)}) nor a directory"
        )
    raw, files = read_checkpoint_dir(source)
    config = config_from_hf(raw)
    src = CheckpointTensors(files, config.num_layers, dtype, device)
    return build_model(config, src, mla_path=mla_path, **options)


class _Recorder:
    """A tensor source that records what it hands out (for :func:`save_checkpoint`)."""

    def __init__(self, inner: TensorSource) -> None:
        self.inner = inner
        self.taken: dict[str, torch.Tensor] = {}

    def has(self, name: str) -> bool:
        return self.inner.has(name)

    def take(self, name: str, shape: tuple[int, ...], kind: WeightKind) -> torch.Tensor:
        t = self.inner.take(name, shape, kind)
        self.taken[name] = t
        return t

    def finish(self) -> None:
        self.inner.finish()


def save_checkpoint(
    config: ModelConfig,
    path: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``config`` with seeded random weights (those :func:`load_model` would build for a
    tiny name with ``seed``) as an HF checkpoint: ``config.json`` + ``model.safetensors``."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    recorder = _Recorder(RandomTensors(seed, dtype))
    build_model(config, recorder)
    hf = config.to_hf()
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    write_safetensors(out / "model.safetensors", recorder.taken, {"format": "pt"})
    return out
